"""Drafters shipped in the repository stay small enough to commit (20 MiB per drafter folder) and
carry what a user needs to trust them: a config naming the target and a model card."""

import json
from pathlib import Path

import pytest

DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
LIMIT_BYTES = 20 * 2**20
FOLDERS = sorted(p for p in DRAFTERS.glob("*/*") if p.is_dir())


def test_drafters_ship():
    assert FOLDERS, f"no drafters under {DRAFTERS}"


@pytest.mark.parametrize("folder", FOLDERS, ids=[f"{p.parent.name}/{p.name}" for p in FOLDERS])
def test_each_drafter_is_small_and_documented(folder):
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size <= LIMIT_BYTES, f"{folder} is {size / 2**20:.2f} MiB"
    config = json.loads((folder / "config.json").read_text())
    assert config["target"]["name"] == folder.parent.name
    assert (folder / "README.md").is_file() and (folder / "model.safetensors").is_file()
