"""`specbench run --budget B`: every side whose method has a node-budget option gets B drafted nodes
per verify (each method's own option, in its own unit), a side's explicit setting wins, and the
budget is part of the run's identity and header."""

import pytest

from specbench.engine.registry import method_class, parse_options
from specbench.errors import SpecbenchError
from specbench.run.plan import RunConfig, run_sides, validate
from specbench.sides import Side, cli_sides
from test_cli import cli, read


def test_budget_sets_each_methods_own_option_and_explicit_settings_win():
    cfg = RunConfig(sides=cli_sides("eagle3", {}, also=["specblock", "ddtree@budget=8", "medusa", "sps", "dflash",
                                                         "specblock-no-shift"]), bench="humaneval", budget=16)
    options = {s.label: s.options for s in run_sides(cfg)}
    assert options == {"eagle3": {"total_tokens": 17}, "specblock": {"budget": 16},
                       "ddtree@budget=8": {"budget": "8"}, "medusa": {"max_nodes": 16}, "sps": {}, "dflash": {},
                       "specblock-no-shift": {"budget": 16}}
    assert parse_options(method_class("eagle3"), options["eagle3"]).total_tokens == 17  # root + 16 drafted
    assert parse_options(method_class("medusa"), options["medusa"]).max_nodes == 16
    assert cfg.identity()["budget"] == 16
    assert "budget" not in RunConfig(sides=[Side("eagle3")], bench="humaneval").identity()  # only when set


def test_budget_below_one_is_refused():
    with pytest.raises(SpecbenchError, match="--budget must be >= 1"):
        validate(RunConfig(sides=[Side("eagle3")], bench="humaneval", budget=0))


def test_cli_budget_reaches_the_drafter_and_the_header(models, tmp_path, capsys):
    import torch

    from methods.medusa.drafter import MedusaHeads, save_medusa
    from specbench.engine.target import Target

    target = Target.load(models["target"], "float32")
    torch.manual_seed(0)
    recipe = {"epochs": 1, "max_steps": 3, "lr": 0.01, "extra": {"variant": "tiny", "data": "not kept"}}
    save_medusa(tmp_path / "heads", MedusaHeads.for_target(target, 3, num_layers=1), target, recipe)
    out = tmp_path / "r.jsonl"
    code, _, err = cli(["run", "--method", "medusa", "--bench", "humaneval", "--target", models["target"], "--dtype",
                        "float32", "--opt", f"path={tmp_path / 'heads'}", "--max-new-tokens", "8", "--limit", "1",
                        "--out", str(out), "--no-warmup", "--budget", "3"], capsys)
    assert code == 0, err
    header = read(out)[0]["meta"]
    assert header["budget"] == 3 and header["method_options"]["medusa"]["max_nodes"] == 3
    # what trained the side's drafter (its folder's recipe, summarised), for the report's ablation groups
    assert header["drafter_recipes"] == {"medusa": {"path": {"epochs": 1, "max_steps": 3, "lr": 0.01, "variant": "tiny"}}}
