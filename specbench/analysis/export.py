"""Spec-Bench interop: our results files as Spec-Bench answer files, so its own ``evaluation/speed.py``
reads our runs.

Spec-Bench (hemingkx/Spec-Bench ``evaluation/eval.py``) writes one JSON line per question::

    {"question_id", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index": 0, "turns": [text per turn], "decoding_steps": [verify calls per turn],
                  "new_tokens": [tokens per turn], "wall_time": [seconds per turn],
                  "accept_lengths": [tokens committed per step, all turns]}]}

and ``speed.py`` compares a method's file with the vanilla file. One file per method label is written:
``<model_id>-<label>.jsonl`` (vanilla included). ``wall_time`` is our end-to-end time (prefill + decode),
as Spec-Bench times the whole forward function; ``accept_lengths`` are committed tokens per verify call
(accepted + bonus); the baseline gets ``[1] * new_tokens`` as Spec-Bench's baseline_forward writes.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Callable, Sequence

from specbench.errors import SpecbenchError
from specbench.engine import VANILLA as BASELINE
from specbench.records import GenerationRecord

FORMATS = ("spec-bench",)


def question_id(prompt_id: str):
    """Spec-Bench's ids are integers; ours are their strings (other benches keep their own ids)."""
    return int(prompt_id) if prompt_id.isdigit() else prompt_id


def answer_rows(records: Sequence[GenerationRecord], categories: dict[str, str], model_id: str,
                decode: Callable[[list[int]], str], tstamp: float) -> list[dict]:
    """One Spec-Bench answer row per question of one method's records, in question order."""
    by_prompt: dict[str, list[GenerationRecord]] = {}
    for r in records:
        by_prompt.setdefault(r.prompt_id, []).append(r)
    rows = []
    for pid in sorted(by_prompt, key=lambda p: (not p.isdigit(), int(p) if p.isdigit() else 0, p)):
        turns = sorted(by_prompt[pid], key=lambda r: r.turn)
        baseline = turns[0].method == BASELINE
        accept = [1] * sum(r.num_new for r in turns) if baseline else \
            [a + 1 for r in turns for a in r.accept_lengths]
        choice = {"index": 0, "turns": [decode(r.new_tokens) for r in turns],
                  "decoding_steps": [r.num_new if baseline else r.n_verify for r in turns],
                  "new_tokens": [r.num_new for r in turns], "wall_time": [r.total_time for r in turns],
                  "accept_lengths": accept}
        rows.append({"question_id": question_id(pid), "category": categories.get(pid, turns[0].bench),
                     "answer_id": uuid.uuid5(uuid.NAMESPACE_URL, f"{model_id}/{pid}").hex[:22],
                     "model_id": model_id, "choices": [choice], "tstamp": tstamp})
    return rows


def load_tokenizer(spec: str):
    """The target's tokenizer (embedded name, folder, .gguf or hub id), to turn tokens back into text."""
    from transformers import AutoTokenizer

    from specbench.engine.target import DEFAULT_TARGET, embedded_gguf

    try:
        if spec == DEFAULT_TARGET or spec.endswith(".gguf"):
            gguf = embedded_gguf(spec) if spec == DEFAULT_TARGET else Path(spec)
            return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return AutoTokenizer.from_pretrained(spec)
    except SpecbenchError:
        raise
    except Exception as e:  # missing folder, offline hub, ...: one line
        raise SpecbenchError(f"cannot load the tokenizer of {spec!r} ({type(e).__name__}); pass --tokenizer") from None


def prompt_categories(bench: str, data_dir: str | None = None) -> dict[str, str]:
    """prompt id -> Spec-Bench category (MT-Bench rows carry their sub-category, as Spec-Bench's do)."""
    from specbench.run.benchmarks import load_benchmark

    try:
        prompts = load_benchmark(bench, data_dir)
    except SpecbenchError:
        return {}
    return {p.id: str(p.meta.get("category", bench)) for p in prompts}


def export_spec_bench(results: str | Path, out_dir: str | Path | None = None, tokenizer: str | None = None,
                      data_dir: str | None = None) -> list[Path]:
    """Write one Spec-Bench answer file per method label of RESULTS; returns their paths."""
    from specbench.analysis.report import read_result_file

    path = Path(results)
    if not path.is_file():
        raise SpecbenchError(f"results file {path} does not exist")
    result = read_result_file(path)
    if not result.records:
        raise SpecbenchError(f"{path} has no records; run `specbench run ...` first")
    target = str(result.meta.get("target", ""))
    tok = load_tokenizer(tokenizer or target)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True).strip()  # noqa: E731 (as eval.py strips)
    bench = result.records[0].bench
    categories = prompt_categories(bench, data_dir or result.meta.get("data_dir"))
    model_id = Path(target.rstrip("/")).name.replace(".gguf", "") or "model"
    temperature = float(result.meta.get("temperature", result.records[0].temperature))
    out = Path(out_dir) if out_dir else path.parent / f"{path.stem}_spec-bench"
    out.mkdir(parents=True, exist_ok=True)
    stamp = path.stat().st_mtime
    written = []
    for label in sorted({r.method for r in result.records}):
        rows = answer_rows([r for r in result.records if r.method == label], categories, f"{model_id}-{label}",
                           decode, stamp)
        file = out / f"{model_id}-{label.replace('/', '_')}-temperature-{temperature:g}.jsonl"
        file.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        written.append(file)
    return written
