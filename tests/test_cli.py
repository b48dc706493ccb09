"""`specbench run` end to end on tiny real models that share the default target's tokenizer:
records, resume after kill -9, and a one-line error (exit 2) for every bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specbench.cli import main
from bench_data import needs_data
from conftest import save_tiny

REPO = Path(__file__).resolve().parents[1]


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the real entry point in-process; returns (exit code, stdout, stderr)."""
    argv = sys.argv
    sys.argv = ["specbench", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return code, out.out, out.err


def base_args(models, out: Path, *extra: str) -> list[str]:
    return ["run", "--method", "sps", "--bench", "humaneval", "--target", models["target"], "--dtype", "float32",
            "--opt", f"draft={models['draft']}", "--opt", "gamma=3", "--max-new-tokens", "12", "--limit", "2",
            "--out", str(out), "--no-warmup", *extra]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_header_and_interleaved_records(models, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    code, stdout, _ = cli(base_args(models, out), capsys)
    assert code == 0 and "specbench summary" in stdout
    lines = read(out)
    header = lines[0]
    assert header["type"] == "header"
    for key in ("git_sha", "versions", "hardware", "threads", "dtype", "attn_implementation", "config_hash", "seed"):
        assert key in header["meta"], key
    records = lines[1:]
    assert sorted(r["method"] for r in records) == ["sps", "sps", "vanilla", "vanilla"]
    by_prompt = {}
    for r in records:
        by_prompt.setdefault(r["prompt_id"], {})[r["method"]] = r["new_tokens"]
    for pair in by_prompt.values():  # fp32 greedy: lossless
        assert pair["sps"] == pair["vanilla"]


@needs_data
def test_mt_bench_second_turn_is_recorded(models, tmp_path, capsys):
    out = tmp_path / "mt.jsonl"
    args = base_args(models, out)
    args[args.index("humaneval")] = "mt_bench"
    assert cli(args, capsys)[0] == 0
    turns = sorted((r["method"], r["turn"]) for r in read(out)[1:] if r["prompt_id"] == read(out)[1]["prompt_id"])
    assert turns == [("sps", 0), ("sps", 1), ("vanilla", 0), ("vanilla", 1)]


def test_kill_9_then_resume_loses_and_duplicates_nothing(models, tmp_path):
    out = tmp_path / "killed.jsonl"
    args = base_args(models, out)
    args[args.index("--limit") + 1] = "6"
    args[args.index("--max-new-tokens") + 1] = "32"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "specbench.cli", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 4):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = out.read_text().splitlines()
    assert 4 <= len(before) < 13, "the run should have been killed mid-way"
    # A torn line, as if the process died during a write.
    with open(out, "a") as fh:
        fh.write('{"type": "record", "method": "sps", "new_tok')
    done = subprocess.run(cmd + ["--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    after = out.read_text().splitlines()
    assert after[: len(before)] == before  # finished records untouched
    keys = [(r["method"], r["prompt_id"], r["turn"]) for r in map(json.loads, after[1:])]
    assert len(keys) == len(set(keys)) == 12  # 6 prompts x (sps, vanilla), each exactly once


def test_resume_with_other_config_is_refused(models, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert cli(base_args(models, out), capsys)[0] == 0
    code, _, err = cli(base_args(models, out, "--resume", "--temperature", "0.7"), capsys)
    assert code == 2 and "different configuration" in err


def test_resume_on_another_machine_is_refused(models, tmp_path, capsys, monkeypatch):
    """One file's sides are compared as if timed on one machine: a resume elsewhere would mix two."""
    import specbench.data.results as results

    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("--limit") + 1] = "1"
    assert cli(args, capsys)[0] == 0
    before = out.read_text()
    monkeypatch.setattr(results, "_cpu_model", lambda: "Some Other CPU")
    args[args.index("--limit") + 1] = "2"
    code, _, err = cli(args + ["--resume"], capsys)
    assert code == 2 and "was started on" in err and "Some Other CPU" in err, err
    assert out.read_text() == before
    monkeypatch.undo()
    assert cli(args + ["--resume"], capsys)[0] == 0  # back on the first machine it continues


@pytest.mark.parametrize("extra,needle", [
    (["--method", "spss"], "did you mean 'sps'"),
    (["--bench", "humanevl"], "did you mean 'humaneval'"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--target", "/nonexistent/model"], "does not exist"),
    (["--opt", "gama=3"], "has no option 'gama'"),
    (["--out", "/proc/forbidden/r.jsonl"], "pass a writable --out"),
])
def test_bad_input_is_one_line_exit_2(models, tmp_path, capsys, extra, needle):
    args = base_args(models, tmp_path / "r.jsonl")
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in args and flag != "--opt":
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    code, _, err = cli(args, capsys)
    assert code == 2, err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_missing_data_names_the_three_places(models, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECBENCH_DATA", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = base_args(models, tmp_path / "r.jsonl")
    args[args.index("humaneval")] = "math500"
    code, _, err = cli(args, capsys)
    assert code == 2 and "SPECBENCH_DATA" in err and "HuggingFaceH4/MATH-500" in err


def test_draft_with_other_tokenizer_is_refused(models, tmp_path, capsys):
    from tokenizers import Tokenizer, models as tk_models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(100)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tk_models.WordLevel(vocab, unk_token="t0")),
                                  eos_token="t1", unk_token="t0")
    other = save_tiny(tmp_path / "other", tok, 3)
    args = base_args(models, tmp_path / "r.jsonl")
    args[args.index(f"draft={models['draft']}")] = f"draft={other}"
    code, _, err = cli(args, capsys)
    assert code == 2 and "different vocabulary" in err


def test_long_prompts_skip_or_fail(models, tmp_path, capsys):
    """Every prompt past the context: skipping them all would record nothing, so both modes refuse."""
    args = base_args(models, tmp_path / "r.jsonl")
    args[args.index(models["target"])] = models["short"]
    args[args.index(f"draft={models['draft']}")] = "draft=truncated:1"
    code, _, err = cli(args, capsys)
    assert code == 2 and "every prompt of humaneval is past the target's context" in err
    code, _, err = cli(args + ["--on-long-prompt", "fail"], capsys)
    assert code == 2 and "context" in err and not (tmp_path / "r.jsonl").exists()


def test_cpu_generation_tells_zen3_from_zen4():
    """Two CPUs with one model name ("AMD EPYC") time bf16 very differently: the header says which one ran."""
    from specbench.engine.devices import cpu_fields
    from specbench.data.results import _cpu_generation

    zen3 = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\n"
    zen4 = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nflags\t\t: avx2 avx512f avx512_bf16\n"
    assert _cpu_generation(cpu_fields(zen3)) == "family 25 model 1, avx2 only"
    assert _cpu_generation(cpu_fields(zen4)) == "family 25 model 17, avx512_bf16"
    assert _cpu_generation(cpu_fields("processor\t: 0\n")) == ""  # no family/model (e.g. some ARM kernels): say nothing


@pytest.mark.parametrize("template,needle", [
    ("{% if %}", "cannot render the prompt"),  # not valid Jinja
    ("{{ raise_exception('no system role') }}", "no system role"),  # valid, but refuses to render
])
def test_a_target_whose_chat_template_cannot_render_is_one_line(models, tmp_path, capsys, template, needle):
    """The template is tried once when the target loads, before any drafter loads or anything is written."""
    import shutil

    folder = tmp_path / "target"
    shutil.copytree(models["target"], folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}))
    (folder / "chat_template.jinja").write_text(template)
    args = base_args(models, tmp_path / "r.jsonl")
    args[args.index(models["target"])] = str(folder)
    code, _, err = cli(args, capsys)
    last = err.strip().splitlines()[-1]  # earlier lines: transformers' own progress bar of the target load
    assert code == 2 and "Traceback" not in err and last.startswith("error: "), err
    assert needle in last and "--chat-template plain" in last
    assert not (tmp_path / "r.jsonl").exists() and not list(tmp_path.glob("r.jsonl*"))


def test_a_file_written_before_sides_were_data_still_resumes(tmp_path, capsys, monkeypatch):
    """A results file whose header recorded its sides only as command-line text (method, options, label, also)
    resumes under the same command line: its identity is read through that text (run_config.identity_of_header).
    The reference set's DDTree budget file and its own command line; the target load is where the check ends."""
    import importlib.util
    import shutil

    from specbench.engine.target import Target

    name = "ddtree-budgets_humaneval_smollm2-135m_T0.jsonl"
    if not (REPO / "results" / name).is_file():
        pytest.skip(f"needs results/{name}")
    spec = importlib.util.spec_from_file_location("reference_set", REPO / "bench" / "reference_set.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = next(argv for out, argv in module.plan(limit=8, repeats=1, stream_limit=8, passes=2) if out.endswith(name))
    old = tmp_path / name
    shutil.copy(REPO / "results" / name, old)
    argv[argv.index("--out") + 1] = str(old)
    assert "--resume" in argv and "side_specs" not in read(old)[0]["meta"]

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(Target, "load", classmethod(reached))
    with pytest.raises(Reached):  # the header's check passed: the run would continue the file
        cli(argv, capsys)
    other = list(argv)
    other[other.index("--max-new-tokens") + 1] = "64"
    code, _, err = cli(other, capsys)
    assert code == 2 and "different configuration" in err
    assert old.read_bytes() == (REPO / "results" / name).read_bytes()
