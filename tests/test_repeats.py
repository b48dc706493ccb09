"""--repeats: R generations per prompt turn and side, identical tokens, every timing kept, the median used;
and the load average a run records (header and every record)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specbench import metrics
from specbench.errors import SpecbenchError
from specbench.records import GenerationRecord
from specbench.engine.repeats import median_index, merge_repeats, repeat_times
from specbench.analysis.report import write_report
from test_cli import base_args, cli, read


def rec(total: float, tokens=(1, 2, 3)) -> GenerationRecord:
    return GenerationRecord(method="sps", new_tokens=list(tokens), prompt_tokens=5, stop_reason="length",
                            times={"prefill": 0.0, "draft": total / 2, "verify": total / 2}, n_verify=2,
                            accept_lengths=[0, 1], tree_sizes=[1, 1], depth_attempts=[2], depth_accepts=[1],
                            prompt_id="p0")


def test_median_over_repeats_is_a_real_repeat():
    assert median_index([3.0, 1.0, 2.0]) == 2
    assert median_index([4.0, 1.0, 3.0, 2.0]) == 3  # lower middle of an even count
    merged = merge_repeats([rec(3.0), rec(1.0), rec(9.0)])
    assert merged.total_time == pytest.approx(3.0)
    assert repeat_times(merged) == pytest.approx([3.0, 1.0, 9.0])
    # Metrics read `times`, i.e. the median repeat: an outlier repeat (9 s) does not move them.
    assert metrics.tokens_per_second([merged]) == pytest.approx(3 / 3.0)


def test_different_tokens_across_repeats_is_a_user_error():
    with pytest.raises(SpecbenchError, match="sps on p0"):
        merge_repeats([rec(1.0), rec(1.0, tokens=(1, 2, 4))], where="sps on p0")


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_cli_repeats_keep_every_timing_with_identical_tokens(models, tmp_path, capsys, temperature):
    # At T > 0 the per-turn seed makes every repeat draw the same samples, so tokens still agree.
    out = tmp_path / "r.jsonl"
    code, _, err = cli(base_args(models, out, "--repeats", "3", "--temperature", temperature, "--limit", "1"), capsys)
    assert code == 0, err
    lines = read(out)
    header, records = lines[0], lines[1:]
    assert header["meta"]["repeats"] == 3 and header["meta"]["cpus"] >= 1
    assert len(header["meta"]["load_start"]) == 3 and all(len(r["load_avg"]) == 3 for r in records)
    assert sorted(r["method"] for r in records) == ["sps", "vanilla"]
    for r in records:
        assert len(r["times_repeats"]) == 3
        record = GenerationRecord.from_dict(r)
        totals = sorted(repeat_times(record))
        assert record.total_time == pytest.approx(totals[1])  # the median repeat's times are the record's
    if temperature == "0":  # fp32 greedy: the report's greedy-match column reads 100% of the one turn
        write_report(out, tmp_path / "rep", figures=False)
        assert "| 100% (1) |" in (tmp_path / "rep" / "main_table.md").read_text()


def test_cli_repeats_refused_for_learning_drafters(models, tmp_path, capsys):
    args = ["run", "--method", "dvi", "--bench", "humaneval", "--target", models["target"], "--dtype", "float32",
            "--limit", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "d.jsonl"), "--repeats", "2"]
    code, _, err = cli(args, capsys)
    assert code == 2 and "learn while serving" in err and len(err.strip().splitlines()) == 1
