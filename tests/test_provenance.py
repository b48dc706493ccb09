"""A record made from a dirty working tree says which uncommitted code made it: the diff's hash and files."""

import hashlib
import subprocess

from specbench.data.results import git_dirty


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


def test_report_marks_every_cell_made_by_a_dirty_tree(tmp_path):
    import pandas as pd

    from specbench.analysis.report import write_report
    from tests.test_report import method_records, vanilla_records, write_jsonl

    results = tmp_path / "results"
    results.mkdir()
    write_jsonl(results / "clean.jsonl", vanilla_records() + method_records("sps"))
    write_jsonl(results / "dirty.jsonl", vanilla_records() + method_records("eagle3", quality=3),
                git_sha="abc1234-dirty", git_dirty={"diff_sha256": "0" * 64, "files": ["methods/eagle3/drafter.py"]})
    write_report(results / "*.jsonl", tmp_path / "out", figures=False)
    md = (tmp_path / "out" / "main_table.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert "†" not in rows["sps"]  # the clean file's cells carry no mark
    assert rows["eagle3"].count("†") == 4  # three benches and the Mean
    assert "† = made by a working tree with uncommitted code changes" in md and "(eagle3)" in md
    csv = pd.read_csv(tmp_path / "out" / "main_table.csv", comment="#").set_index("method")
    assert bool(csv.at["eagle3", "dirty_tree"]) and not bool(csv.at["sps", "dirty_tree"])
    prov = md.split("dirty.jsonl (diff sha256 ")[1]
    assert prov.startswith("000000000000: methods/eagle3/drafter.py)")  # the provenance names the uncommitted diff
