"""Several method configurations in one run (--sweep, --also) and query streams (mixed benches,
--passes): labels, options, order and uniqueness of the records."""

from __future__ import annotations


import pytest

from specbench.errors import SpecbenchError
from specbench.run.plan import RunConfig, run_sides
from specbench.sides import Side, cli_sides, parse_spec, parse_sweep
from specbench.data.streams import MIXED_PARTS, build_queries, load_stream_prompts
from bench_data import needs_data
from test_cli import base_args, cli, read


def test_sweep_and_also_make_one_side_each():
    cfg = RunConfig(sides=cli_sides("sps", {"draft": "d"}, sweep="gamma=1,3",
                                    also=["medusa@max_nodes=15@topk=4", "vanilla@x=1"]), bench="humaneval")
    sides = run_sides(cfg)
    assert [s.label for s in sides] == ["sps@gamma=1", "sps@gamma=3", "medusa@max_nodes=15@topk=4", "vanilla@x=1"]
    assert sides[0].options == {"draft": "d", "gamma": "1"} and sides[1].options["gamma"] == "3"
    assert sides[2].method == "medusa" and sides[2].options == {"max_nodes": "15", "topk": "4"}


@pytest.mark.parametrize("bad", ["gamma", "=1,2", "gamma="])
def test_bad_sweep_is_one_clear_error(bad):
    with pytest.raises(SpecbenchError, match="--sweep expects key=v1,v2"):
        parse_sweep(bad)


def test_also_label_names_the_side():
    side = parse_spec("eagle3@total_tokens=16@depth=4@label=eagle3@budget=16")
    assert side == Side("eagle3", {"total_tokens": "16", "depth": "4"}, "eagle3@budget=16")
    assert side.label == "eagle3@budget=16" and side.shown == ()  # a given label is shown, never read back
    auto = parse_spec("medusa@max-nodes=15")  # no label given: the spec (its keys spelt as options) is the label
    assert (auto.label, auto.stem, auto.shown) == ("medusa@max_nodes=15", "medusa", ("max_nodes",))


def test_bad_also_and_duplicate_labels_are_refused():
    with pytest.raises(SpecbenchError, match="--also expects"):
        parse_spec("sps@gamma")
    with pytest.raises(SpecbenchError, match="share the label"):
        run_sides(RunConfig(sides=cli_sides("sps", {}, also=["sps"]), bench="humaneval"))


@needs_data
def test_mixed_stream_interleaves_equal_parts_round_robin():
    prompts = load_stream_prompts("mixed", limit=2)
    assert len(prompts) == 2 * len(MIXED_PARTS)
    assert [p.meta["source_bench"] for p in prompts] == list(MIXED_PARTS) * 2
    assert {p.bench for p in prompts} == {"mixed"}
    assert len({p.id for p in prompts}) == len(prompts)
    assert prompts[0].id.startswith("math500:")


def test_passes_repeat_the_stream_with_unique_ids():
    prompts = load_stream_prompts("humaneval", limit=3)
    queries = build_queries(prompts, passes=2)
    assert [q.index for q in queries] == list(range(6))
    assert [q.pass_index for q in queries] == [0, 0, 0, 1, 1, 1]
    assert queries[3].prompt.id == prompts[0].id + "#pass2"
    assert queries[3].prompt.turns == prompts[0].turns


def test_sweep_run_records_every_side_and_the_stream(models, tmp_path, capsys):
    out = tmp_path / "sweep.jsonl"
    # --also sides take only their own options (the main --opt values are not inherited)
    args = base_args(models, out, "--sweep", "gamma=1,2", "--also", f"sps@gamma=4@draft={models['draft']}",
                     "--passes", "2")
    args[args.index("--limit") + 1] = "1"
    code, stdout, err = cli(args, capsys)
    assert code == 0, err
    header, *records = read(out)
    labels = sorted({r["method"] for r in records})
    also = f"sps@gamma=4@draft={models['draft']}"
    assert labels == sorted(["sps@gamma=1", "sps@gamma=2", also, "vanilla"])
    assert header["meta"]["method_options"]["sps@gamma=2"]["gamma"] == 2
    assert len(header["meta"]["stream"]) == 2
    for label in labels:
        mine = sorted((r["query_index"], r["prompt_id"]) for r in records if r["method"] == label)
        assert [q for q, _ in mine] == [0, 1] and mine[1][1].endswith("#pass2")
    vanilla = {r["prompt_id"]: r["new_tokens"] for r in records if r["method"] == "vanilla"}
    for r in records:  # fp32 greedy: every side is lossless
        assert r["new_tokens"] == vanilla[r["prompt_id"]]


def test_unknown_also_method_fails_before_loading(models, tmp_path, capsys):
    code, _, err = cli(base_args(models, tmp_path / "x.jsonl", "--also", "nosuch@k=1"), capsys)
    assert code == 2 and "nosuch" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
