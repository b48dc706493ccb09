"""`specbench recheck`: a bf16 results file judged by the exact rule after the fact gets the very verdicts the
run wrote, every other byte stays, a second pass changes nothing, and a file that cannot be re-checked is
one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

from specbench import divergence
from test_cli import cli

EXACT_KEYS = ("old_status", "rule", "exact_margin", "exact_logits", "exact_dtype", "gaps", "position_noise",
              "rounding_floor", "method_offset", "vanilla_offset", "replay_mismatches", "rescored_on")
METHOD = "lookahead"  # a training-free method whose tree verifies run on the tiny target


def _bf16_run(models, out: Path, capsys, bench: str = "mt_bench", limit: int = 3, *extra: str) -> None:
    args = ["run", "--method", METHOD, "--bench", bench, "--target", models["target"], "--dtype", "bfloat16",
            "--max-new-tokens", "16", "--limit", str(limit), "--out", str(out), "--no-warmup", *extra]
    code, _, err = cli(args, capsys)
    assert code == 0, err


def _as_before(line: bytes) -> bytes:
    """A record line as a writer without the exact rule left it: the bound's verdict, no exact figures."""
    obj = json.loads(line)
    d = obj.get("divergence")
    if obj.get("type") != "record" or not d or d.get("rule") != divergence.EXACT:
        return line
    d["status"] = d["old_status"]
    for key in EXACT_KEYS + ("why",):
        d.pop(key, None)
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def assert_rechecks_to(lines: list[bytes], flips: int, tmp_path: Path, capsys) -> None:
    """``lines`` (a run's file) stripped of the exact rule's fields re-check to the very records the run wrote,
    ``flips`` of them re-scored."""
    old = tmp_path / "old.jsonl"
    old.write_bytes(b"".join(_as_before(line) for line in lines))
    code, out, err = cli(["recheck", str(old)], capsys)
    assert code == 0, err
    assert f"re-scored {flips} flip(s)" in out
    for mine, theirs in zip(old.read_bytes().splitlines(keepends=True), lines, strict=True):
        a, b = json.loads(mine), json.loads(theirs)
        if a.get("divergence"):
            a["divergence"].pop("rescored_on", None)
        assert a == b


def _plant_flip(lines: list[bytes], position: int = 5) -> tuple[int, int]:
    """The method's turn 0 of the first conversation as an older writer records a flip at ``position`` (the
    bound's verdict, no exact figures), its turn 1 inheriting it: so that the file has a flip whatever this
    CPU's bf16 rounding does. Returns the two lines' indices."""
    first = next(i for i, line in enumerate(lines) if b'"type": "record"' in line and METHOD.encode() in line)
    record = json.loads(lines[first])
    token = record["new_tokens"][position]
    record["divergence"] = {"status": "near-tie", "position": position, "method_token": (token + 1) % 1000,
                            "vanilla_token": token, "method_margin": 0.0, "vanilla_margin": 0.0,
                            "method_margin_exact": True, "vanilla_margin_exact": True, "tolerance": 1.0}
    lines[first] = (json.dumps(record, ensure_ascii=False) + "\n").encode()
    later = next(i for i, line in enumerate(lines) if i > first and METHOD.encode() in line
                 and json.loads(line)["prompt_id"] == record["prompt_id"] and json.loads(line)["turn"] == 1)
    follow = json.loads(lines[later])
    follow["divergence"] = {"status": "near-tie", "after_turn": 0}
    lines[later] = (json.dumps(follow, ensure_ascii=False) + "\n").encode()
    return first, later


def test_recheck_judges_each_flip_as_the_run_would_and_keeps_every_other_byte(models, tmp_path, capsys):
    from specbench.engine.prompts import render_chat
    from specbench.engine.rescore import Rescorer
    from specbench.engine.target import Target
    from specbench.records import GenerationRecord
    from specbench.data.benchmarks import load_benchmark

    ran = tmp_path / "ran.jsonl"
    _bf16_run(models, ran, capsys)
    lines = [_as_before(line) for line in ran.read_bytes().splitlines(keepends=True)]
    genuine = [i for i, line in enumerate(lines) if b'"method_token"' in line]  # this CPU's own flips, if any
    first, later = _plant_flip(lines)
    old = tmp_path / "old.jsonl"
    old.write_bytes(b"".join(lines))

    code, out, err = cli(["recheck", str(old)], capsys)
    assert code == 0, err
    flips = sorted({first, *genuine})
    assert f"re-scored {len(flips)} flip(s)" in out and METHOD in out
    rechecked = old.read_bytes().splitlines(keepends=True)
    assert len(rechecked) == len(lines)
    changed = {i for i, (a, b) in enumerate(zip(rechecked, lines)) if a != b}
    assert changed == {*flips, later}  # every other line byte for byte
    for i in changed:
        a, b = json.loads(rechecked[i]), json.loads(lines[i])
        a.pop("divergence"), b.pop("divergence")
        assert a == b  # ... and every other field of these
    # the planted flip: the verdict of the engine's own re-scorer on an independently rendered prompt
    record = GenerationRecord.from_dict(json.loads(lines[first]))
    target = Target.load(models["target"], "bfloat16", "cpu")
    prompt = next(p for p in load_benchmark("mt_bench") if p.id == record.prompt_id)
    ids = render_chat(target.tokenizer, [{"role": "user", "content": prompt.turns[0]}], None, target.chat)
    expected = Rescorer(target).judge(record.divergence, ids, record)
    judged = json.loads(rechecked[first])["divergence"]
    assert judged.pop("rescored_on") and judged == json.loads(json.dumps(expected))
    assert judged["rule"] == divergence.EXACT and judged["old_status"] == "near-tie"
    assert judged["replay_mismatches"] == 0  # the rendered prompt reproduces vanilla's tokens
    inherited = json.loads(rechecked[later])["divergence"]
    assert inherited == {"status": judged["status"], "after_turn": 0, "rule": divergence.EXACT,
                         "old_status": "near-tie"}

    once = old.read_bytes()
    for extra in ([], ["--again"]):  # nothing new, then everything again: the same bytes
        code, out, err = cli(["recheck", str(old), *extra], capsys)
        assert code == 0, err
        assert old.read_bytes() == once


def test_a_bf16_run_writes_what_recheck_writes(models, tmp_path, capsys):
    """The run judges its own new flips: stripped of the exact rule's fields, its file re-checks to the same
    verdicts (whatever flips this CPU's rounding gives; the run's own records say how many)."""
    ran = tmp_path / "ran.jsonl"
    _bf16_run(models, ran, capsys, limit=4)
    lines = ran.read_bytes().splitlines(keepends=True)
    judged = [i for i, line in enumerate(lines) if b'"rule": "exact"' in line]
    assert_rechecks_to(lines, sum(b"method_token" in lines[i] for i in judged), tmp_path, capsys)


def test_a_batched_runs_flip_is_replayed_in_its_batch_shapes(models, tmp_path, capsys):
    """A flip of a batched run is re-scored with its record's batch shapes too (``batch``: B = 2 here), and the
    run writes what recheck writes."""
    ran = tmp_path / "ran.jsonl"
    _bf16_run(models, ran, capsys, "mt_bench", 2, "--batch-size", "2")
    lines = [_as_before(line) for line in ran.read_bytes().splitlines(keepends=True)]
    first, _ = _plant_flip(lines)
    assert json.loads(lines[first])["batch"]["size"] == 2
    old = tmp_path / "old.jsonl"
    old.write_bytes(b"".join(lines))
    code, _, err = cli(["recheck", str(old)], capsys)
    assert code == 0, err
    gaps = json.loads(old.read_bytes().splitlines()[first])["divergence"]["gaps"]
    assert {"batch2_method", "batch2_chain_1", "batch2_tree_2", "chain_2", "decode"} <= set(gaps)
    ran_lines = ran.read_bytes().splitlines(keepends=True)
    judged = [i for i, line in enumerate(ran_lines) if b'"rule": "exact"' in line]
    assert_rechecks_to(ran_lines, sum(b"method_token" in ran_lines[i] for i in judged), tmp_path, capsys)


def test_recheck_refuses_in_one_line(models, tmp_path, capsys):
    ran = tmp_path / "ran.jsonl"
    _bf16_run(models, ran, capsys)
    lines = [_as_before(line) for line in ran.read_bytes().splitlines(keepends=True)]
    first, _ = _plant_flip(lines)
    header, *rest = (line.decode() for line in lines)

    def variant(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    meta = json.loads(header)
    meta["meta"]["target"] = str(tmp_path / "no-such-model")
    gone = variant("gone.jsonl", json.dumps(meta) + "\n" + "".join(rest))
    shifted = list(rest)
    record = json.loads(shifted[first - 1])
    record["prompt_tokens"] += 1  # a prompt that no longer renders as the run rendered it
    shifted[first - 1] = json.dumps(record) + "\n"
    unrendered = variant("unrendered.jsonl", header + "".join(shifted))
    cases = [(tmp_path / "missing.jsonl", "no such results file"), (variant("text.jsonl", "hello\n"), "not"),
             (gone, "no-such-model"), (unrendered, "renders to")]
    for path, words in cases:
        before = path.read_bytes() if path.exists() else None
        code, _, err = cli(["recheck", str(path)], capsys)
        errors = [line for line in err.splitlines() if "error:" in line]  # (model loads draw progress bars)
        assert code == 2 and len(errors) == 1 and words in errors[0], err
        assert "Traceback" not in err
        assert (path.read_bytes() if path.exists() else None) == before  # left as it was
    # several files: each refusal on its line, the others re-checked, exit 2
    judged = ran.read_bytes()
    code, out, err = cli(["recheck", str(gone), str(ran)], capsys)
    assert code == 2 and "gone.jsonl: refused: " in out and "ran.jsonl: re-scored 0" in out
    assert len(err.strip().splitlines()) == 1 and "refused 1 of 2" in err and "gone.jsonl" in err
    assert ran.read_bytes() == judged  # judged at run time already: nothing new
    code, _, err = cli(["recheck", str(ran), "--exact-dtype", "float16"], capsys)
    assert code == 2 and "--exact-dtype" in err


def test_the_exact_dtypes_recheck_takes_are_those_the_rescorer_runs():
    """--exact-dtype's declared choices (what the command and recheck() refuse by) are the rescorer's dtypes."""
    import typing

    import pytest

    from specbench.engine.rescore import EXACT_DTYPES
    from specbench.options import declared_by_name
    from specbench.run.recheck import check_flags
    from specbench.errors import SpecbenchError
    from specbench.run.tool_configs import RecheckConfig

    assert typing.get_args(declared_by_name(RecheckConfig)["exact_dtype"].element) == tuple(EXACT_DTYPES)
    check_flags(None, None, "float64")
    with pytest.raises(SpecbenchError, match="^--exact-dtype must be one of 'float32', 'float64'"):
        check_flags(None, None, "float16")


def test_recheck_leaves_fp32_and_sampled_files_to_their_rule(models, tmp_path, capsys):
    from test_cli import base_args

    fp32 = tmp_path / "fp32.jsonl"
    assert cli(base_args(models, fp32), capsys)[0] == 0
    sampled = tmp_path / "t1.jsonl"
    assert cli(base_args(models, sampled, "--temperature", "1"), capsys)[0] == 0
    before = fp32.read_bytes(), sampled.read_bytes()
    code, out, err = cli(["recheck", str(fp32), str(sampled)], capsys)
    assert code == 0, err
    assert "float32: the bound stands" in out and "T = 1" in out
    assert (fp32.read_bytes(), sampled.read_bytes()) == before


def test_a_file_from_another_machine_is_rechecked_there_unless_asked(models, tmp_path, capsys):
    """The exact rule holds a run's gaps to the re-scoring machine's noise, so a file whose header names another
    machine is refused in one line (left as it was), and re-scored here only with --other-machine, which says so."""
    ran = tmp_path / "ran.jsonl"
    _bf16_run(models, ran, capsys)
    lines = [_as_before(line) for line in ran.read_bytes().splitlines(keepends=True)]
    _plant_flip(lines)
    header = json.loads(lines[0])
    header["meta"]["hardware"] = "Another CPU [family 6 model 1] (2 threads)"
    lines[0] = (json.dumps(header) + "\n").encode()
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(b"".join(lines))
    code, _, err = cli(["recheck", str(moved)], capsys)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "Another CPU" in errors[0] and "--other-machine" in errors[0], err
    assert moved.read_bytes() == b"".join(lines)
    code, out, err = cli(["recheck", str(moved), "--other-machine"], capsys)
    assert code == 0, err
    assert re.search(r"re-scored [1-9]\d* flip\(s\); noise measured on", out) and "(the run: Another CPU" in out
    assert any(b'"rescored_on"' in line for line in moved.read_bytes().splitlines())
