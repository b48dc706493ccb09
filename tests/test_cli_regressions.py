"""Command lines that once ended in a traceback (the three from issue 18, the rest found by
test_cli_fuzz.py): each now exits 2 with one line on stderr, before any model is loaded."""

from __future__ import annotations

import pytest
import torch

from bench_data import needs_data
from specbench.engine.target import Target
from test_cli import cli

RUN = ["run", "--method", "sps", "--bench", "humaneval", "--limit", "1"]


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(Target, "load", classmethod(refuse))


def one_line_error(args, capsys, *needles):
    code, _, err = cli(args, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# ---- the three tracebacks named in the issue
def test_malformed_json_config(tmp_path, capsys):
    (tmp_path / "opts.json").write_text('{"gamma": 3,')
    one_line_error(RUN + ["--config", str(tmp_path / "opts.json")], capsys, "opts.json is not valid JSON")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda(capsys):
    one_line_error(RUN + ["--device", "cuda"], capsys, "CUDA is not available", "--device cpu")


def test_unknown_device(capsys):
    one_line_error(RUN + ["--device", "tpu"], capsys, "unknown device 'tpu'")


# ---- found by the fuzzer
def test_rich_markup_in_a_value(capsys):  # was rich.errors.MarkupError
    one_line_error(["run", "--method", "[/]", "--bench", "humaneval"], capsys, "unknown method '[/]'")


def test_line_break_in_a_value(capsys):  # the error line was split in two
    one_line_error(RUN + ["--data-dir", "a\nb"], capsys, "a\\nb is not a folder")


def test_unicode_line_separator_in_a_value(capsys):  # NEL (\x85) split the line for str.splitlines
    one_line_error(RUN + ["--data-dir", "a\x85b"], capsys, "a\\x85b is not a folder")


@needs_data  # train reads its default prompt file (train_prompts/) before it checks --out
def test_path_name_too_long(tmp_path, capsys):  # was OSError (ENAMETOOLONG) from pathlib
    one_line_error(["train", "specblock", "--out", "a" * 300], capsys, "File name too long")
    one_line_error(RUN + ["--out", "b" * 300], capsys, "File name too long")


def test_report_on_a_binary_file(tmp_path, capsys):  # was UnicodeDecodeError
    (tmp_path / "x.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    one_line_error(["report", str(tmp_path / "x.jsonl"), "--out-dir", str(tmp_path / "rep")], capsys,
                   "x.jsonl is not a specbench results file")


def test_report_on_an_unreadable_file(tmp_path, capsys):  # was OSError (EIO)
    one_line_error(["report", "/proc/self/mem", "--out-dir", str(tmp_path / "rep")], capsys, "cannot read results file")


@pytest.mark.parametrize("args,needle", [
    (RUN + ["--limit", "abc"], "Invalid value for '--limit'"),  # was a multi-line usage box
    (["bogus"], "No such command 'bogus'"),
    (["train", "eagle3"], "Missing option '--out'"),
])
def test_usage_errors_are_one_line(capsys, args, needle):
    one_line_error(args, capsys, needle, "--help")


def test_run_without_method_is_one_line(capsys):  # --method is optional since --preset can stand for it
    one_line_error(["run", "--bench", "humaneval"], capsys, "run needs --method and --bench (or --preset PRESET)")


@pytest.mark.parametrize("extra,needle", [
    (["--temperature", "nan"], "--temperature must be a finite number"),  # passed validation, failed mid-run
    (["--top-p", "inf"], "--top-p must be a finite number"),
    (["--passes", "99999999999"], "--passes must be between 1 and"),  # tried to build the whole stream
    (["--attn", "flash_attention_2"], "--attn flash needs a CUDA device"),
    (["--dtype", "int8"], "unknown dtype 'int8'"),
    (["--opt", "gamma=-1"], "sps: option gamma must be >= 1"),
    (["--opt", "gamma=99999999999999999999"], "option gamma must be <= 16777216 (no model holds a longer context)"),
    (["--opt", "draft=/no/such/model"], "/no/such/model does not exist"),
    (["--opt", "=3"], "empty key"),
])
def test_bad_run_values_refused_before_loading(tmp_path, capsys, extra, needle):
    one_line_error(RUN + ["--out", str(tmp_path / "r.jsonl"), *extra], capsys, needle)
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("extra,needle", [
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--held-out", "1.5"], "--held-out must be in [0, 1)"),
    (["--prompts", "/no/such.jsonl"], "does not exist"),
    (["--max-length", "-4"], "--max-length must be >= 1"),
])
def test_bad_train_values_refused_before_loading(tmp_path, capsys, extra, needle):
    one_line_error(["train", "eagle3", "--out", str(tmp_path / "run"), *extra], capsys, needle)


def test_config_yaml_list_for_a_list_option(tmp_path, capsys):
    """A YAML list for a list option is accepted like key=a,b (validation reaches the loader)."""
    (tmp_path / "opts.yaml").write_text("branching: [2, 4, 10, 0]\nbudget: 16\n")
    with pytest.raises(AssertionError, match="a model was loaded"):
        cli(["run", "--method", "specblock", "--bench", "humaneval", "--limit", "1", "--config",
             str(tmp_path / "opts.yaml")], capsys)
