"""One option declaration per method: it validates --opt values (types, Literal choices, ranges, negative
values where the range allows them), bounds token counts by the target's context before any drafter loads
weights, and is what `specbench list methods NAME` and the train commands' help show."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import pytest

from methods.sps.drafter import SpSDrafter
from specbench import options
from specbench.engine import registry
from specbench.engine.drafter import Drafter
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.target import Target
from specbench.engine.tree import DraftTree
from test_cli import cli
from test_cli_regressions import one_line_error  # the one-line-error check the regressions use


@dataclass
class ShiftOptions:
    shift: int = option(-1, "A signed offset.", ge=-3, le=3)
    mode: Literal["near", "far"] = option("near", "Where to look.")
    widths: list[int] = option([1, 2], "Per-level widths.", ge=0)
    scale: float = option(0.5, "A fraction.", ge=0, lt=1)


class ShiftDrafter(Drafter):
    Options = ShiftOptions

    def propose(self, state):
        return DraftTree.empty()


@pytest.fixture
def shift():
    cls = registry.register("shift-test")(ShiftDrafter)
    yield cls
    registry._LOCAL.pop("shift-test", None)


def test_negative_values_follow_the_declared_range(shift):
    assert registry.create_drafter("shift-test", {"shift": "-3"}).options.shift == -3
    assert registry.create_drafter("shift-test", {}).options.shift == -1  # the negative default is valid too
    with pytest.raises(SpecbenchError, match=r"shift-test: option shift must be in \[-3, 3\] \(got '-4'\)"):
        registry.create_drafter("shift-test", {"shift": "-4"})


def test_literal_lists_and_floats_are_checked_by_type(shift):
    assert registry.create_drafter("shift-test", {"mode": "far", "widths": [3, 0]}).options.widths == [3, 0]
    for raw, needle in [({"mode": "wide"}, "option mode must be one of 'near', 'far' (got 'wide')"),
                        ({"widths": "1,-1"}, "option widths must be >= 0 (got '-1')"),
                        ({"widths": "1,x"}, "option widths expects a whole number (got 'x')"),
                        ({"scale": "1"}, "option scale must be in [0, 1) (got '1')"),
                        ({"scale": "nan"}, "option scale must be a finite number"),
                        ({"shift": {"a": 1}}, "option shift must be a single value or a list")]:
        with pytest.raises(SpecbenchError) as info:
            registry.create_drafter("shift-test", raw)
        assert needle in str(info.value)


def test_options_built_in_code_meet_the_same_declaration(shift):
    with pytest.raises(SpecbenchError, match="option mode must be one of"):
        ShiftDrafter(ShiftOptions(mode="wide"))


def test_a_bad_literal_value_is_one_line_before_anything_loads(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad option was refused")

    monkeypatch.setattr(Target, "load", classmethod(refuse))
    one_line_error(["run", "--method", "specblock", "--bench", "humaneval", "--limit", "1", "--opt", "slot0=wide"],
                   capsys, "specblock: option slot0 must be one of 'beam', 'rank' (got 'wide')")


@pytest.mark.parametrize("extra,needle", [
    (["--opt", "gamma=400"], "sps: option gamma=400 does not fit the target's context of 512 tokens beside "
                             "--max-new-tokens 128 (at most 383)"),
    (["--budget", "400"], "ddtree: option budget=400 does not fit"),  # --budget sets ddtree's budget option
])
def test_token_counts_beyond_the_context_are_refused_before_the_drafter_loads(models, monkeypatch, tmp_path, capsys,
                                                                               extra, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "p0", "turns": ["Say hi."]}\n')
    loaded = []
    real_load = Target.load.__func__

    def load(cls, *args, **kwargs):  # the target loads: its config is what bounds the options
        loaded.append(args[0])
        return real_load(cls, *args, **kwargs)

    def no_weights(self, target):
        raise AssertionError("a drafter loaded its weights before its options were checked")

    monkeypatch.setattr(Target, "load", classmethod(load))
    monkeypatch.setattr(SpSDrafter, "setup", no_weights)
    monkeypatch.setattr(registry.method_class("ddtree"), "setup", no_weights)
    method = ["--method", "ddtree"] if "--budget" in extra else ["--method", "sps", "--opt", f"draft={models['draft']}"]
    out = tmp_path / "r.jsonl"
    code, _, err = cli(["run", *method, "--bench", str(prompts), "--target", models["target"], "--dtype", "float32",
                        "--max-new-tokens", "128", "--out", str(out), "--no-warmup", *extra], capsys)
    last = err.strip().splitlines()[-1]  # earlier lines: transformers' own progress bar of the target load
    assert code == 2 and last.startswith("error: ") and needle in last and "Traceback" not in err, err
    assert loaded == [models["target"]] and not out.exists()


def test_list_methods_name_shows_the_declaration(capsys):
    for name in ("sps", "specblock", "dvi"):
        code, out, _ = cli(["list", "methods", name], capsys)
        assert code == 0
        text = " ".join(out.split())
        for row in options.describe(registry.method_class(name).Options):
            assert row["option"] in text and row["range"] in text, row
            assert " ".join(row["help"].split()[:3]) in text, row  # the help's first words (the table wraps the rest)
    code, out, _ = cli(["list", "methods", "specblock"], capsys)
    assert "'beam' | 'rank'" in out and "list of int" in out
    code, out, _ = cli(["list", "methods", "vanilla"], capsys)
    assert code == 0 and "vanilla takes no options" in out


def test_train_help_shows_the_declared_ranges():
    from specbench.training.cli import trainer_command
    from specbench.training.plugin import registered_trainers

    helps = {p.name: p.help for p in trainer_command("eagle3", registered_trainers()["eagle3"]).params}
    assert helps["epochs"] == "Passes over the training data. (value >= 1)"
    assert helps["held_out"] == "Share of examples kept for evaluation. (0 <= value < 1)"
    assert helps["target"] == "Target the drafter is trained for."  # no range, no brackets


def test_every_method_declares_help_for_every_option():
    for name in registry.available_methods():
        cls = registry.method_class(name)
        missing = [d.name for d in options.declared(cls.Options) if not d.help]
        assert not missing, (name, missing)


def test_every_run_flag_is_a_declared_field():
    """`specbench run`'s flags are the declared fields of RunConfig (what a run is), SideFlags (how the command
    line writes its sides) and PresetFlags (--preset, --dry-run), so a new flag cannot be dropped silently."""
    import inspect

    from specbench.cli import run
    from specbench.run.run_config import PresetFlags, RunConfig, SideFlags

    declared = [d.name for cls in (SideFlags, RunConfig, PresetFlags) for d in options.declared(cls) if not d.internal]
    assert list(inspect.signature(run).parameters) == ["ctx", *declared]  # ctx: which flags the line gave
    assert not {"sides", "config_file", "prompts"} & set(declared)  # set by code, never a flag


def test_run_flags_take_help_default_and_spelling_from_the_field():
    import typer.main

    from specbench.cli import app
    from specbench.engine import DEFAULT_TARGET
    from specbench.run.run_config import RunConfig
    from specbench.run.run_config import PresetFlags, SideFlags
    from specbench.sides import Side

    command = typer.main.get_command(app).commands["run"]
    params = {p.name: p for p in command.params}
    for cls in (SideFlags, RunConfig, PresetFlags):
        for declared in options.declared(cls):
            if not declared.internal:
                assert params[declared.name].help == options.help_text(declared), declared.name
    assert params["attn_implementation"].opts == ["--attn"]
    assert params["passes"].help.endswith("(1 <= value <= 1000)")  # the range, from the declaration
    assert set(params["method"].opts) == {"--method", "-m"} and params["method"].default is None
    run = RunConfig(sides=[Side("m")], bench="b")
    assert params["dtype"].default == "auto" and run.dtype == "bfloat16"
    assert run.target == DEFAULT_TARGET == params["target"].default


@dataclass
class Paired:
    size: int = option(1, "How many at once.", ge=1)
    refill: bool = option(False, "Refill at once.", requires="size")
    name: str | None = option(None, "A name.")
    tagged: bool = option(False, "Tag the output.", requires="name")


@pytest.mark.parametrize("values,needle", [
    ({"refill": True}, "--refill needs --size set away from its default 1 (--refill: Refill at once); pass --size "
                       "too or drop --refill"),
    ({"tagged": True}, "--tagged needs --name set (--tagged: Tag the output)"),  # no default worth naming
    ({"size": 1, "refill": True}, "--refill needs --size set away from its default 1"),  # the default, given
])
def test_an_option_set_without_what_it_requires_is_one_line(values, needle):
    label = lambda name: "--" + name  # noqa: E731
    with pytest.raises(SpecbenchError) as caught:
        options.validate(Paired(**values), "paired", label)
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    assert options.validate(Paired(size=2, refill=True, name="x", tagged=True), "paired", label).refill
