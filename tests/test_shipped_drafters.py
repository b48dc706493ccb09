"""Drafters shipped in the repository stay small enough to commit (20 MiB per drafter folder) and
carry what a user needs to trust them: a config naming the target and a model card."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
LIMIT_BYTES = 20 * 2**20


def kept_out_of_git(folder: Path) -> bool:
    """A drafter trained and installed on this machine but ignored by git (the Qwen2.5-Coder pair's PACER layer,
    over the bound) is not shipped."""
    if shutil.which("git") is None:
        return False
    return subprocess.run(["git", "check-ignore", "-q", str(folder)], cwd=DRAFTERS.parent).returncode == 0


FOLDERS = sorted(p for p in DRAFTERS.glob("*/*") if p.is_dir() and not kept_out_of_git(p))


def test_drafters_ship():
    assert FOLDERS, f"no drafters under {DRAFTERS}"


@pytest.mark.parametrize("folder", FOLDERS, ids=[f"{p.parent.name}/{p.name}" for p in FOLDERS])
def test_each_drafter_is_small_and_documented(folder):
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size <= LIMIT_BYTES, f"{folder} is {size / 2**20:.2f} MiB"
    config = json.loads((folder / "config.json").read_text())
    assert config["target"]["name"] == folder.parent.name
    assert (folder / "README.md").is_file() and (folder / "model.safetensors").is_file()


def test_drafter_root_can_be_moved_with_an_environment_variable(tmp_path, monkeypatch):
    from methods.checkpoints import PACKAGED_DRAFTERS, shipped_drafter

    monkeypatch.delenv("SPECBENCH_DRAFTERS", raising=False)
    assert shipped_drafter("smollm2-135m", "eagle3") == PACKAGED_DRAFTERS / "smollm2-135m" / "eagle3"
    monkeypatch.setenv("SPECBENCH_DRAFTERS", str(tmp_path))  # e.g. a retraining run's output folder
    assert shipped_drafter("smollm2-135m", "specblock-no-shift") == tmp_path / "smollm2-135m" / "specblock-no-shift"


def test_every_default_drafter_is_looked_up_under_the_moved_root(tmp_path, monkeypatch):
    from methods.eagle3.drafter import Eagle3Drafter
    from methods.sps.drafter import SpSDrafter
    from specbench.errors import SpecbenchError
    from tiny import tiny_target

    monkeypatch.setenv("SPECBENCH_DRAFTERS", str(tmp_path))
    target = tiny_target(0)
    with pytest.raises(SpecbenchError, match=str(tmp_path / target.name / "eagle3")):
        Eagle3Drafter().setup(target)
    with pytest.raises(SpecbenchError, match="--opt draft="):  # no shipped draft under the moved root
        SpSDrafter().setup(target)
