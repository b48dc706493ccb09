"""docs/writing-a-method.md is runnable: its drafter (at most 40 lines) and its pyproject are taken
from the page, installed as a package outside the tree (as pip lays one out), listed and run by the
real command line; greedy, its text equals vanilla's and it drafted tokens the target accepted."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from specbench.engine.drafter import DecodeState
from specbench.engine.verify import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "writing-a-method.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.DOTALL)


def install(root: Path) -> tuple[str, str]:
    """Write the page's module and a dist-info with its entry points; (method name, module name)."""
    code, = blocks("python")
    toml, = blocks("toml")  # read with a pattern: tomllib is Python 3.11+
    field = {k: v for k, v in re.findall(r'^(name|version) = "(.+)"$', toml, re.MULTILINE)}
    section = toml.split('[project.entry-points."specbench.methods"]')[1]
    name, value = re.search(r'^(\S+) = "(.+)"$', section, re.MULTILINE).groups()
    module = value.split(":")[0]
    root.mkdir()
    (root / f"{module}.py").write_text(code)
    info = root / f"{module}-{field['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {field['name']}\nVersion: {field['version']}\n")
    (info / "entry_points.txt").write_text(f"[specbench.methods]\n{name} = {value}\n")
    return name, module


def test_the_page_shows_a_short_drafter():
    code, = blocks("python")
    assert len(code.strip().splitlines()) <= 40


def test_the_drafter_copies_what_followed_the_last_match(tmp_path):
    _, module = install(tmp_path / "site")
    spec = importlib.util.spec_from_file_location(module, tmp_path / "site" / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    drafter = mod.PromptLookupDrafter()
    state = DecodeState(tokens=[5, 6, 7, 8, 9, 1, 5, 6], prompt_len=4, params=SamplingParams())
    assert drafter.propose(state).token_list == [7, 8, 9, 1]
    assert len(drafter.propose(DecodeState([1, 2, 3], 3, SamplingParams()))) == 0


def test_the_page_installs_lists_and_runs_equal_to_vanilla(models, tmp_path):
    name, _ = install(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]), "OMP_NUM_THREADS": "1",
           "SPECBENCH_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}

    def specbench(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "specbench", *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"specbench {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    assert name in specbench("list", "methods")
    # Prompts that repeat themselves, so the lookup finds matches on a tiny random target too.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"one two three {i} one two three {i} one two"]})
                               + "\n" for i in range(3)))
    out = tmp_path / "lookup.jsonl"
    specbench("run", "--method", name, "--opt", "ngram=1", "--bench", str(prompts), "--target", models["target"],
              "--dtype", "float32", "--max-new-tokens", "24", "--no-warmup", "--out", str(out))
    records = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    sides: dict[str, dict[str, list[int]]] = {}
    for r in records:
        sides.setdefault(r["prompt_id"], {})[r["method"]] = r["new_tokens"]
    assert len(sides) == 3 and all(s[name] == s["vanilla"] for s in sides.values())
    drafted = [r for r in records if r["method"] == name]
    assert sum(map(sum, (r["tree_sizes"] for r in drafted))) > 0  # it drafted: the check above is not vacuous
    assert sum(map(sum, (r["accept_lengths"] for r in drafted))) > 0  # and the target accepted some
