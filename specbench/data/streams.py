"""Query streams: the fixed, recorded order in which a run feeds prompts to one drafter instance.

Methods that learn while serving (``Drafter.learns``) carry state from one query to the next, so
the order is part of the experiment. A stream is one bench (file order, or ``--sample``), or a mix
of several benches interleaved round-robin (``mixed`` = equal parts of MATH-500, WMT-23, Alpaca and
Natural Questions, as in the shifted-stream protocol of SpecBlock App. D.2), repeated for ``passes``
passes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from specbench.data.benchmarks import Prompt, load_benchmark
from specbench.errors import SpecbenchError

MIXED = "mixed"
MIXED_PARTS = ("math500", "wmt23", "alpaca", "natural_questions")


@dataclass(frozen=True)
class Query:
    index: int  # position in the whole stream, 0-based, across passes
    pass_index: int  # 0-based
    prompt: Prompt  # id carries a "#passN" suffix from the second pass on, so records stay unique


def stream_parts(spec: str) -> tuple[str, ...] | None:
    """The benches a mixed-stream spec names (``mixed`` or ``a+b+c``); None for a single bench."""
    if spec == MIXED:
        return MIXED_PARTS
    if "+" in spec and not spec.endswith(".jsonl"):
        parts = tuple(p.strip() for p in spec.split("+") if p.strip())
        if len(parts) < 2:
            raise SpecbenchError(f"mixed stream {spec!r} needs two or more benches joined by '+'")
        return parts
    return None


def stream_name(spec: str) -> str:
    return spec if stream_parts(spec) else Path(spec).stem


def load_stream_prompts(spec: str, data_dir: str | None = None, *, limit: int | None = None,
                        sample: int | None = None, seed: int = 0, category: str | None = None) -> list[Prompt]:
    """Prompts of one bench, or of a mixed stream with ``limit``/``sample`` prompts *per part*,
    interleaved round-robin (a, b, c, a, b, c, ...) so every stretch of the stream is mixed."""
    parts = stream_parts(spec)
    if parts is None:
        return load_benchmark(spec, data_dir, limit=limit, sample=sample, seed=seed, category=category)
    if category is not None:
        raise SpecbenchError("--category applies to one bench, not to a mixed stream; drop it or run one bench")
    twice = next((p for i, p in enumerate(parts) if p in parts[:i]), None)
    if twice is not None:  # records are keyed by prompt id: the second copy of a prompt would look done
        raise SpecbenchError(f"mixed stream {spec!r} names {twice} twice; name each bench once (--passes N repeats "
                             "a stream)")
    loaded = [load_benchmark(p, data_dir, limit=limit, sample=sample, seed=seed) for p in parts]
    name = stream_name(spec)
    mixed: list[Prompt] = []
    for i in range(max(len(p) for p in loaded)):
        for prompts in loaded:
            if i < len(prompts):
                p = prompts[i]
                mixed.append(dataclasses.replace(p, bench=name, id=f"{p.bench}:{p.id}",
                                                 meta={**p.meta, "source_bench": p.bench}))
    return mixed


def build_queries(prompts: list[Prompt], passes: int = 1) -> list[Query]:
    if passes < 1:
        raise SpecbenchError(f"--passes must be >= 1 (got {passes})")
    queries = []
    for k in range(passes):
        for p in prompts:
            prompt = p if k == 0 else dataclasses.replace(p, id=f"{p.id}#pass{k + 1}")
            queries.append(Query(len(queries), k, prompt))
    return queries
