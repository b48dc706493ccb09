"""The report's drafters table: the held-out figures of every drafter folder the records name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specbench.analysis.report import build_report, write_report
from specbench.analysis.report.drafters import drafter_folders, drafter_row, drafters_table
from specbench.analysis.report.records import load_result_files
from specbench.analysis.report.render import render_markdown
from tests.test_report import drafted, vanilla, write_jsonl


def make_drafter(folder: Path, method: str, evaluation: dict, curve: list[float] | None = None, **extra) -> Path:
    folder.mkdir(parents=True)
    recipe = {"epochs": 1, "extra": {"train_examples": 7308, "eval_examples": 225, "train_response_tokens": 1_390_000,
                                     "hardware": "Intel Xeon (2 threads)", **extra}}
    (folder / "config.json").write_text(json.dumps({"method": method, "recipe": recipe}))
    (folder / "eval.json").write_text(json.dumps(evaluation))
    (folder / "model.safetensors").write_bytes(b"\0" * 2**20 * 3)
    if curve:
        lines = ["step,tokens,tokens_estimated,tau_proxy"]
        lines += [f"{100 * (i + 1)},{1000 * (i + 1)},False,{v}" for i, v in enumerate(curve)]
        (folder / "learning_curve.csv").write_text("\n".join(lines) + "\n")
    return folder


def weights(**drafters: dict[str, Path]) -> dict:
    return {"target": {"spec": "smollm2-135m"},
            "drafters": {label: {opt: {"spec": str(p), "path": str(p)} for opt, p in opts.items()}
                         for label, opts in drafters.items()}}


def records(method: str) -> list:
    return [vanilla("humaneval", "p0", 9, 0.8), drafted(method, "humaneval", "p0", [2, 2, 1], 0.1, 0.4)]


@pytest.fixture
def results(tmp_path: Path) -> Path:
    root = tmp_path / "drafters" / "smollm2-135m"
    eagle = make_drafter(root / "eagle3", "eagle3", {"acc_1": 0.43, "acc_2": 0.39, "acc_3": 0.38, "acc_4": 0.37,
                                                     "acc_5": 0.36, "tau_proxy": 1.69, "steps": 914},
                         curve=[1.29, 1.46, 1.55, 1.60, 1.67, 1.70])
    sps = make_drafter(root / "sps", "sps-student", {"acc_1": 0.30, "tau_proxy": 1.30, "steps": 900},
                       curve=[1.20, 1.28, 1.30, 1.30, 1.30, 1.30])
    pacer = make_drafter(root / "pacer", "pacer", {"auc": 0.81, "steps": 300})
    out = tmp_path / "results"
    out.mkdir()
    write_jsonl(out / "a.jsonl", records("eagle3"), method="eagle3",
                weights=weights(eagle3={"path": eagle}, vanilla={}))
    write_jsonl(out / "b.jsonl", records("pacer"), method="pacer",
                weights=weights(pacer={"draft": sps, "pacer": pacer}, sps={"draft": sps}))
    return out


def test_every_named_folder_once_with_the_sides_that_used_it(results: Path, tmp_path: Path):
    found = drafter_folders(load_result_files(str(results / "*.jsonl")))
    root = (tmp_path / "drafters" / "smollm2-135m").resolve()
    assert found == {"smollm2-135m": {root / "eagle3": ["eagle3"], root / "sps": ["pacer", "sps"],
                                      root / "pacer": ["pacer"]}}


def test_row_reads_eval_config_and_the_curve(results: Path, tmp_path: Path):
    root = tmp_path / "drafters" / "smollm2-135m"
    eagle = drafter_row(root / "eagle3")
    assert (eagle["method"], eagle["train_examples"], eagle["steps"]) == ("eagle3", 7308, 914)
    assert eagle["size_mib"] == pytest.approx(3.0)
    assert [eagle[f"acc_{k}"] for k in range(1, 5)] == [0.43, 0.39, 0.38, 0.37]
    assert eagle["tau_proxy"] == 1.69
    assert eagle["curve"].startswith("still improving")  # 1.67 -> 1.70 over the last third: 1.8%
    assert drafter_row(root / "sps")["curve"].startswith("plateaued")
    pacer = drafter_row(root / "pacer")
    assert pacer["auc"] == 0.81 and pacer["curve"] == "no learning curve"


def test_table_rendered_with_dashes_where_a_drafter_has_no_figure(results: Path):
    table = drafters_table(load_result_files(str(results / "*.jsonl")))
    text = render_markdown(table)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 1.69 | 0.43 | 0.39 | 0.38 | 0.37 | — |" in rows["eagle3"]
    assert "| 0.81 |" in rows["pacer"] and "pacer, sps" in rows["sps"]
    assert len(table.data) == 3


def test_records_from_another_checkout_find_the_folder_under_this_one(tmp_path: Path, monkeypatch):
    here = tmp_path / "checkout"
    make_drafter(here / "drafters" / "smollm2-135m" / "eagle3", "eagle3", {"acc_1": 0.4, "tau_proxy": 1.4})
    write_jsonl(tmp_path / "r.jsonl", records("eagle3"), method="eagle3",
                weights=weights(eagle3={"path": Path("/elsewhere/drafters/smollm2-135m/eagle3")}))
    monkeypatch.chdir(here)
    found = drafter_folders(load_result_files(str(tmp_path / "r.jsonl")))
    assert list(found["smollm2-135m"]) == [(here / "drafters" / "smollm2-135m" / "eagle3").resolve()]


def test_no_table_without_drafter_folders(tmp_path: Path):
    write_jsonl(tmp_path / "r.jsonl", records("eagle3"), method="eagle3")
    assert drafters_table(load_result_files(str(tmp_path / "r.jsonl"))) is None


def test_written_with_the_report(results: Path, tmp_path: Path):
    assert build_report(str(results / "*.jsonl"), reps=0).table("drafters_table") is not None
    written = write_report(str(results / "*.jsonl"), tmp_path / "reports", figures=False)
    assert tmp_path / "reports" / "drafters_table.md" in written
