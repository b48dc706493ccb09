"""A record made from a dirty working tree says which uncommitted code made it: the diff's hash and files."""

import hashlib
import subprocess

from specbench.run.results import git_dirty


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def test_a_dirty_tree_records_the_diff_hash_and_its_files(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    assert git_dirty(tmp_path) is None  # clean: nothing beside the sha

    (tmp_path / "a.py").write_text("x = 2\n")
    first = git_dirty(tmp_path)
    assert first["files"] == ["a.py"]
    assert first["diff_sha256"] == hashlib.sha256(_git(tmp_path, "diff", "HEAD", "--binary")).hexdigest()

    (tmp_path / "a.py").write_text("x = 3\n")  # another uncommitted change: another hash
    assert git_dirty(tmp_path)["diff_sha256"] != first["diff_sha256"]


def test_changed_results_and_reports_are_outputs_not_code(tmp_path):
    _git(tmp_path, "init", "-q")
    for name in ("a.py", "results/r.jsonl", "reports/t.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    (tmp_path / "results" / "r.jsonl").write_text("2\n")  # a run rewrote its records and the table
    (tmp_path / "reports" / "t.md").write_text("2\n")
    assert git_dirty(tmp_path) is None and git_dirty(tmp_path / "results") is None
    (tmp_path / "a.py").write_text("2\n")
    assert git_dirty(tmp_path / "results")["files"] == ["a.py"]
