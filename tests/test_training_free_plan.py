"""The training-free methods in the reference set (beside vanilla and the trained methods, six benches,
the mixed stream, the summarization run) and their claims, decided by the orderings machinery on
hand-made records."""

import importlib.util
import os
from pathlib import Path

import pytest

from methods.suffix import arctic_available
from specbench.analysis.orderings import load_claims, ordering_frame
from specbench.engine.registry import method_class, parse_options
from specbench.run.plan import RunConfig, run_sides
from specbench.sides import cli_sides, parse_spec
from test_orderings import header, rec, result_file

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "reference_set.py"
FREE = {"pld", "suffix", "lookahead"}


def load_plan(repeats: int = 1):
    spec = importlib.util.spec_from_file_location("reference_set", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.plan(limit=24, repeats=repeats, stream_limit=8, passes=2)


def side_specs(argv):
    main = argv[argv.index("--method") + 1]
    opts = {argv[i + 1].split("=", 1)[0]: argv[i + 1].split("=", 1)[1] for i, a in enumerate(argv) if a == "--opt"}
    label = argv[argv.index("--label") + 1] if "--label" in argv else main
    return [(label, main, opts)] + [(s.label, s.method, s.options)
                                    for s in (parse_spec(argv[i + 1]) for i, a in enumerate(argv) if a == "--also")]


def test_every_bench_runs_them_beside_vanilla_and_the_trained_methods_and_their_options_fit_the_budget():
    module, runs = load_plan()
    main = {argv[argv.index("--bench") + 1]: argv for out, argv in runs if Path(out).name.startswith("main_")
            and out.endswith("_T0.jsonl")}
    assert set(main) == set(module.BENCHES)
    for argv in main.values():
        labels = {label for label, _, _ in side_specs(argv)}
        assert FREE <= labels and {"eagle3", "specblock", "sps", "medusa"} <= labels
        budget = int(argv[argv.index("--budget") + 1])
        cfg = RunConfig(sides=cli_sides(argv[argv.index("--method") + 1], {},
                                        also=[argv[i + 1] for i, a in enumerate(argv) if a == "--also"]),
                        bench="humaneval", budget=budget)
        for side in run_sides(cfg):  # the --budget options applied, then parsed as the runner does
            # suffix's options check its package, an extra (`make setup-suffix`): without it, the others only
            if side.method in FREE and (side.method != "suffix" or arctic_available()):
                parse_options(method_class(side.method), side.options)
    stream = next(argv for out, argv in runs if "suffix-stream_mixed" in out)
    assert {label for label, _, _ in side_specs(stream)} >= {"suffix", "pld"}
    assert stream[stream.index("--passes") + 1] == "2"
    copy = next(argv for out, argv in runs if out.startswith("results/copy_cnn_dailymail"))
    assert {label for label, _, _ in side_specs(copy)} >= FREE | {"eagle3", "specblock"}
    assert "--repeats" not in copy  # suffix remembers: it cannot be timed over repeats


def test_with_repeats_suffix_gets_its_own_file_timed_once():
    _, runs = load_plan(repeats=3)
    for out, argv in runs:
        if argv[0] != "run":
            continue
        labels = {label for label, _, _ in side_specs(argv)}
        if "suffix" in labels:
            assert "--repeats" not in argv or argv[argv.index("--repeats") + 1] == "1", out
    assert any("main-suffix_humaneval" in out for out, _ in runs)


def claim(text_start: str):
    return next(c for c in load_claims() if c.text.startswith(text_start))


def side(method, factor, bench, n=12, noise=0.02, committed=None):
    return [rec(method, f"p{i}", (1 + i / 10) * factor * (1 + noise * (-1) ** i), bench=bench, committed=committed)
            for i in range(n)]


@pytest.mark.parametrize("factor,want", [(0.5, "holds"), (1.6, "reversed")])
def test_prompt_lookup_claim_is_decided_on_summarization_only(factor, want):
    c = claim("prompt lookup faster than vanilla")
    records = side("vanilla", 1.0, "cnn_dailymail", noise=0) + side("pld", factor, "cnn_dailymail")
    records += side("vanilla", 1.0, "humaneval", noise=0) + side("pld", 3.0, "humaneval")  # not its claim's bench
    frame = ordering_frame([result_file(records)], [c])
    assert frame[["bench", "a", "b", "verdict"]].values.tolist() == [["cnn_dailymail", "pld", "vanilla", want]]


@pytest.mark.parametrize("label, options", [("lookahead", {}), ("lookahead@window=4", {"window": "4"})])
def test_lookahead_claim_takes_its_sides_with_any_options(label, options):
    c = claim("lookahead faster than vanilla")
    records = side("vanilla", 1.0, "mt_bench", noise=0) + side(label, 0.6, "mt_bench")
    frame = ordering_frame([result_file(records, **header({label: ("lookahead", options)}))], [c])
    assert frame.verdict.tolist() == ["holds"] and frame.a.tolist() == [label]


def test_suffix_claims_on_the_stream():
    faster = claim("suffix decoding faster than prompt lookup")
    records = side("vanilla", 1.0, "mixed", noise=0) + side("suffix", 0.5, "mixed") + side("pld", 0.8, "mixed")
    assert ordering_frame([result_file(records)], [faster]).verdict.tolist() == ["holds"]
    records = side("vanilla", 1.0, "mixed", noise=0) + side("suffix", 0.9, "mixed") + side("pld", 0.6, "mixed")
    assert ordering_frame([result_file(records)], [faster]).verdict.tolist() == ["reversed"]
    rises = claim("suffix decoding's acceptance rises")
    growing = [rec("suffix", f"q{i}", 1.0, committed=10 + i + (i % 3), bench="mixed", query_index=i) for i in range(24)]
    assert ordering_frame([result_file(growing)], [rises]).verdict.tolist() == ["holds"]
    flat = [rec("suffix", f"q{i}", 1.0, committed=30 - i, bench="mixed", query_index=i) for i in range(24)]
    assert ordering_frame([result_file(flat)], [rises]).verdict.tolist() == ["reversed"]


# ---- the spec-bench-table preset ----------------------------------------------------------------

@pytest.mark.skipif(not (Path(os.environ.get("SPECBENCH_DATA") or "/nonexistent") / "spec_bench").is_dir(),
                    reason="needs SPECBENCH_DATA with Spec-Bench's questions (spec_bench/)")
@pytest.mark.parametrize("target,eagle3", [("lmsys/vicuna-7b-v1.3", False), ("lmsys/vicuna-13b-v1.3", True)])
def test_spec_bench_table_runs_its_rows_with_spec_benchs_settings(target, eagle3, tmp_path):
    from specbench.run.preset import build_plan

    plan = build_plan("spec-bench-table", target, out_dir=tmp_path)
    assert [(b.bench, len(b.prompts), b.turns) for b in plan.benches] == [("spec_bench", 480, 560)]
    (run,) = plan.runs
    assert (run.cfg.temperature, run.cfg.max_new_tokens, run.cfg.dtype) == (0.0, 1024, "float16")
    sides = {s.label: s.side for s in plan.sides}
    assert set(sides) == {"sps", "pld", "lookahead", "medusa"} | ({"eagle3"} if eagle3 else set())
    assert sides["pld"].options == {"gamma": 10, "ngram": 3, "rule": "original"}
    assert sides["lookahead"].options == {"window": 7, "ngram": 5, "guess": 7, "budget": 0}
    if not eagle3:
        assert any(label == "eagle3" and "13B" in why for label, why in plan.skipped)
    for side in run_sides(run.cfg):  # every side's options are valid as the runner parses them
        parse_options(method_class(side.method), side.options)
