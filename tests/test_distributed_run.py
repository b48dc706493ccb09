"""`specbench run` under torchrun (2 CPU processes, gloo) on tiny models: one merged file in the
single-process order with identical greedy tokens, per-part resume (and resume of a merged
file), and `specbench merge` with its one-line refusals."""

from __future__ import annotations

import json

import pytest

from launch import torchrun
from test_cli import base_args, cli, read


def args_for(models, out, *extra):
    args = base_args(models, out, *extra)
    args[args.index("--limit") + 1] = "4"
    return args


@pytest.fixture(scope="module")
def single(models, tmp_path_factory):
    """The same run in one process: the reference file."""
    out = tmp_path_factory.mktemp("single") / "r.jsonl"
    argv = __import__("sys").argv
    try:
        __import__("sys").argv = ["specbench", *args_for(models, out)]
        from specbench.cli import main

        try:
            main()
        except SystemExit as exc:
            assert not exc.code
    finally:
        __import__("sys").argv = argv
    return read(out)


def order(lines):
    return [(o["method"], o["prompt_id"]) for o in lines[1:] if o["type"] == "record"]


def tokens(lines):
    return {(o["method"], o["prompt_id"]): o["new_tokens"] for o in lines[1:] if o["type"] == "record"}


def write(path, meta, lines):
    path.write_text("".join(json.dumps(o) + "\n" for o in [{"type": "header", "meta": meta}, *lines]))


def part(single, path, rank, queries, world=2, drop=()):
    """A hand-made part of ``single``: the records of ``queries`` (minus (method, query) in ``drop``)."""
    meta = {**single[0]["meta"], "rank": rank, "world_size": world}
    write(path, meta, [o for o in single[1:] if o["query_index"] in queries
                       and (o["method"], o["query_index"]) not in drop])
    return path


def test_torchrun_run_merges_one_file_in_query_order(models, tmp_path, single):
    out = tmp_path / "r.jsonl"
    args = args_for(models, out)
    args.remove("--no-warmup")  # each rank warms up
    done = torchrun(["-m", "specbench", *args])
    assert done.returncode == 0, done.stderr[-3000:]
    merged = read(out)
    assert order(merged) == order(single)  # each prompt once per side, in the one-process order
    assert tokens(merged) == tokens(single)  # fp32 greedy: the same tokens
    meta = merged[0]["meta"]
    assert meta["world_size"] == 2 and [p["rank"] for p in meta["parts"]] == [0, 1]
    assert meta["config_hash"] == single[0]["meta"]["config_hash"] and "rank" not in meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]  # parts removed
    assert done.stdout.count("specbench summary") == 1 and f"records: {out}" in done.stdout


def test_torchrun_resume_continues_a_part_and_a_merged_file(models, tmp_path, single):
    out = tmp_path / "r.jsonl"
    # As if an earlier run merged queries 0 and 2, and rank 1 of a later one died after one record.
    write(out, {**single[0]["meta"], "world_size": 2}, [o for o in single[1:] if o["query_index"] in (0, 2)])
    p1 = part(single, tmp_path / "r.jsonl.part-1of2", 1, {1}, drop={("sps", 1)})  # odd: vanilla ran first
    with open(p1, "a") as fh:
        fh.write('{"type": "record", "method": "sps", "new_tok')  # torn by the kill
    kept = {(o["method"], o["prompt_id"]): o for o in read(out)[1:] + [json.loads(x) for x in
                                                                       p1.read_text().splitlines()[1:-1]]}

    refused = torchrun(["-m", "specbench", *args_for(models, out)])
    assert refused.returncode != 0 and "already exists; pass --resume" in refused.stderr

    done = torchrun(["-m", "specbench", *args_for(models, out, "--resume")])
    assert done.returncode == 0, done.stderr[-3000:]
    merged = read(out)
    assert order(merged) == order(single) and tokens(merged) == tokens(single)
    for o in merged[1:]:
        if (o["method"], o["prompt_id"]) in kept:  # finished records are kept, not rerun
            assert o == kept[(o["method"], o["prompt_id"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_merge_by_hand_and_its_refusals(tmp_path, single, capsys):
    p0 = part(single, tmp_path / "r.jsonl.part-0of2", 0, {0, 2})
    p1 = part(single, tmp_path / "r.jsonl.part-1of2", 1, {1, 3})
    out = tmp_path / "merged.jsonl"

    code, stdout, err = cli(["merge", str(p1), str(p0), "--out", str(out)], capsys)
    assert code == 0, err
    merged = read(out)
    assert order(merged) == order(single) and merged[0]["meta"]["world_size"] == 2
    assert "merged 8 records from 2 files" in stdout
    code, _, err = cli(["merge", str(p0), str(p1), "--out", str(out)], capsys)
    assert code == 2 and "already exists" in err

    def refused(files, needle):
        code, _, err = cli(["merge", *map(str, files), "--out", str(tmp_path / "x.jsonl")], capsys)
        assert code == 2 and needle in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err

    refused([p0, p0, p1], "twice")
    refused([p0, p1, out], "both hold")
    refused([p0], "query 1 (HumanEval/1) has no sps record")
    refused([p0, part(single, tmp_path / "partial", 1, {1, 3}, drop={("vanilla", 3)})], "no vanilla record")
    other = tmp_path / "other.part-1of2"
    write(other, {**single[0]["meta"], "rank": 1, "config_hash": "0123456789ab"},
          [o for o in single[1:] if o["query_index"] in (1, 3)])
    refused([p0, other], "different configuration")
    refused([tmp_path / "missing.jsonl"], "does not exist")

    # A query the run skipped (too long for the context) is not missing; readers ignore skip lines.
    skips = [{"type": "skip", "method": m, "bench": "humaneval", "prompt_id": "HumanEval/3", "turn": 0,
              "query_index": 3} for m in ("sps", "vanilla")]
    short = tmp_path / "s.jsonl.part-1of2"
    write(short, {**single[0]["meta"], "rank": 1, "world_size": 2},
          [o for o in single[1:] if o["query_index"] == 1] + skips)
    code, _, err = cli(["merge", str(p0), str(short), "--out", str(tmp_path / "s.jsonl")], capsys)
    assert code == 0, err
    assert [o["type"] for o in read(tmp_path / "s.jsonl")[1:]].count("skip") == 2
    # With no files named, merge finds the parts of --out.
    code, _, err = cli(["merge", "--out", str(tmp_path / "r.jsonl")], capsys)
    assert code == 0 and order(read(tmp_path / "r.jsonl")) == order(single), err


def test_device_map_auto_is_a_pass_through_on_cpu(models, tmp_path, single, capsys):
    out = tmp_path / "r.jsonl"
    code, _, err = cli(args_for(models, out, "--device-map", "auto"), capsys)
    assert code == 0, err
    lines = read(out)
    assert tokens(lines) == tokens(single) and lines[0]["meta"]["device_map"] == ["cpu"]
    code, _, err = cli(args_for(models, tmp_path / "x.jsonl", "--device-map", "everywhere"), capsys)
    assert code == 2 and "--device-map must be one of 'auto', 'balanced'" in err
