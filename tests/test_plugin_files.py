"""Presets and claims come from the packages that declare them (entry-point groups specbench.presets and
specbench.claims), not from the core: a throwaway package outside the tree ships both and the CLI finds
them; `--drafter NAME=VALUE` fills the weights option the method adds itself; bad files fail in one line."""

from __future__ import annotations

import re

import pytest

from specbench.errors import SpecbenchError
from specbench.analysis.orderings import Claim, Sides, load_claims, read_claims
from specbench.data.plugin_files import declared_paths
from specbench.data.preset_files import preset_names
from specbench.run.preset import build_plan, drafter_option
from bench_data import needs_data
from test_cli import cli

TOY_PRESET = """\
name: toy-table
title: "Toy Table 1: one bench, SpS against vanilla"
paper: "Toy paper, Table 1"
metric: {name: end_to_end_speedup, description: "tokens/s ratio", source: "Toy §4"}
temperatures: [0.0]
temperatures_source: "Toy §4"
max_new_tokens: 16
max_new_tokens_source: "Toy §4"
dtype: float32
dtype_source: "Toy §4"
targets:
  - id: toy/target
    drafters:
      sps: {draft: toy/draft, source: "Toy README"}
benches:
  - {bench: mt_bench, n: 2, source: "Toy §4"}
methods:
  - {label: sps, method: sps, drafter: sps, options: {gamma: 3}, source: "Toy §4"}
"""

TOY_CLAIMS = """\
- text: "SpS faster than vanilla on the toy"
  source: "Toy Table 1"
  a: {method: sps}
  b: {method: vanilla}
"""


def install(root, name: str, groups: dict[str, dict[str, str]], files: dict[str, str], monkeypatch) -> None:
    """A package NAME under ROOT with FILES, made visible to importlib.metadata with GROUPS' entry points."""
    for rel, text in files.items():
        (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / name / rel).write_text(text)
    dist = root / f"{name}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()))
    monkeypatch.syspath_prepend(str(root))


@needs_data
def test_a_package_outside_the_tree_ships_presets_and_claims(tmp_path, monkeypatch, capsys):
    init = ("from pathlib import Path\nPRESETS = Path(__file__).parent / 'presets'\n"
            "CLAIMS = Path(__file__).parent / 'claims.yaml'\n")
    install(tmp_path, "toyspec", {"specbench.presets": {"toyspec": "toyspec:PRESETS"},
                                  "specbench.claims": {"toyspec": "toyspec:CLAIMS"}},
            {"__init__.py": init, "presets/toy-table.yaml": TOY_PRESET, "claims.yaml": TOY_CLAIMS}, monkeypatch)
    assert tmp_path / "toyspec" / "presets" in declared_paths("specbench.presets")
    assert "toy-table" in preset_names()
    assert Claim("SpS faster than vanilla on the toy", "Toy Table 1", Sides(method=("sps",)),
                 Sides(method=("vanilla",))) in load_claims()
    code, out, _ = cli(["list", "presets"], capsys)
    assert code == 0 and "toy-table" in out
    drafter = tmp_path / "d" / "sps"
    drafter.mkdir(parents=True)  # --drafter must name a folder that exists (or a hub id)
    code, out, err = cli(["reproduce", "toy-table", "--target", "toy/target", "--dry-run", "--drafter",
                          f"sps={drafter}", "--out-dir", str(tmp_path / "r")], capsys)
    assert code == 0, err
    assert f"sps: sps draft={drafter} gamma=3  [Toy §4]" in out  # --drafter sps fills SpS's own weights option
    assert "mt_bench: 2 prompts, 4 turns" in out and "runs (1 results files)" in out
    assert not (tmp_path / "r").exists()


def test_drafter_option_is_the_weights_option_the_method_adds():
    # PACER's drafter adds its pre-verifier to SpS's draft model; DVI's weights are its head.
    assert {m: drafter_option(m) for m in ("sps", "pacer", "dvi", "dflash", "eagle3", "medusa", "specblock")} == \
           {"sps": "draft", "pacer": "pacer", "dvi": "head", "dflash": "path", "eagle3": "path", "medusa": "path",
            "specblock": "path"}
    assert drafter_option("vanilla") == "path" and drafter_option("no-such-method") == "path"


@needs_data
def test_the_shipped_presets_and_claims_are_found():
    assert {"specblock-table1", "ddtree-table1", "pacer-table1", "dvi-table2"} <= set(preset_names())
    claims = load_claims()
    assert len(claims) == 14 and claims[0].text == "SpecBlock faster than EAGLE-3"  # the table's order
    assert "lookahead faster than vanilla" in [c.text for c in claims]  # the training-free methods' claims too
    assert "PACER with t tuned for the pair faster than the best fixed γ" in [c.text for c in claims]
    plan = build_plan("pacer-table1", "x/y", max_new_tokens=8, drafters={"pacer": "/p", "sps": "/s"})
    assert {s.label: s.side.options for s in plan.sides}["pacer"]["pacer"] == "/p"


@pytest.mark.parametrize("text, message", [
    ("a: b", "must be a YAML list of mappings"),
    ("- {text: t, source: s, a: x, colour: red}", "unknown field 'colour'"),
    ("- {text: t, a: x}", "no source"),
    ("- {text: t, source: s, a: {method: x}, metric: bleu}", "metric 'bleu' is not one of speedup"),
    ("- {text: t, source: s, a: {method: x}, compare: worst}", "compare 'worst' is not one of each, best, next, quarters"),
    ("- {text: t, source: s, a: 'x@gamma=\\d+', b: {method: y}}", "claim 1, a: expected a mapping"),
    ("- {text: t, source: s, a: {options: {gamma: 4}}}", "name a method, family or ablation_of"),
    ("- {text: t, source: s, a: {method: x, label: y}}", "unknown field 'label'"),
    ("- {text: t, source: s, a: {method: [x, 3]}}", "method must be a name or a list of names"),
    ("- {text: t, source: s, a: {method: x}, compare: best}", "compare 'best' needs b"),
    ("- [unclosed", "claims file"),
])
def test_a_bad_claims_file_fails_in_one_line(tmp_path, text, message):
    path = tmp_path / "claims.yaml"
    path.write_text(text)
    with pytest.raises(SpecbenchError) as e:
        read_claims(path)
    assert message in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


def test_one_preset_name_shipped_twice_or_a_missing_path_is_refused(tmp_path, monkeypatch):
    init = "from pathlib import Path\nA = Path(__file__).parent / 'a'\nB = Path(__file__).parent / 'b'\n"
    install(tmp_path, "twinspec", {"specbench.presets": {"one": "twinspec:A", "two": "twinspec:B"},
                                   "specbench.claims": {"bad": "twinspec:MISSING"}},
            {"__init__.py": init, "a/same.yaml": TOY_PRESET, "b/same.yaml": TOY_PRESET}, monkeypatch)
    with pytest.raises(SpecbenchError, match="preset same is shipped twice"):
        preset_names()
    with pytest.raises(SpecbenchError, match=re.escape("entry point bad = 'twinspec:MISSING' of group specbench.claims")):
        load_claims()
