"""Interruptions end cleanly: SIGTERM / Ctrl-C stop a run after the token step in flight, keep every
finished record, print the command that resumes it and exit 143 / 130; the resumed run finishes
every prompt exactly once. A full disk while appending leaves the file whole up to the last record;
a read-only results folder is refused before any model loads. `specbench train` interrupted and
rerun continues from its checkpoint with the same losses as an uninterrupted run."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specbench.run.store import RunStore
from specbench.engine.target import Target
from test_cli import REPO, base_args, cli, read
from test_train_cli import prompt_file


def _keys(path: Path) -> list[tuple]:
    return [(r["method"], r["prompt_id"], r["turn"]) for r in read(path)[1:]]


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_after_the_step_and_resume_finishes(models, tmp_path, signum, code):
    out = tmp_path / "r.jsonl"
    args = base_args(models, out)
    args[args.index("--limit") + 1] = "6"
    args[args.index("--max-new-tokens") + 1] = "32"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "specbench.cli", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 2):
        time.sleep(0.05)
    proc.send_signal(signum)  # after the first record
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("interrupted") and str(out) in last, err
    kept = _keys(out)
    assert 1 <= len(kept) < 12 and len(kept) == len(set(kept)), "stopped mid-way, every line a whole record"
    resume = shlex.split(last.split("resume with: ", 1)[1])
    assert resume[0] == "specbench" and resume[-1] == "--resume" and resume[1:-1] == args
    done = subprocess.run([sys.executable, "-m", "specbench.cli", *resume[1:]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    keys = _keys(out)
    assert keys[: len(kept)] == kept
    assert len(keys) == len(set(keys)) == 12  # 6 prompts x (sps, vanilla), each exactly once


def test_full_disk_keeps_the_file_whole_and_says_so(models, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.jsonl"
    real_write = RunStore._write
    calls = {"n": 0}

    def write(self, obj):
        calls["n"] += 1
        if calls["n"] == 3:  # header, record 1, then the disk fills up halfway through record 2
            class HalfFull:
                def __init__(self, fh):
                    self.fh = fh

                def write(self, text):
                    self.fh.write(text[: len(text) // 2])
                    self.fh.flush()
                    raise OSError(errno.ENOSPC, "No space left on device")

                def __getattr__(self, name):
                    return getattr(self.fh, name)

            self.fh = HalfFull(self.fh)
        return real_write(self, obj)

    monkeypatch.setattr(RunStore, "_write", write)
    code, _, err = cli(base_args(models, out), capsys)
    lines = err.strip().splitlines()  # progress bars above it, then the one error line
    assert code == 2 and "Traceback" not in err and [x for x in lines if "error" in x] == lines[-1:], err
    assert "disk full" in err and "valid up to its last whole record (1 records)" in err and "--resume" in err
    lines = out.read_text().splitlines(keepends=True)
    assert len(lines) == 2 and all(line.endswith("\n") for line in lines)
    assert [json.loads(line)["type"] for line in lines] == ["header", "record"]
    monkeypatch.setattr(RunStore, "_write", real_write)
    assert cli(base_args(models, out, "--resume"), capsys)[0] == 0
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == 4


def test_read_only_results_folder_is_refused_before_loading(models, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    loads = []
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: loads.append(a)))
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: not (Path(path) == folder and mode & os.W_OK))
    code, _, err = cli(base_args(models, folder / "r.jsonl"), capsys)
    assert code == 2 and "pass a writable --out" in err and str(folder) in err and len(err.strip().splitlines()) == 1
    assert not loads


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to drop to another user")
def test_read_only_results_folder_for_a_real_user(models, tmp_path):
    """The same refusal with real permissions: as an unprivileged user (root may write anywhere)."""
    import tempfile

    root = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own tmp is closed to other users
    root.chmod(0o755)
    folder = root / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    args = base_args(models, folder / "r.jsonl")
    args[args.index(models["target"])] = "smollm2-135m"  # exists for every user; refused before it loads
    args[args.index(f"draft={models['draft']}")] = "draft=truncated:1"  # nothing this user cannot read
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "specbench.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    shutil.rmtree(root)
    if done.returncode != 2 and "Permission denied" in done.stderr and "cli.py" not in done.stderr:
        pytest.skip("the unprivileged user cannot read the checkout or the venv")
    assert done.returncode == 2, done.stderr
    assert "pass a writable --out" in done.stderr and "does not exist" not in done.stderr


def _train_args(models, tmp_path, out: Path) -> list[str]:
    # SpecBlock draws its cross-block cuts from torch's RNG: resuming must restore it
    return ["train", "specblock", "--target", models["deep"], "--prompts", prompt_file(tmp_path), "--limit", "6",
            "--max-new-tokens", "12", "--epochs", "2", "--batch-size", "2", "--max-length", "64", "--layers", "1",
            "--draft-vocab", "64", "--rank-hidden", "8", "--rank-start", "0", "--cross-fraction", "0.5",
            "--dtype", "float32", "--no-cache-features", "--out", str(out)]


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_train_interrupted_then_rerun_continues_with_the_same_losses(models, tmp_path, capsys, monkeypatch):
    from specbench.training.trainer import Trainer

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    whole = tmp_path / "whole"
    code, _, err = cli(_train_args(models, tmp_path, whole), capsys)
    assert code == 0, err

    cut = tmp_path / "cut"
    real_log = Trainer._log

    def log_then_signal(self, entry):
        real_log(self, entry)
        if entry.get("step") == 2 and "loss" in entry:
            os.kill(os.getpid(), signal.SIGTERM)  # the real handler: stop at this step boundary

    monkeypatch.setattr(Trainer, "_log", log_then_signal)
    code, _, err = cli(_train_args(models, tmp_path, cut), capsys)
    assert code == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted (SIGTERM); checkpoint saved; resume with: specbench train specblock"), err
    assert (cut / "trainer_state.pt").is_file() and not (cut / "drafter").exists()
    assert [s for s, _ in _losses(cut)] == [1, 2]

    monkeypatch.setattr(Trainer, "_log", real_log)
    code, _, err = cli(_train_args(models, tmp_path, cut), capsys)  # the same command again
    assert code == 0, err
    assert [s for s, _ in _losses(cut)] == list(range(1, 7))
    assert _losses(cut) == _losses(whole)  # identical losses after the resume (seeded, RNG restored)


def test_engine_finishes_the_token_step_in_flight_then_stops():
    from specbench.engine.vanilla import VanillaDrafter
    from specbench.engine import interrupt
    from specbench.engine.loop import GenerationConfig, generate
    from tiny import tiny_target

    target = tiny_target(0)
    steps = []

    class SignalledMidStep(VanillaDrafter):
        def observe(self, state, result):
            steps.append(len(state.tokens))
            if len(steps) == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives during step 3; the step still commits

    drafter = SignalledMidStep()
    drafter.setup(target)
    with interrupt.graceful():
        with pytest.raises(interrupt.Interrupted) as stopped:
            generate(target, drafter, [1, 2, 3], GenerationConfig(max_new_tokens=20))
    assert stopped.value.exit_code == 143 and len(steps) == 3
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored afterwards
