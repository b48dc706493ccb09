"""`specbench recheck`: a bf16 results file judged by the exact rule after the fact gets the very verdicts the
run wrote, every other byte stays, a second pass changes nothing, and a file that cannot be re-checked is
one line."""

from __future__ import annotations

import json
from pathlib import Path

from specbench import divergence
from test_cli import cli

EXACT_KEYS = ("old_status", "rule", "exact_margin", "exact_logits", "exact_dtype", "gaps", "position_noise",
              "rounding_floor", "method_offset", "vanilla_offset", "replay_mismatches", "rescored_on")


def _bf16_run(models, out: Path, capsys, bench: str = "mt_bench", limit: int = 3) -> None:
    args = ["run", "--method", "sps", "--bench", bench, "--target", models["target"], "--dtype", "bfloat16",
            "--opt", f"draft={models['draft']}", "--opt", "gamma=3", "--max-new-tokens", "24", "--limit", str(limit),
            "--out", str(out), "--no-warmup"]
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


def test_recheck_writes_the_runs_own_verdicts_and_nothing_else(models, tmp_path, capsys):
    ran = tmp_path / "ran.jsonl"
    _bf16_run(models, ran, capsys)
    lines = ran.read_bytes().splitlines(keepends=True)
    records = [json.loads(line) for line in lines[1:]]
    judged = [r for r in records if (r["divergence"] or {}).get("rule") == divergence.EXACT]
    assert judged, "the tiny bf16 target flips near-ties"
    assert all("after_turn" not in r["divergence"] for r in judged)
    assert any("after_turn" in (r["divergence"] or {}) for r in records)  # MT-Bench: later turns inherit
    old = tmp_path / "old.jsonl"
    old.write_bytes(b"".join(_as_before(line) for line in lines))
    assert old.read_bytes() != ran.read_bytes()

    code, out, err = cli(["recheck", str(old)], capsys)
    assert code == 0, err
    assert f"re-scored {len(judged)} flip(s)" in out and "sps" in out
    rechecked = old.read_bytes().splitlines(keepends=True)
    assert len(rechecked) == len(lines)
    for mine, theirs in zip(rechecked, lines):
        a, b = json.loads(mine), json.loads(theirs)
        if a.get("type") == "record" and a["divergence"] and a["divergence"].get("rule") == divergence.EXACT:
            assert a["divergence"].pop("rescored_on", None) is not None or "after_turn" in a["divergence"]
            assert a == b  # the run's own verdict and figures, every other field as written
        else:
            assert mine == theirs  # byte for byte

    once = old.read_bytes()
    for extra in ([], ["--again"]):  # nothing new, then everything again: the same bytes
        code, out, err = cli(["recheck", str(old), *extra], capsys)
        assert code == 0, err
        assert old.read_bytes() == once


def test_recheck_refuses_in_one_line(models, tmp_path, capsys):
    ran = tmp_path / "ran.jsonl"
    _bf16_run(models, ran, capsys, bench="humaneval", limit=4)
    header, *rest = (_as_before(line).decode() for line in ran.read_bytes().splitlines(keepends=True))

    def variant(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    meta = json.loads(header)
    meta["meta"]["target"] = str(tmp_path / "no-such-model")
    gone = variant("gone.jsonl", json.dumps(meta) + "\n" + "".join(rest))
    flips = [i for i, line in enumerate(rest) if '"method_token"' in line]
    assert flips, "the tiny bf16 target flips near-ties"
    shifted = list(rest)
    record = json.loads(shifted[flips[0]])
    record["prompt_tokens"] += 1
    shifted[flips[0]] = json.dumps(record) + "\n"
    unrendered = variant("unrendered.jsonl", header + "".join(shifted))
    cases = [(tmp_path / "missing.jsonl", "no such results file"), (variant("text.jsonl", "hello\n"), "not"),
             (gone, "no-such-model"), (unrendered, "renders to")]
    for path, words in cases:
        before = path.read_bytes() if path.exists() else None
        code, _, err = cli(["recheck", str(path)], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err
        assert "Traceback" not in err
        assert (path.read_bytes() if path.exists() else None) == before  # left as it was
    # several files: each refusal on its line, the others re-checked, exit 2
    judged = ran.read_bytes()
    code, out, err = cli(["recheck", str(gone), str(ran)], capsys)
    assert code == 2 and "gone.jsonl" in err and "refused 1 of 2" in err and "ran.jsonl: re-scored 0" in out
    assert ran.read_bytes() == judged  # judged at run time already: nothing new
    code, _, err = cli(["recheck", str(ran), "--exact-dtype", "float16"], capsys)
    assert code == 2 and "--exact-dtype" in err


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
