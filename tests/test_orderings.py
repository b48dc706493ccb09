"""Orderings verdicts, the cost model's ideal speedup and the under-load flag, on hand-made records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from specbench.analysis.cost_model import cost_model, ideal_and_efficiency
from specbench.data.machine_load import MARK, under_load
from specbench.analysis.orderings import Claim, Sides, load_claims, ordering_frame, read_claims
from specbench.analysis.paired import verdict
from specbench.records import GenerationRecord
from specbench.analysis.report import ResultFile, write_report

META = {"target": "t", "temperature": 0.0, "dtype": "float32", "threads": 1}


def rec(method: str, pid: str, seconds: float, tokens: int = 20, calls: int = 10, committed: int | None = None,
        bench: str = "humaneval", query_index: int = 0, draft: float = 0.0, turn: int = 0) -> GenerationRecord:
    committed = tokens if committed is None else committed
    accept = [committed // calls - 1] * calls
    accept[0] += committed - sum(a + 1 for a in accept)
    return GenerationRecord(method=method, new_tokens=list(range(tokens)), prompt_tokens=5, stop_reason="length",
                            times={"prefill": 0.0, "draft": draft, "verify": seconds - draft}, n_verify=calls,
                            accept_lengths=accept, tree_sizes=[2] * calls, depth_attempts=[], depth_accepts=[],
                            bench=bench, prompt_id=pid, query_index=query_index, turn=turn)


def result_file(records, name: str = "f.jsonl", **meta) -> ResultFile:
    return ResultFile(Path(name), {**META, **meta}, tuple(records))


def header(sides: dict[str, tuple[str, dict]], budget_option: str | None = None, ran: dict | None = None) -> dict:
    """Header fields of the sides {label: (method, options as given)}: what the runner writes of each."""
    return {"side_specs": [{"label": label, "method": method, "options": options, "name": label, "shown": []}
                           for label, (method, options) in sides.items()],
            "methods": {label: {"method": method, "label": method, "family": method, "ablation_of": None,
                                "budget_option": budget_option} for label, (method, _) in sides.items()},
            "method_options": ran or {}}


def sweep_header(method: str, key: str, values) -> dict:
    return header({f"{method}@{key}={v}": (method, {key: v}) for v in values}, budget_option=key)


def side(method: str, factor: float, noise: float, n: int = 12):
    """n prompts whose vanilla takes 1 + i/10 s; this side takes factor × that, times a ±noise wobble."""
    return [rec(method, f"p{i}", (1 + i / 10) * factor * (1 + noise * (-1) ** i)) for i in range(n)]


CLAIM = Claim("a faster than b", "test", Sides(method=("a",)), Sides(method=("b",)))


def verdict_of(a_factor: float, b_factor: float, noise: float = 0.02) -> str:
    base = [rec("vanilla", f"p{i}", 1 + i / 10) for i in range(12)]
    files = [result_file(base + side("a", a_factor, noise) + side("b", b_factor, -noise))]
    frame = ordering_frame(files, [CLAIM])
    assert len(frame) == 1 and frame.n.iloc[0] == 12  # one bench, every prompt paired
    return frame.verdict.iloc[0]


def test_clear_win_holds_clear_loss_reversed_noise_inconclusive():
    assert verdict_of(0.5, 0.8) == "holds"  # a takes 0.5x vanilla's time, b 0.8x
    assert verdict_of(0.8, 0.5) == "reversed"
    assert verdict_of(0.6, 0.6, noise=0.3) == "inconclusive"


def test_n_counts_conversations_not_turns():
    """MT-Bench's two turns of a conversation are one resampled unit: 8 conversations of 2 turns give n = 8,
    and the table says so (its n column and notes count conversations)."""
    from specbench.analysis.orderings import orderings_table

    recs = [rec(m, f"p{i}", (1 + i / 10) * f, bench="mt_bench", turn=t)
            for i in range(8) for t in (0, 1) for m, f in (("vanilla", 1.0), ("a", 0.5), ("b", 0.8))]
    frame = ordering_frame([result_file(recs)], [CLAIM])
    assert len(frame) == 1 and frame.n.iloc[0] == 8 and frame.verdict.iloc[0] == "holds"
    table = orderings_table(frame, claims=[CLAIM])
    assert "n (conv.)" in table.columns and table.sections[0][1][0][5].text == "8"
    assert any("n = paired conversations" in note for note in table.notes)
    assert not any("turns pair" in note or "n = paired turns" in note for note in table.notes)


def test_verdict_rules_and_missing_data():
    assert verdict(1.01, 1.2, ">") == "no data"  # n = 0
    assert verdict(1.01, 1.2, ">", n=3) == "inconclusive"  # too few conversations to judge
    assert verdict(1.0, 1.0, ">=", n=8) == "holds" and verdict(1.0, 1.0, ">", n=8) == "inconclusive"
    assert verdict(0.4, 0.6, "<", 0.75, n=8) == "holds" and verdict(0.8, 0.9, "<", 0.75, n=8) == "reversed"
    frame = ordering_frame([result_file([rec("vanilla", "p0", 1.0), rec("x", "p0", 1.0)])])
    assert set(frame.verdict) == {"no data"} and len(frame) == len(load_claims()) and set(frame.n) == {0}


def test_pairs_across_files_of_one_bench_and_monotone_and_stream_claims():
    # a and b in two files of the same block: paired by prompt id, each against its own file's vanilla.
    base = [rec("vanilla", f"p{i}", 1 + i / 10) for i in range(12)]
    files = [result_file(base + side("a", 0.5, 0.02), "one.jsonl"), result_file(base + side("b", 0.8, 0.02), "two.jsonl")]
    assert ordering_frame(files, [CLAIM]).verdict.tolist() == ["holds"]
    # τ rising with the budget: 1.5, 2, 2.5 committed tokens per call.
    budgets = ((8, 1.5), (16, 2.0), (32, 2.5))
    sweep = [rec(f"d@budget={b}", f"p{i}", 1.0, committed=int(10 * t) + (i % 2)) for b, t in budgets for i in range(8)]
    mono = Claim("τ monotone", "test", Sides(method=("d",), given=("budget",)), metric="tau", direction=">=",
                 compare="next")
    frame = ordering_frame([result_file(sweep, **sweep_header("d", "budget", [b for b, _ in budgets]))], [mono])
    assert frame[["a", "b", "verdict"]].values.tolist() == [["d@budget=16", "d@budget=8", "holds"],
                                                            ["d@budget=32", "d@budget=16", "holds"]]
    # A stream whose acceptance grows with the query index.
    stream = [rec("s", f"q{i}", 1.0, committed=10 + i + (i % 3), query_index=i) for i in range(24)]
    rise = Claim("rises", "test", Sides(method=("s",)), metric="tau", compare="quarters")
    row = ordering_frame([result_file(stream)], [rise]).iloc[0]
    assert row.verdict == "holds" and row.n == 6 and row.ratio > 1


def pairs(files, claim: Claim) -> list[tuple[str, str]]:
    return sorted(ordering_frame(files, [claim])[["a", "b"]].itertuples(index=False, name=None))


def test_claims_pick_sides_by_what_the_header_says_never_by_label():
    """A claim names sides by method and options as the results header records them: a label that reads like
    another method's side is not parsed, option values compare as numbers, defaults are the registry's."""
    from specbench.analysis.report.names import option_defaults

    default = option_defaults("sps")["gamma"]
    labels = {"tuned": ("a", {"gamma": "4"}), "a@gamma=9": ("b", {}), "plain": ("a", {}),
              "sps": ("sps", {}), "sps-short": ("sps", {"gamma": "3"})}
    ran = {"tuned": {"gamma": 4}, "plain": {"gamma": 2}, "sps": {"gamma": int(default)}, "sps-short": {"gamma": 3}}
    base = [rec("vanilla", f"p{i}", 1 + i / 10) for i in range(12)]
    files = [result_file(base + [r for label in labels for r in side(label, 0.5, 0.02)], **header(labels, ran=ran))]
    b = Sides(method=("b",))
    assert pairs(files, Claim("set γ", "test", Sides(method=("a",), given=("gamma",)), b)) == [("tuned", "a@gamma=9")]
    assert pairs(files, Claim("γ 2", "test", Sides(method=("a",), options=(("gamma", 2.0),)), b)) == \
        [("plain", "a@gamma=9")]
    assert pairs(files, Claim("default γ", "test", Sides(method=("sps",), defaults=("gamma",)), b)) == \
        [("sps", "a@gamma=9")]


def test_same_run_and_same_budget_restrict_the_pairs():
    base = [rec("vanilla", f"p{i}", 1 + i / 10) for i in range(12)]
    one = {"a@budget=8": ("a", {"budget": 8}), "a@budget=16": ("a", {"budget": 16}), "b@budget=8": ("b", {"budget": 8}),
           "b": ("b", {})}
    two = {"a": ("a", {})}
    files = [result_file(base + [r for label in one for r in side(label, 0.5, 0.02)], "one.jsonl",
                         **header(one, budget_option="budget")),
             result_file(base + side("a", 0.6, 0.02), "two.jsonl", **header(two, budget_option="budget"))]
    a, b = Sides(method=("a",)), Sides(method=("b",))
    every = pairs(files, Claim("any", "test", a, b))
    assert len(every) == 6 and ("a", "b") in every  # across files by prompt id
    assert ("a", "b") not in pairs(files, Claim("run", "test", a, b, same_run=True))
    assert len(pairs(files, Claim("run", "test", a, b, same_run=True))) == 4
    assert pairs(files, Claim("budget", "test", a, b, same_budget=True)) == [("a", "b"), ("a@budget=8", "b@budget=8")]


def test_a_claim_file_names_sides_as_data(tmp_path: Path):
    path = tmp_path / "claims.yaml"
    path.write_text("- text: t\n  source: s\n  a: {method: sps, given: [gamma], options: {schedule: fixed}}\n"
                    "  b: {family: dvi}\n  same_run: true\n")
    [claim] = read_claims(path)
    assert claim.a == Sides(method=("sps",), options=(("schedule", "fixed"),), given=("gamma",))
    assert claim.b == Sides(family="dvi") and claim.same_run and not claim.same_budget


def test_ideal_speedup_arithmetic():
    # vanilla: 10 target forwards of 0.1 s -> t_step 0.1. method: 4 calls, τ = 2.5, drafter 0.02 s and a
    # 0.13 s target verify per call -> ideal = 2.5 * 0.1 / 0.15 = 1.667; per drafted row (3 rows) 0.01 s.
    v = rec("vanilla", "p0", 1.0, tokens=11, calls=10)
    v.forwards, v.forward_times = {"target": 10}, {"target": 1.0}
    m = rec("m", "p0", 0.8, tokens=11, calls=4, committed=10, draft=0.1)
    m.tree_sizes = [3] * 4
    m.forwards, m.forward_times = {"target": 4, "drafter": 8}, {"target": 0.52, "drafter": 0.08}
    model = cost_model([m], [v])
    assert model.step == pytest.approx(0.1) and model.draft == pytest.approx(0.02)
    assert model.verify == pytest.approx(0.13) and model.per_row == pytest.approx(0.01)
    ideal, eff = ideal_and_efficiency([m], [v])
    assert ideal == pytest.approx(2.5 * 0.1 / 0.15)
    # measured decode-only: (10 / 0.8) / (10 / 1.0) = 1.25 -> efficiency 0.75
    assert eff == pytest.approx(1.25 / ideal)
    assert ideal_and_efficiency([rec("m", "p0", 1.0)], [rec("vanilla", "p0", 1.0)]) == (pytest.approx(math.nan,
                                                                                                    nan_ok=True),) * 2


def test_load_flag_and_its_mark_in_the_report(tmp_path: Path):
    assert not under_load({})  # files written before load was recorded
    assert not under_load({"load_start": [1.0, 1, 1], "cpus": 2})
    assert under_load({"load_start": [1.6, 1, 1], "cpus": 2})
    # After a turn the run itself is running: its own threads do not count.
    assert not under_load({"load_start": [0.1, 0, 0], "cpus": 2, "threads": 1}, [[2.4, 2, 2], None])
    assert under_load({"load_start": [0.1, 0, 0], "cpus": 2, "threads": 1}, [[1.0, 1, 1], [2.8, 2, 2]])
    for name, load in (("idle.jsonl", [0.2, 0.2, 0.2]), ("busy.jsonl", [5.0, 5.0, 5.0])):
        records = [rec("vanilla", "p0", 1.0), rec("sps", "p0", 0.5)]
        for r in records:
            r.load_avg = load
        lines = [{"type": "header", "meta": {**META, "bench": name, "load_start": [0.1, 0.1, 0.1], "cpus": 2}}]
        lines += [{"type": "record", **r.to_dict()} for r in records]
        (tmp_path / name).write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        write_report(tmp_path / name, tmp_path / name.replace(".jsonl", ""), figures=False)
        md = (tmp_path / name.replace(".jsonl", "") / "main_table.md").read_text()
        assert (f"2.00× [2.00, 2.00] (n=1) {MARK}" in md) == (name == "busy.jsonl")
        tex = (tmp_path / name.replace(".jsonl", "") / "main_table.tex").read_text()
        assert (r"\ddag{}" in tex) == (name == "busy.jsonl")


def test_table_lists_claims_with_data_and_counts_the_rest():
    """A block lists only the claims its records test; the others are counted in a note (and kept in the
    CSV), and a block where no claim has data gets no section at all."""
    from specbench.analysis.orderings import orderings_table

    untestable = Claim("c faster than d", "test", Sides(method=("c",)), Sides(method=("d",)))
    base = [rec("vanilla", f"p{i}", 1 + i / 10) for i in range(12)]
    tested = result_file(base + side("a", 0.5, 0.02) + side("b", 0.8, 0.02), "t0.jsonl")
    idle = result_file([rec("vanilla", "p0", 1.0), rec("x", "p0", 1.0)], "t1.jsonl", temperature=1.0)
    frame = ordering_frame([tested, idle], [CLAIM, untestable])
    assert sorted(frame.verdict) == ["holds", "no data", "no data", "no data"]
    table = orderings_table(frame, claims=[CLAIM, untestable])
    assert [label for label, _ in table.sections] == ["t · T = 0"]
    assert [row[0].text for row in table.sections[0][1]] == ["a faster than b"]
    note = next(n for n in table.notes if n.startswith("Only the claims"))
    assert "t · T = 0: 1 of 2" in note and "t · T = 1: 2 of 2" in note
    assert not any(n.startswith("c faster than d:") for n in table.notes)  # sources of listed claims only
    assert len(table.data) == len(frame)  # the CSV keeps the 'no data' rows
