"""Model and drafter references: a local folder/file, or a Hugging Face hub id ``org/name`` with an
optional revision (``org/name@rev`` or an explicit ``revision``), fetched with
``huggingface_hub.snapshot_download``. ``HF_TOKEN`` opens gated repos; ``HF_HUB_OFFLINE=1`` serves
from the local HF cache only. A resolved reference carries the commit sha it came from (None for
local paths), so results can name the exact weights."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from specbench.errors import SpecbenchError

# Hub repo ids: "org/name" with letters, digits, '-', '_', '.' (huggingface_hub's own rule, minus '--').
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
# A full model on the Hub: config, tokenizer and safetensors weights; originals and other formats are skipped.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "tokenizer*"]
MODEL_BIN_FILES = ["*.json", "pytorch_model*.bin", "*.model", "*.txt", "*.tiktoken", "*.jinja", "tokenizer*"]
# Duplicates of the weights in the authors' own formats (Llama's original/, Mistral's consolidated.*).
MODEL_SKIP = ["original/*", "consolidated*"]


@dataclass(frozen=True)
class Resolved:
    """Where a reference's files are on this machine, and which commit they are (None: local)."""

    spec: str  # what the user passed, revision included
    path: Path
    repo_id: str | None = None
    revision: str | None = None  # as asked for (branch, tag or sha); None = main
    sha: str | None = None  # the commit the files came from

    def as_dict(self) -> dict:
        return {"spec": self.spec, "repo_id": self.repo_id, "revision": self.revision, "sha": self.sha,
                "path": str(self.path)}


def offline() -> bool:
    """HF_HUB_OFFLINE read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().lower() in ("1", "on", "yes", "true")


def hub_cache() -> str | None:
    """HF_HUB_CACHE / HF_HOME read now; None = huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def split_reference(spec: str, revision: str | None = None) -> tuple[str, str | None]:
    """``org/name@rev`` -> (``org/name``, ``rev``); an explicit ``revision`` must agree with ``@rev``."""
    name, at, rev = spec.partition("@")
    if not at or is_local(spec):
        return spec, revision or None
    if not rev:
        raise SpecbenchError(f"{spec!r} ends in '@' without a revision; write org/name@REVISION (branch, tag or commit)")
    if revision and revision != rev:
        raise SpecbenchError(f"{spec!r} names revision {rev!r} but revision={revision!r} was also given; keep one")
    return name, rev


def is_local(spec: str) -> bool:
    """An existing local path; one that cannot be reached (permissions, a name too long) is one line."""
    try:
        return Path(spec).expanduser().exists()
    except OSError as exc:
        raise SpecbenchError(f"{spec}: cannot reach it ({exc.strerror}); check its permissions") from None


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and "--" not in name and ".." not in name and not name.endswith(".")


def check_reference(spec: str, revision: str | None = None, what: str = "drafter") -> None:
    """Validate without touching the network: an existing local path, or a plausible hub id."""
    name, rev = split_reference(spec, revision)
    if is_local(name):
        if rev:
            raise SpecbenchError(f"{what} {name} is a local path; a revision ({rev!r}) applies to hub ids only")
        return
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise SpecbenchError(f"{what} {spec} does not exist; pass an existing folder or a hub id org/name "
                             "(org/name@REVISION for a branch, tag or commit)")
    if not looks_like_hub_id(name):
        raise SpecbenchError(f"{what} {spec!r} is neither an existing folder nor a hub id org/name "
                             "(org/name@REVISION for a branch, tag or commit)")


def resolve(spec: str, revision: str | None = None, what: str = "drafter",
            allow_patterns: list[str] | None = None, ignore_patterns: list[str] | None = None) -> Resolved:
    """Local path as is; a hub id downloaded (or found in the HF cache) at its revision."""
    check_reference(spec, revision, what)
    name, rev = split_reference(spec, revision)
    if is_local(name):
        return Resolved(spec, Path(name).expanduser())
    try:
        path = _snapshot(name, rev, what, allow_patterns, ignore_patterns)
    except SpecbenchError as exc:  # "runs/drafter" may have been meant as a folder
        raise SpecbenchError(f"{exc} (no local folder {name} exists either)") from None
    return Resolved(spec, path, name, rev, path.name if _SHA.match(path.name) else None)


def resolve_model(spec: str, revision: str | None = None, what: str = "model") -> Resolved:
    """A whole causal LM from the Hub: safetensors weights, or PyTorch .bin where a repo has only those."""
    resolved = resolve(spec, revision, what, MODEL_FILES, MODEL_SKIP)
    if resolved.repo_id and not any(resolved.path.glob("*.safetensors")):
        resolved = resolve(spec, revision, what, MODEL_BIN_FILES, MODEL_SKIP)
    return resolved


def _snapshot(repo_id: str, revision: str | None, what: str, allow_patterns: list[str] | None,
              ignore_patterns: list[str] | None = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{repo_id}@{revision}" if revision else repo_id
    local = offline()
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=hub_cache(), allow_patterns=allow_patterns,
                                   ignore_patterns=ignore_patterns, local_files_only=local,
                                   token=os.environ.get("HF_TOKEN") or None)
    except GatedRepoError:
        raise SpecbenchError(f"{what} {repo_id} is a gated repo: accept its terms on huggingface.co and set HF_TOKEN "
                             "(or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise SpecbenchError(f"{what} {repo_id} has no revision {revision!r}; pass an existing branch, tag or "
                             "commit sha") from None
    except RepositoryNotFoundError:
        raise SpecbenchError(f"{what} {repo_id} was not found on the Hub (or is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise SpecbenchError(_not_cached(repo_id, revision, what, local)) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:  # network down, Hub errors, an unwritable cache
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SpecbenchError(f"could not fetch {what} {where} ({first})") from None
    return Path(folder)


def _not_cached(repo_id: str, revision: str | None, what: str, local: bool) -> str:
    """Why an id is not in the cache: the repo is absent, or only other revisions are."""
    from huggingface_hub import constants

    where = f"{repo_id}@{revision}" if revision else repo_id
    repo_dir = Path(hub_cache() or constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    cached = sorted(p.name for p in (repo_dir / "refs").glob("*")) if (repo_dir / "refs").is_dir() else []
    reason = "HF_HUB_OFFLINE=1 is set" if local else "the Hub could not be reached"
    if revision and repo_dir.is_dir():
        have = f" (cached: {', '.join(cached)})" if cached else ""
        return (f"{what} {repo_id} has no revision {revision!r} in the local HF cache{have} and {reason}; "
                "pass a cached revision, or drop HF_HUB_OFFLINE to download it")
    return (f"{what} {where} is not in the local HF cache and {reason}; drop HF_HUB_OFFLINE=1 to download it, "
            f"or pre-download it with `hf download {repo_id}`")
