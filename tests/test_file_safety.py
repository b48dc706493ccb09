"""Nothing lost, nothing overwritten: every way a hostile or careless command line could destroy,
silently lose or half-write a file ends in one line and exit 2 (or completes correctly), with every
original file byte-identical afterwards and no temporary, lock or header-only file left behind.
Signals: a stop during a long step or a model load is honoured within seconds, and Ctrl-C, however
fast and however often it is pressed, prints what was kept and the command that resumes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specbench.data.safe_files import WriterLock
from specbench.engine.target import Target
from test_cli import REPO, base_args, cli

PROMPTS = [{"id": "a", "turns": ["Say hi."], "meta": {"category": "writing"}},
           {"id": "b", "turns": ["Count to three."], "meta": {"category": "math"}}]


def one_line(code: int, err: str, *needles: str) -> str:
    """Exit 2 and exactly one line on stderr (loading and progress bars aside); returns the line."""
    lines = [x for x in err.replace("\r", "\n").splitlines()
             if x.strip() and "it/s]" not in x and not re.search(r"\d+/\d+ [\d:]+ eta", x)]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(*paths: Path) -> dict:
    return {p: (p.read_bytes() if p.is_file() else None) for p in paths}


def no_strays(folder: Path) -> None:
    """No temporary, lock, .merging or header-only file is left in ``folder``."""
    strays = [p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".lock", ".merging"))]
    assert not strays, strays
    for p in folder.glob("*.jsonl"):
        text = p.read_text(errors="replace").splitlines()
        assert not (len(text) == 1 and '"type": "header"' in text[0]), f"{p} holds only a header"


def prompt_file(path: Path, rows=PROMPTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def finished(models, tmp_path_factory) -> Path:
    """A finished results file (2 prompts x sps, vanilla), copied by the tests that damage it."""
    folder = tmp_path_factory.mktemp("finished")
    out = folder / "r.jsonl"
    args = base_args(models, out)
    args[args.index("humaneval")] = str(prompt_file(folder / "prompts.jsonl"))  # categories, for export
    argv = sys.argv
    sys.argv = ["specbench", *args]
    try:
        from specbench.cli import main

        with pytest.raises(SystemExit) as done:
            main()
        assert done.value.code == 0
    finally:
        sys.argv = argv
    return out


def copy_of(finished: Path, tmp_path: Path, name: str = "r.jsonl") -> Path:
    out = tmp_path / name
    shutil.copyfile(finished, out)
    return out


# ------------------------------------------------------------------------------------------ data destroyed

def test_overwrite_keeps_the_old_file_when_the_target_fails_to_load(models, finished, tmp_path, capsys):
    keep = copy_of(finished, tmp_path, "keep.jsonl")
    before = snapshot(keep)
    args = base_args(models, keep, "--overwrite")
    args[args.index(models["target"])] = str(tmp_path / "no_such_model")
    one_line(*cli(args, capsys)[::2], "does not exist")
    assert snapshot(keep) == before
    no_strays(tmp_path)


def test_overwrite_keeps_the_old_file_when_the_run_fails_before_its_first_record(models, finished, tmp_path,
                                                                                   capsys):
    keep = copy_of(finished, tmp_path, "keep.jsonl")
    before = snapshot(keep)
    args = base_args(models, keep, "--overwrite", "--on-long-prompt", "fail")
    args[args.index(models["target"])] = models["short"]  # every prompt is too long for its context
    args[args.index(f"draft={models['draft']}")] = "draft=truncated:1"
    one_line(*cli(args, capsys)[::2], "context")
    assert snapshot(keep) == before
    no_strays(tmp_path)


@pytest.mark.parametrize("alias", ["bench", "config", "target"])
def test_an_output_that_is_one_of_the_inputs_is_refused(models, tmp_path, capsys, alias):
    bench = prompt_file(tmp_path / "p.jsonl")
    config = tmp_path / "cfg.json"
    config.write_text('{"gamma": 3}')
    target = Path(models["target"]) / "config.json"  # a file of the target's folder stands for the target
    out = {"bench": bench, "config": config, "target": target}[alias]
    before = snapshot(bench, config, target)
    args = base_args(models, out, "--overwrite", "--config", str(config))
    args[args.index("humaneval")] = str(bench)
    if alias == "target":
        args += ["--opt", f"draft={target}"]
    one_line(*cli(args, capsys)[::2], "writing it would destroy the input")
    assert snapshot(bench, config, target) == before
    no_strays(tmp_path)


def test_a_hard_link_to_an_input_is_the_input(models, tmp_path, capsys):
    bench = prompt_file(tmp_path / "p.jsonl")
    link = tmp_path / "results.jsonl"
    os.link(bench, link)
    before = snapshot(bench)
    args = base_args(models, link, "--overwrite")
    args[args.index("humaneval")] = str(bench)
    one_line(*cli(args, capsys)[::2], "--bench")
    assert snapshot(bench) == before


@pytest.mark.parametrize("kind", ["device", "symlink to a device", "fifo", "symlink to a file", "folder"])
def test_devices_fifos_symlinks_and_folders_are_refused(models, finished, tmp_path, capsys, kind):
    real = copy_of(finished, tmp_path, "real.jsonl")
    before = snapshot(real)
    if kind == "device":
        out = Path("/dev/null")
    elif kind == "fifo":
        out = tmp_path / "pipe.jsonl"
        os.mkfifo(out)
    elif kind == "folder":
        out = tmp_path / "folder.jsonl"
        out.mkdir()
    else:
        out = tmp_path / "link.jsonl"
        out.symlink_to("/dev/null" if "device" in kind else real)
    code, _, err = cli(base_args(models, out, "--overwrite"), capsys)
    one_line(code, err, str(out))
    assert "disk" not in err  # (it used to blame a full disk)
    assert snapshot(real) == before
    if kind == "device":
        assert Path("/dev/null").is_char_device()
    elif kind == "fifo":
        assert out.is_fifo()
    elif kind != "folder":
        assert out.is_symlink()


def test_train_data_export_over_its_prompts_is_refused(models, tmp_path, capsys):
    prompts = prompt_file(tmp_path / "p.jsonl")
    before = snapshot(prompts)
    code, _, err = cli(["train", "data", "--target", models["target"], "--prompts", str(prompts), "--export",
                        str(prompts), "--max-new-tokens", "4", "--dtype", "float32"], capsys)
    one_line(code, err, "--prompts", "destroy")
    assert snapshot(prompts) == before


def test_export_does_not_overwrite_answer_files_and_writes_atomically(models, finished, tmp_path, capsys):
    results = copy_of(finished, tmp_path)
    out = tmp_path / "sb"
    code, stdout, err = cli(["export", str(results), "--out", str(out)], capsys)
    assert code == 0, err
    answers = sorted(out.glob("*.jsonl"))
    assert len(answers) == 2
    answers[0].write_text("mine\n")
    before = snapshot(*answers)
    one_line(*cli(["export", str(results), "--out", str(out)], capsys)[::2], "already exists", "--overwrite")
    assert snapshot(*answers) == before
    assert cli(["export", str(results), "--out", str(out), "--overwrite"], capsys)[0] == 0
    assert answers[0].read_text() != "mine\n"
    no_strays(out)


# -------------------------------------------------------------------------------------- data lost silently

@pytest.mark.parametrize("ids,needle", [(["a", "a"], "lines 1 and 2"), ([1, "1"], "lines 1 and 2"),
                                        (["x", 7, "7"], "lines 2 and 3")])
def test_duplicate_prompt_ids_are_refused_naming_both_lines(models, tmp_path, capsys, ids, needle):
    bench = prompt_file(tmp_path / "p.jsonl", [{"id": i, "turns": [f"Say {n}."]} for n, i in enumerate(ids)])
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("humaneval")] = str(bench)
    one_line(*cli(args, capsys)[::2], needle, "own id")
    assert not out.exists()
    no_strays(tmp_path)


def test_a_second_run_on_the_same_file_is_refused_naming_the_first(models, finished, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    before = snapshot(out)
    held = WriterLock(out)  # another process' lock (flock conflicts across open files, in one process too)
    try:
        for extra in (["--resume"], ["--overwrite"]):
            one_line(*cli(base_args(models, out, *extra), capsys)[::2], f"pid {os.getpid()}")
    finally:
        held.release()
    assert snapshot(out) == before
    no_strays(tmp_path)


def test_two_runs_started_together_write_one_file_once(models, tmp_path):
    """Two real processes on one --out: one finishes, the other refuses; one header, no record twice."""
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "specbench.cli", *base_args(models, out)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes in ([0, 0], [0, 2]), results  # both finish only if one started after the other ended
    for code, err in results:
        if code == 2:
            assert "is being written by another specbench run (pid" in err and "Traceback" not in err, err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["type"] for x in lines].count("header") == 1
    keys = [(x["method"], x["prompt_id"], x["turn"]) for x in lines[1:]]
    assert len(keys) == len(set(keys)) == 4
    no_strays(tmp_path)


def _twice(path: Path, what: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines + (lines if what == "header" else lines[1:2])))


@pytest.mark.parametrize("what", ["header", "record"])
def test_resume_report_merge_refuse_two_headers_or_a_record_twice(models, finished, tmp_path, capsys, what):
    out = copy_of(finished, tmp_path)
    _twice(out, what)
    before = snapshot(out)
    needle = "two headers" if what == "header" else "twice"
    one_line(*cli(base_args(models, out, "--resume"), capsys)[::2], needle, str(out))
    one_line(*cli(["report", str(out), "--out-dir", str(tmp_path / "rep")], capsys)[::2], needle)
    one_line(*cli(["merge", str(out), "--out", str(tmp_path / "m.jsonl")], capsys)[::2], needle)
    one_line(*cli(["export", str(out), "--out", str(tmp_path / "sb")], capsys)[::2], needle)
    assert snapshot(out) == before
    assert not (tmp_path / "m.jsonl").exists()
    no_strays(tmp_path)


# ---------------------------------------------------------------------------------------------- tracebacks

DEEP = '{"id": "d", "turns": ["x"], "meta": ' + "[" * 5000 + "]" * 5000 + "}"
NEST = '{"id": "d", "turns": ["x"], "meta": {"k": ' + "[" * 60 + "]" * 60 + "}}"


@pytest.mark.parametrize("line,needles", [
    ('{"id": "a", "turns": ["x"], "reference": 5}', ["line 1", "reference"]),
    ('{"id": "a", "turns": ["x"], "meta": [1, 2]}', ["line 1", "meta"]),
    ('{"id": "a", "turns": ["x", 5]}', ["line 1", "turns.1"]),
    ('{"id": null, "turns": ["x"]}', ["line 1", "id"]),
    ('{"id": 1.5, "turns": ["x"]}', ["line 1", "id"]),
    ('{"id": {"a": 1}, "turns": ["x"]}', ["line 1", "id"]),
    ('{"id": "\\ud800", "turns": ["x"]}', ["line 1", "id", "lone surrogate"]),
    ('{"id": "a", "turns": ["hi \\udfff there"]}', ["line 1", "turns.0", "lone surrogate"]),
    (DEEP, ["line 1", "nests deeper"]),
    (NEST, ["line 1", "meta.k", "nests deeper"]),
    ('{"id": "a", "turns": "x"}', ["at least one turn"]),
    ("[1, 2]", ["line 1", "not a valid JSON object"]),
])
def test_malformed_prompt_file_is_one_line_naming_line_and_field(models, tmp_path, capsys, line, needles):
    bench = tmp_path / "p.jsonl"
    bench.write_text(line + "\n")
    before = snapshot(bench)
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("humaneval")] = str(bench)
    one_line(*cli(args, capsys)[::2], str(bench), *needles)
    assert snapshot(bench) == before and not out.exists()
    no_strays(tmp_path)


def test_prompt_file_in_another_encoding_is_one_line(models, tmp_path, capsys):
    bench = tmp_path / "p.jsonl"
    bench.write_bytes('{"id": "a", "turns": ["caf\u00e9"]}\n'.encode("utf-16"))
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("humaneval")] = str(bench)
    one_line(*cli(args, capsys)[::2], str(bench), "UTF-8")


@pytest.mark.parametrize("text,needles", [
    ('{"gamma": {"a": {"b": 1}}}', ["gamma"]),
    ('{"gamma": null, "x": [[1]]}', ["x"]),
    ("[" * 5000 + "]" * 5000, ["nests deeper"]),
    ('{"gamma": "\\ud800"}', ["gamma", "lone surrogate"]),
])
def test_malformed_config_is_one_line_naming_the_field(models, tmp_path, capsys, text, needles):
    config = tmp_path / "cfg.json"
    config.write_text(text)
    out = tmp_path / "r.jsonl"
    one_line(*cli(base_args(models, out, "--config", str(config)), capsys)[::2], str(config), *needles)
    assert not out.exists()


def test_truncated_gguf_is_one_line(models, tmp_path, capsys, monkeypatch):
    from specbench.engine.target import embedded_gguf

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    with open(embedded_gguf("smollm2-135m"), "rb") as fh:
        cut.write_bytes(fh.read(1 << 20))
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index(models["target"])] = str(cut)
    one_line(*cli(args, capsys)[::2], str(cut), "truncated")
    assert not out.exists()
    (tmp_path / "not.gguf").write_text("hello")
    args[args.index(str(cut))] = str(tmp_path / "not.gguf")
    one_line(*cli(args, capsys)[::2], "not a GGUF file")


def test_gguf_reader_missing_is_one_line_not_a_damaged_file(models, tmp_path, capsys, monkeypatch):
    """A GPU image without the gguf package (or with a copy lacking its metadata) must say what to install,
    not call a good model file damaged."""
    import importlib.metadata

    from specbench.engine.target import embedded_gguf

    real_version = importlib.metadata.version

    def version(name):
        if name == "gguf":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))  # nothing dequantised yet, so the reader is needed
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index(models["target"])] = str(embedded_gguf("smollm2-135m"))
    err = one_line(*cli(args, capsys)[::2], "gguf package", "pip install")
    assert "damaged" not in err
    assert not out.exists()


@pytest.mark.parametrize("kwarg", ["tokenize=false", "add_generation_prompt=false", "return_dict=true",
                                   "conversation=x", "bad-key=1"])
def test_chat_template_kwargs_that_break_rendering_are_one_line(models, tmp_path, capsys, kwarg):
    out = tmp_path / "r.jsonl"
    one_line(*cli(base_args(models, out, "--chat-template-kwargs", kwarg), capsys)[::2], "--chat-template-kwargs")
    assert not out.exists()


@pytest.mark.parametrize("field,value", [("new_tokens", None), ("times", [1, 2]), ("prompt_tokens", "many"),
                                         ("accept_lengths", None), ("turn", "first"), ("prompt_id", None),
                                         ("times", {"prefill": "slow"})])
def test_report_export_merge_resume_on_a_bad_field_are_one_line(models, finished, tmp_path, capsys, field, value):
    out = copy_of(finished, tmp_path)
    lines = out.read_text().splitlines(keepends=True)
    record = json.loads(lines[2])
    record[field] = value
    lines[2] = json.dumps(record) + "\n"
    out.write_text("".join(lines))
    before = snapshot(out)
    for argv in (["report", str(out), "--out-dir", str(tmp_path / "rep")],
                 ["export", str(out), "--out", str(tmp_path / "sb")],
                 ["merge", str(out), "--out", str(tmp_path / "m.jsonl")],
                 base_args(models, out, "--resume")):
        one_line(*cli(argv, capsys)[::2], "line 3", field)
    assert snapshot(out) == before
    assert not (tmp_path / "m.jsonl").exists() and not list((tmp_path / "sb").glob("*.jsonl")) \
        if (tmp_path / "sb").exists() else True
    no_strays(tmp_path)


# ---------------------------------------------------------------------------------------------- stray files

def test_no_header_only_file_after_a_failure_before_the_first_turn(models, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    args = base_args(models, out, "--on-long-prompt", "fail")
    args[args.index(models["target"])] = models["short"]
    args[args.index(f"draft={models['draft']}")] = "draft=truncated:1"
    one_line(*cli(args, capsys)[::2], "context")
    assert not out.exists()
    no_strays(tmp_path)


def test_a_failed_merge_leaves_nothing(models, finished, tmp_path, capsys):
    part = copy_of(finished, tmp_path)
    empty = tmp_path / "emptydir"
    empty.mkdir()
    one_line(*cli(["merge", str(part), "--out", str(empty)], capsys)[::2], "is a folder")
    assert not list(empty.iterdir())
    no_strays(tmp_path)
    target = tmp_path / "merged.jsonl"
    assert cli(["merge", str(part), "--out", str(target)], capsys)[0] == 0
    assert target.read_text().splitlines()[1:] == part.read_text().splitlines()[1:]  # one file merged is itself
    no_strays(tmp_path)


@pytest.mark.parametrize("label", ["../../x", "../x", "/tmp/x", "a/../../x"])
def test_a_label_cannot_put_results_outside_results(models, tmp_path, capsys, monkeypatch, label):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = base_args(models, Path("unused"), "--label", label)
    i = args.index("--out")
    del args[i:i + 2]
    one_line(*cli(args, capsys)[::2], "outside results/")
    assert not any(p for p in tmp_path.rglob("*") if p.is_file())


def test_max_new_tokens_past_the_context_is_one_line(models, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("--max-new-tokens") + 1] = str(2**31)
    one_line(*cli(args, capsys)[::2], "--max-new-tokens", "context")
    assert not out.exists()
    no_strays(tmp_path)


# --------------------------------------------------------------------------------------------------- signals

def _signal_when(condition, signum: int, times: int = 1, gap: float = 0.0) -> threading.Thread:
    def send():
        deadline = time.time() + 120
        while not condition() and time.time() < deadline:
            time.sleep(0.02)
        for _ in range(times):
            os.kill(os.getpid(), signum)
            time.sleep(gap)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _slow_verify(monkeypatch, after_records: int, out: Path, seconds: float = 60.0) -> None:
    """Once ``out`` holds ``after_records`` records, every verify takes ``seconds`` (a Python loop that
    never reaches a step boundary, as a forward of minutes would)."""
    real = Target.verify

    def verify(self, *args, **kwargs):
        if out.exists() and len(out.read_text().splitlines()) > after_records:
            end = time.time() + seconds
            while time.time() < end:
                time.sleep(0.01)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Target, "verify", verify)


def _resume_line(err: str, out: Path) -> str:
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted (") and "resume with: specbench run" in last and "--resume" in last, err
    assert str(out) in last, err
    return last


def test_sigterm_during_a_long_forward_stops_within_seconds(models, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.jsonl"
    _slow_verify(monkeypatch, 1, out)
    _signal_when(lambda: out.exists() and len(out.read_text().splitlines()) > 1, signal.SIGTERM)
    start = time.time()
    code, _, err = cli(base_args(models, out), capsys)
    assert code == 143 and time.time() - start < 30, err
    kept = len(out.read_text().splitlines()) - 1  # every line whole: the header, then the finished records
    assert 1 <= kept < 4 and f"({kept} records)" in _resume_line(err, out)
    no_strays(tmp_path)


def test_sigterm_during_the_model_load_stops_the_load(models, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.jsonl"
    loading = threading.Event()
    real = Target.load.__func__

    def slow_load(cls, *args, **kwargs):
        loading.set()
        end = time.time() + 60
        while time.time() < end:
            time.sleep(0.01)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(Target, "load", classmethod(slow_load))
    _signal_when(loading.is_set, signal.SIGTERM)
    start = time.time()
    code, _, err = cli(base_args(models, out), capsys)
    assert code == 143 and time.time() - start < 10, err
    assert "no records yet" in _resume_line(err, out)
    assert not out.exists()
    no_strays(tmp_path)


@pytest.mark.parametrize("when", ["during the load", "after the first record"])
def test_ctrl_c_twice_quickly_still_prints_what_was_kept(models, tmp_path, when):
    """A real process and real key presses: two SIGINTs 10 ms apart, as fast as a hand can."""
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("--limit") + 1] = "20"
    args[args.index("--max-new-tokens") + 1] = "64"
    args[args.index("humaneval")] = str(prompt_file(tmp_path / "p.jsonl", [
        {"id": f"q{i}", "turns": [f"Tell me a long story about the number {i}."]} for i in range(20)]))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "specbench.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".r.jsonl.lock"  # the store is open: the model load is next
    ready = (lambda: lock.exists()) if when == "during the load" else \
        (lambda: out.exists() and len(out.read_text().splitlines()) > 1)
    deadline = time.time() + 120
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = _resume_line(err, out)
    kept = f"({len(out.read_text().splitlines()) - 1} records)" if out.exists() else "no records yet"
    assert kept in last and "Traceback" not in err, err
    if out.exists():
        lines = out.read_text().splitlines()
        assert all(json.loads(x) for x in lines)  # every line whole
    no_strays(tmp_path)
