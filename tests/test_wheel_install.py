"""A built wheel (not the checkout) runs from an unrelated folder: everything the core reads ships in
the package or comes through entry points. The wheel goes into a fresh venv that reuses this
environment's libraries through a .pth file (installing torch again would take minutes)."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(args, cwd, env, timeout=600):
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args}\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv holding only the wheel, an unrelated working folder, its environment)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy, so the build writes nothing into the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                                 "results", "reports", "tests", "drafters", "bench"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp / "dist"), str(source)], tmp, os.environ, timeout=300)
    wheel, = (tmp / "dist").glob("specbench-*.whl")
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, os.environ)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp,
                    os.environ).strip())
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        tmp, os.environ)
    # The venv's own site-packages comes first, so its specbench (and entry points) win over this one's.
    (site / "reuse_libraries.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("SPECBENCH_DATA", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return python, work, env


def test_the_wheel_is_the_specbench_imported_and_lists_its_benches(installed):
    python, work, env = installed
    where = run([str(python), "-c", "import specbench, methods; print(specbench.__file__, methods.__file__)"], work, env)
    assert str(ROOT) not in where and "site-packages" in where
    out = run([str(python), "-m", "specbench", "list", "benches"], work, env)
    for bench in ("humaneval", "mt_bench", "math500", "natural_questions", "wmt23", "alpaca"):
        assert bench in out
    listed = run([str(python), "-m", "specbench", "list", "methods"], work, env)  # imports every method's class
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["specbench.methods"]
    assert all(name in listed for name in declared), "a method (or a module of its package) is missing from the wheel"


@pytest.mark.slow
def test_the_wheel_runs_the_embedded_default_and_reports(installed):
    python, work, env = installed
    run([str(python), "-m", "specbench", "run", "--method", "vanilla", "--baseline", "none", "--bench", "humaneval",
         "--limit", "1", "--max-new-tokens", "4", "--no-warmup", "--out", "runs/one.jsonl"], work, env)
    out = run([str(python), "-m", "specbench", "report", "runs/one.jsonl", "--out-dir", "tables"], work, env)
    assert "report:" in out and (work / "tables" / "main_table.md").is_file()
