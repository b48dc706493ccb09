"""One declaration per option, for every command: `run`, `parity`, `reproduce`, `merge`, `export`, `recheck`,
`report`, `fetch`, `list methods`, `list benches`, `train data` and every trainer build their flags from ``specbench.options`` declarations (spelling, default, help with its range)
and hold the values to them (ranges, choices, checks, conflicts) in one line each, before anything loads.
The default target is one constant."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import typer.main

from specbench import commands, options
from specbench.cli import app
from specbench.engine import DEFAULT_TARGET
from specbench.run.run_config import ParityConfig, PresetFlags, ReproduceConfig, RunConfig, SideFlags
from specbench.run.tool_configs import (ExportConfig, FetchConfig, ListBenchesConfig, ListMethodsConfig, MergeConfig,
                                    RecheckConfig, ReportConfig)
from specbench.training.cli import DataOptions
from specbench.training.plugin import TrainOptions, registered_trainers
from test_cli_regressions import no_model_loads, one_line_error  # noqa: F401 (an autouse fixture)

ROOT = Path(__file__).resolve().parents[1]


def _params(*path: str) -> dict:
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return {p.name: p for p in cmd.params}


@pytest.mark.parametrize("path,declarations", [
    (("run",), (SideFlags, RunConfig, PresetFlags)),
    (("parity",), (ParityConfig,)),
    (("reproduce",), (ReproduceConfig,)),
    (("train", "data"), (DataOptions,)),
    (("merge",), (MergeConfig,)),
    (("export",), (ExportConfig,)),
    (("recheck",), (RecheckConfig,)),
    (("report",), (ReportConfig,)),
    (("fetch",), (FetchConfig,)),
    (("list", "methods"), (ListMethodsConfig,)),
    (("list", "benches"), (ListBenchesConfig,)),
])
def test_each_commands_flags_are_its_declared_fields(path, declarations):
    params = _params(*path)
    declared = [d for cls in declarations for d in options.declared(cls) if not d.internal]
    assert list(params) == [d.name for d in declared]
    for d in declared:
        assert params[d.name].help == options.help_text(d), (path, d.name)


def test_no_command_declares_a_flag_of_its_own():
    """Every flag comes from a declaration: the command line's modules call no typer.Option/Argument."""
    for path in (ROOT / "specbench" / "cli.py", ROOT / "specbench" / "training" / "cli.py"):
        calls = [node.func.attr for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and node.func.attr in ("Option", "Argument")]
        assert calls == [], path.name


def test_the_data_folder_and_device_flags_share_one_declaration():
    """--data-dir and --device read the same help and check wherever a command takes them."""
    commands_ = (RunConfig, ParityConfig, ReproduceConfig, RecheckConfig, ExportConfig, ListBenchesConfig, DataOptions)
    for cls in commands_:
        known = options.declared_by_name(cls)
        for name, check in (("data_dir", "specbench.data.benchmarks:check_data_dir_option"),
                            ("device", "specbench.engine.devices:resolve_device")):
            if name in known:
                assert known[name].check == check, (cls.__name__, name)


def test_trainers_are_built_from_their_declarations_too():
    for name, trainer in registered_trainers().items():
        params = _params("train", name)
        known = options.declared_by_name(trainer.Options)
        assert set(params) <= set(known), name
        for flag, param in params.items():
            assert param.help == options.help_text(known[flag]), (name, flag)


def test_train_data_shares_the_trainers_declarations():
    shared = options.declared_by_name(TrainOptions)
    data = options.declared_by_name(DataOptions)
    for name in ("prompts", "data_dir", "max_prompt_tokens", "device"):
        assert (data[name].help, data[name].default) == (shared[name].help, shared[name].default), name
    assert (data["limit"].ge, data["batch_size"].ge) == (shared["limit"].ge, shared["batch_size"].ge) == (1, 1)


def test_the_default_target_is_one_constant():
    """Every command's default target is DEFAULT_TARGET, and no other source file under specbench/ spells the
    name as a string of its own (the embedded model's table keys it by the constant too)."""
    for cls in (RunConfig, ParityConfig, TrainOptions, DataOptions):
        assert options.declared_by_name(cls)["target"].default == DEFAULT_TARGET, cls.__name__
    spelled = []
    for path in sorted((ROOT / "specbench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == DEFAULT_TARGET:
                spelled.append(str(path.relative_to(ROOT)))
    assert spelled == ["specbench/engine/__init__.py"]


def test_the_runner_states_no_range_of_its_own():
    """The run's flags are checked by their declarations: no 'must be' message is written in the runner."""
    source = (ROOT / "specbench" / "run" / "runner.py").read_text(encoding="utf-8")
    texts = [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert not [t for t in texts if "must be" in t]


RUN = ["run", "--method", "sps", "--bench", "humaneval", "--limit", "1"]


@pytest.mark.parametrize("args,needle", [
    # ranges and choices the runner once restated by hand
    (RUN + ["--top-p", "0"], "--top-p must be in (0, 1] (got 0.0)"),
    (RUN + ["--top-k", "-1"], "--top-k must be >= 0"),
    (RUN + ["--limit", "0"], "--limit must be >= 1; omit it to run every prompt (got 0)"),
    (RUN + ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (RUN + ["--max-new-tokens", str(2**25)], "--max-new-tokens must be <= 16777216 (no model holds a longer context)"),
    (RUN + ["--budget", str(2**25)], "--budget must be <= 16777216"),
    (RUN + ["--repeats", "0"], "--repeats must be >= 1"),
    (RUN + ["--batch-size", "0"], "--batch-size must be in [1, 256] (got 0)"),
    (RUN + ["--batch-size", "257"], "--batch-size must be in [1, 256] (got 257)"),
    (RUN + ["--sample", "0"], "--sample must be >= 1"),
    (RUN + ["--baseline", "sps"], "--baseline must be one of 'vanilla', 'none' (got 'sps')"),
    (RUN + ["--on-long-prompt", "ignore"], "--on-long-prompt must be one of 'skip', 'fail'"),
    (RUN + ["--device-map", "everywhere"], "--device-map must be one of 'auto', 'balanced'"),
    (RUN + ["--chat-template", "mine"], "unknown --chat-template 'mine'"),
    # the other commands, the same way
    (["parity", "sps", "--limit", "0"], "--limit must be >= 1"),
    (["parity", "sps", "--max-new-tokens", "1"], "--max-new-tokens must be >= 2; the first token comes from the prefill"),
    (["parity", "sps", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["reproduce", "dvi-table2", "--target", "x", "--limit", "0"], "--limit must be >= 1"),
    (["reproduce", "dvi-table2", "--target", "x", "--max-new-tokens", "-3"], "--max-new-tokens must be >= 1"),
    (["train", "data", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["train", "data", "--temperature", "-1"], "--temperature must be >= 0; 0 is greedy"),
    (["train", "data", "--dtype", "int8"], "unknown dtype 'int8'"),
])
def test_every_command_holds_values_to_their_declarations(tmp_path, capsys, args, needle):
    one_line_error(args, capsys, needle)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args,needle", [
    (RUN + ["--resume", "--overwrite"], "--resume and --overwrite cannot be used together"),
    (["reproduce", "dvi-table2", "--target", "x", "--resume", "--overwrite"],
     "--resume and --overwrite cannot be used together"),
    (["parity", "sps", "--all"], "METHOD and --all cannot be used together"),
    (["parity", "--all", "--out", "p.jsonl"], "--all and --out cannot be used together"),
    (["parity", "--all", "--opt", "gamma=3"], "--all and --opt cannot be used together"),
    (["reproduce", "dvi-table2", "--target", "x", "--drafter", "nosuch=/some/dir"],
     "--drafter names 'nosuch', which is unknown (not a registered method; see `specbench list methods`)"),
    (["reproduce", "dvi-table2", "--target", "x", "--drafter", "spss=/some/dir"], "did you mean 'sps'?"),
    (["run", "--preset", "dvi-table2", "--method", "sps", "--bench", "gsm8k", "--dtype", "float32"],
     "--preset dvi-table2 runs the preset's own methods and settings; it does not take --bench, --method"),
    (["run", "--preset", "dvi-table2", "--opt", "gamma=3"], "it does not take --opt"),
    (RUN + ["--dry-run"], "--dry-run prints a preset's plan"),
    (RUN + ["--batch-size", "2", "--repeats", "2"], "--batch-size and --repeats cannot be used together"),
    (RUN + ["--batch-size", "2", "--check", "forced"], "--batch-size and --check cannot be used together"),
    (RUN + ["--continuous"], "--continuous needs --batch-size set away from its default 1"),
    (RUN + ["--batch-size", "1", "--continuous"], "--continuous needs --batch-size set away from its default 1"),
])
def test_conflicts_are_declared_and_refused_in_one_line(tmp_path, capsys, args, needle):
    one_line_error(args, capsys, needle)
    assert not any(tmp_path.iterdir())


def test_run_preset_forwards_every_flag_reproduce_declares(capsys, tmp_path):
    """`run --preset` hands reproduce's own flags on (here --dtype and --max-new-tokens, dropped before)."""
    from test_cli import cli

    code, out, err = cli(["run", "--preset", "dvi-table2", "--target", "lmsys/vicuna-7b-v1.3", "--dtype", "float32",
                          "--max-new-tokens", "64", "--dry-run", "--out", str(tmp_path / "r")], capsys)
    if code == 2 and "no data for bench" in err:
        pytest.skip("needs SPECBENCH_DATA with Spec-Bench's questions")
    assert code == 0, err
    assert "dtype: float32" in out and "max new tokens: 64" in out
    assert not (tmp_path / "r").exists()


def test_command_labels_name_flags_and_arguments():
    label = commands.label(ParityConfig)
    assert (label("method"), label("all_methods"), label("options"), label("max_new_tokens")) == \
        ("METHOD", "--all", "--opt", "--max-new-tokens")
