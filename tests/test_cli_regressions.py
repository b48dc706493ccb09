"""Command lines that once ended in a traceback (the three from issue 18, the rest found by
test_cli_fuzz.py): each now exits 2 with one line on stderr, before any model is loaded."""

from __future__ import annotations

from pathlib import Path

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
    (["--passes", "99999999999"], "--passes must be in [1, 1000]"),  # tried to build the whole stream
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


# ---- issue 60: the hostile inputs that still broke the one-line promise. Each: one line, exit 2, nothing written.
UNDECODABLE = "caf\udce9"  # b"caf\xe9" (Latin-1) as Python decodes a UTF-8 locale's argv: a lone surrogate


@pytest.mark.parametrize("flag", ["--label", "--system-prompt", "--bench", "--out", "--also", "--opt", "--category"])
def test_undecodable_bytes_in_a_value_are_refused_before_loading(tmp_path, capsys, flag):
    value = {"--bench": f"{UNDECODABLE}.jsonl", "--out": str(tmp_path / f"{UNDECODABLE}.jsonl"),
             "--also": f"sps@label={UNDECODABLE}", "--opt": f"draft={UNDECODABLE}"}.get(flag, UNDECODABLE)
    args = RUN + [flag, value] if flag != "--bench" else ["run", "--method", "sps", "--bench", value]
    one_line_error(args, capsys, "holds bytes that are not UTF-8", "caf\\udce9")
    assert not any(tmp_path.iterdir())


def test_undecodable_bytes_from_a_real_shell_are_refused(tmp_path):
    """The same through a real process: argv bytes that are not UTF-8 (here Latin-1 'é')."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "specbench.cli", "run", "--method", "sps", "--bench", "humaneval",
                           "--label", b"caf\xe9"], cwd=tmp_path, capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "--label holds bytes that are not UTF-8" in err and not any(tmp_path.iterdir())


def _results_file(path: Path, record_fields: dict | None = None) -> Path:
    import json

    header = {"type": "header", "meta": {"config_hash": "abc", "target": "t", "temperature": 0.0, "bench": "p",
                                         "stream": ["a"], "stream_turns": [1], "sides": ["sps", "vanilla"]}}
    records = [{"type": "record", "method": m, "new_tokens": [1, 2], "prompt_tokens": 3, "stop_reason": "length",
                "times": {"prefill": 0.1, "verify": 0.2}, "n_verify": 1, "accept_lengths": [1], "tree_sizes": [1],
                "depth_attempts": [1], "depth_accepts": [1], "bench": "p", "prompt_id": "a", "turn": 0}
               for m in ("sps", "vanilla")]
    for key, value in (record_fields or {}).items():
        if value is None:
            del records[0][key]
        else:
            records[0][key] = value
    path.write_text("\n".join(json.dumps(x) for x in [header, *records]) + "\n")
    return path


@pytest.mark.parametrize("command", ["report", "merge"])
@pytest.mark.parametrize("named", ["by a glob", "on the command line"])
def test_a_results_file_named_with_undecodable_bytes_is_refused(tmp_path, capsys, command, named):
    bad = _results_file(tmp_path / f"r{UNDECODABLE}.jsonl")
    given = str(tmp_path / "*.jsonl") if named == "by a glob" else str(bad)
    args = ["report", given, "--out-dir", str(tmp_path / "rep")] if command == "report" else \
        ["merge", given, "--out", str(tmp_path / "m.jsonl")]
    needle = "results file name holds" if named == "by a glob" else "argument 2 holds"
    one_line_error(args, capsys, needle, "bytes that are not UTF-8", "rcaf\\udce9.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == [bad.name]


@pytest.mark.parametrize("command", ["report", "merge"])
@pytest.mark.parametrize("key", ["bench", "prompt_id", "turn", "method"])
def test_a_record_without_its_key_fields_is_refused_by_report_and_merge(tmp_path, capsys, command, key):
    """Schemas apply to merge and report as to run: every reader pairs records by method, bench, prompt, turn."""
    bad = _results_file(tmp_path / "r.jsonl", {key: None})
    args = ["report", str(bad), "--out-dir", str(tmp_path / "rep")] if command == "report" else \
        ["merge", str(bad), "--out", str(tmp_path / "m.jsonl")]
    one_line_error(args, capsys, f"r.jsonl line 2: field {key}: the record has none")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


@pytest.mark.parametrize("kind", ["fifo", "folder", "folder.jsonl", "nothing"])
def test_a_bench_that_is_no_prompt_file_says_what_it_is(tmp_path, capsys, kind):
    import os

    path = tmp_path / ("in" if kind != "folder.jsonl" else "in.jsonl")
    if kind == "fifo":
        path = tmp_path / "in.jsonl"
        os.mkfifo(path)
    elif kind.startswith("folder"):
        path.mkdir()
    what = {"fifo": "is a FIFO", "folder": "is a folder, not a bench name", "folder.jsonl": "is a folder;",
            "nothing": "is nothing (it does not exist)"}[kind]
    one_line_error(["run", "--method", "sps", "--bench", str(path), "--out", str(tmp_path / "r.jsonl")], capsys, what)
    assert not (tmp_path / "r.jsonl").exists()


def test_a_category_given_as_a_list_matches_and_the_message_lists_values(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"id": "1", "turns": ["Hi."], "meta": {"category": ["a"]}}\n'
                                      '{"id": "2", "turns": ["Yo."], "meta": {"category": "b"}}\n')
    base = ["run", "--method", "sps", "--bench", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "r.jsonl")]
    with pytest.raises(AssertionError, match="a model was loaded"):  # 'a' is valid: validation passes
        cli(base + ["--category", "a"], capsys)
    one_line_error(base + ["--category", "c"], capsys, "unknown category 'c' for bench 'p'; valid: a, b")


def test_specbench_data_naming_a_file_is_refused_at_once(tmp_path, capsys, monkeypatch):
    (tmp_path / "data.txt").write_text("not a folder")
    monkeypatch.setenv("SPECBENCH_DATA", str(tmp_path / "data.txt"))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was tried")

    import specbench.data.benchmarks as benchmarks

    monkeypatch.setattr(benchmarks, "_hub_rows", no_hub)
    one_line_error(RUN + ["--out", str(tmp_path / "r.jsonl")], capsys, "SPECBENCH_DATA=", "is a file, not a folder")
    one_line_error(["list", "benches"], capsys, "is a file, not a folder")


def test_fetch_checks_the_sha256_it_recorded(tmp_path, capsys, monkeypatch):
    import hashlib

    from specbench.engine import packaged

    monkeypatch.setenv("SPECBENCH_MODELS", str(tmp_path))
    model = packaged.PartedGGUF("tiny.gguf", "none-part{i}", "0", 1, "x", 8, "a tiny test file")
    monkeypatch.setitem(packaged.PACKAGED, "tiny-test", model)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF\x00\x00\x00\x00")
    record = tmp_path / "tiny.gguf.sha256"
    record.write_text(f"{hashlib.sha256(b'GGUF' + bytes(4)).hexdigest()}  tiny.gguf\n")
    code, out, _ = cli(["fetch", "tiny-test"], capsys)
    assert code == 0 and out.strip() == str(tmp_path / "tiny.gguf")  # whole: nothing to do
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF\x00\x00\x00\x01")  # one byte changed, size kept
    one_line_error(["fetch", "tiny-test"], capsys, "tiny.gguf has sha256", "damaged or replaced",
                   "run `specbench fetch` again")
    record.write_text("not a digest\n")
    one_line_error(["fetch", "tiny-test"], capsys, "tiny.gguf.sha256 holds no sha256")
