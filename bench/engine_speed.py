"""Vanilla decoding speed in both engines against transformers' own compiled generate, and the verify cost curve.

    python bench/engine_speed.py                                   # smollm2-135m fp32 + bf16, Qwen 1.5B if fetched
    python bench/engine_speed.py --targets smollm2-135m --dtypes float32 --tokens 32 --rounds 1   # a smoke run

For each target and dtype, on one prompt (MT-Bench's first, in the chat template; SPECBENCH_DATA or a fixed text):

1. the machine's read bandwidth (the best of five sums over a 1 GiB tensor, torch's own threads) and the
   weights' bytes: the bound on vanilla tokens/s if each step read every weight once at that rate;
2. vanilla tokens/s, greedy, ``--tokens`` new tokens, the median over ``--rounds`` rounds in which the three
   run back to back in a rotating order: specbench's loop with ``--engine eager``, with ``--engine compiled``,
   and transformers' ``generate`` with a static cache and ``torch.compile`` (``cache_implementation="static"``,
   a ``CompileConfig`` that compiles on every device). Decode only: ours from the engine's decode phases;
   transformers' as a run of ``--tokens`` less a run of one token. Graph builds happen before the rounds and
   are reported apart (ours: ``outside_clock``; transformers': its first two calls' wall time). *same text*:
   whether the three wrote the same tokens;
3. the verify cost curve: the median ms of one verify forward over N chain rows (N in ``--rows``) after the
   prompt, in each engine (the compiled one pads N to its bucket).

Writes ``--out`` (Markdown) and a CSV beside it. Run it alone on an idle machine.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from specbench.data.results import environment_metadata
from specbench.engine import DEFAULT_TARGET
from specbench.engine.compiled_forward import TUNING_ENV, tuning_level
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.prompts import render_chat
from specbench.engine.target import Target
from specbench.engine.timing import synchronize
from specbench.engine.tree import DraftTree
from specbench.engine.vanilla import VanillaDrafter
from specbench.errors import SpecbenchError

warnings.filterwarnings("ignore")
QWEN = "qwen2.5-coder-1.5b"
FALLBACK_PROMPT = "Compose an engaging travel blog post about a recent trip to Hawaii."
GIB = 2 ** 30


def read_bandwidth(device: str) -> float:
    """GB/s torch reads on ``device``: the best of five sums over a 1 GiB float32 tensor."""
    x = torch.ones(GIB // 4, device=device)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        x.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return GIB / best / 1e9


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prompt_ids(target: Target) -> list[int]:
    text = FALLBACK_PROMPT
    if os.environ.get("SPECBENCH_DATA"):
        from specbench.data.benchmarks import load_benchmark

        text = load_benchmark("mt_bench", limit=1)[0].turns[0]
    return render_chat(target.tokenizer, [{"role": "user", "content": text}], None, target.chat)


def ours(target: Target, ids: list[int], tokens: int) -> tuple[float, list[int], float]:
    """(decode tokens/s, tokens, seconds outside the clock) of vanilla through the engine."""
    drafter = VanillaDrafter()
    drafter.setup(target)
    record = generate(target, drafter, ids, GenerationConfig(max_new_tokens=tokens, stop_on_eos=False))
    return (record.num_new - 1) / record.decode_time, record.new_tokens, sum(record.outside_clock.values())


def hf_compiled(model, ids: list[int], tokens: int, room: int) -> tuple[float, list[int]]:
    """(decode tokens/s, tokens) of transformers' generate with a static cache and torch.compile. Every call gets
    a fresh static cache of the same ``room`` columns: its graphs are specialised to that length."""
    from transformers import CompileConfig, StaticCache

    from specbench.engine import kvcache

    x = torch.tensor([ids], device=model.device)
    config = CompileConfig(dynamic=False)
    config._compile_all_devices = True  # transformers compiles on CUDA-like devices only unless told (a class field)
    keyword = kvcache.cache_keyword(type(model).forward)
    kwargs = dict(attention_mask=torch.ones_like(x), do_sample=False, compile_config=config, pad_token_id=0)
    seconds = []
    import torch._inductor.config as inductor

    # the compiler's defaults: our CPU tuning (engine/compiled_forward.py) would freeze their cache's position counter
    with torch.inference_mode(), inductor.patch(freezing=False, cpp_wrapper=False, max_autotune=False):
        for n in (1, tokens):
            kwargs[keyword] = StaticCache(config=model.config, max_cache_len=room)
            synchronize(model.device)
            start = time.perf_counter()
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kwargs)
            synchronize(model.device)
            seconds.append(time.perf_counter() - start)
    return (tokens - 1) / (seconds[1] - seconds[0]), out[0, len(ids):].tolist()


def verify_ms(target: Target, ids: list[int], rows: int, repeats: int) -> float:
    """Median ms of one verify forward over ``rows`` chain rows after ``ids`` (the cache cut back each time)."""
    target.reserve(len(ids) + rows + 1)
    target.prefill(ids)
    chain = DraftTree.chain(torch.arange(1, rows))
    times = []
    for _ in range(repeats + 1):
        compiled = target.compile_tree(ids[-1], chain)
        synchronize(target.device)
        start = time.perf_counter()
        target.verify(compiled)
        synchronize(target.device)
        times.append(time.perf_counter() - start)
        target.drop_uncommitted()
    return 1000 * statistics.median(times[1:])


def measure(spec: str, dtype: str, args, bandwidth: float) -> tuple[list[list[str]], list[list[str]]]:
    eager = Target.load(spec, dtype, args.device)
    compiled = Target(eager.model, eager.tokenizer, eager.name, engine="compiled")
    compiled.chat = eager.chat
    ids = prompt_ids(eager)
    gigabytes = weight_bytes(eager.model) / 1e9
    bound = bandwidth / gigabytes
    # graphs first: transformers' (its first calls' wall time), built with the compiler's defaults: our CPU tuning
    # freezes what a graph reads as fixed, and their static cache's position counter must stay a live tensor;
    # then ours (its outside-clock time)
    start = time.perf_counter()
    room = len(ids) + args.tokens + 1
    try:
        hf_compiled(eager.model, ids, args.tokens, room)
        runs: dict[str, list[float]] = {"eager": [], "compiled": [], "transformers compiled": []}
    except Exception as exc:  # noqa: BLE001 - their compiled generate on this machine: reported, not fatal
        print(f"{spec} {dtype}: transformers' compiled generate failed ({type(exc).__name__}: {exc})"[:300],
              file=sys.stderr)
        runs = {"eager": [], "compiled": []}
    hf_build = time.perf_counter() - start
    _, _, build = ours(compiled, ids, 8)
    texts: dict[str, list[int]] = {}
    order = list(runs)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            if name == "transformers compiled":
                try:
                    tps, text = hf_compiled(eager.model, ids, args.tokens, room)
                except Exception as exc:  # noqa: BLE001 - reported in the table's notes, not fatal
                    print(f"{spec} {dtype}: transformers' compiled generate failed in round {r + 1} "
                          f"({type(exc).__name__}: {exc})"[:300], file=sys.stderr)
                    tps, text = float("nan"), texts.get("eager", [])
            else:
                tps, text, _ = ours(eager if name == "eager" else compiled, ids, args.tokens)
            runs[name].append(tps)
            texts[name] = text
        print(f"{spec} {dtype} round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()),
              flush=True)
    med = {k: statistics.median([x for x in v if x == x] or [float("nan")]) for k, v in runs.items()}
    same = "yes" if all(text[:len(texts["eager"])] == texts["eager"] for text in texts.values()) else "no"
    speed = [[spec, dtype, name, f"{med[name]:.1f}", f"{100 * med[name] / bound:.0f}%",
              f"{med[name] / med['eager']:.2f}x", f"{build if name == 'compiled' else hf_build if name != 'eager' else 0:.0f}",
              same] for name in runs]
    curve = []
    for rows in args.rows:
        e, c = verify_ms(eager, ids, rows, args.repeats), verify_ms(compiled, ids, rows, args.repeats)
        curve.append([spec, dtype, str(rows), f"{e:.1f}", f"{c:.1f}", f"{e / c:.2f}x"])
        print(f"{spec} {dtype} verify {rows} rows: eager {e:.1f} ms, compiled {c:.1f} ms", flush=True)
    print(f"{spec} {dtype}: {gigabytes:.2f} GB of weights, bound {bound:.0f} tok/s at {bandwidth:.1f} GB/s", flush=True)
    return speed, curve


SPEED = ["target", "dtype", "engine", "tok/s", "of bound", "vs eager", "graph build s", "same text"]
CURVE = ["target", "dtype", "rows", "eager ms", "compiled ms", "eager / compiled"]


def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def write(out: Path, args, bandwidth: float, seconds: float, speed: list[list[str]], curve: list[list[str]]) -> None:
    env = environment_metadata(args.device)
    tuning = f"CPU graph tuning level {tuning_level()} ({TUNING_ENV}); " if args.device == "cpu" else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "# Engine speed: vanilla decoding in both engines, and transformers' compiled generate\n\n"
        f"Hardware: {env['hardware']}; {env['threads']} threads; git {env['git_sha']}; {tuning}read bandwidth "
        f"{bandwidth:.1f} GB/s; {seconds:.0f} s. Command: `python bench/engine_speed.py {' '.join(sys.argv[1:])}`.\n\n"
        f"Greedy, {args.tokens} new tokens, median of {args.rounds} rounds (the three back to back, order rotating). "
        "*of bound*: tokens/s over the bandwidth bound (read bandwidth / bytes of weights). *graph build s*: "
        "time spent building graphs before the rounds, never in the tokens/s. *same text*: whether the three wrote "
        "the same tokens (in bf16 the engines' kernels round differently, so a near-tie can flip).\n\n"
        + table(SPEED, speed) + f"\n## Verify cost (median of {args.repeats} forwards after the prompt)\n\n"
        + table(CURVE, curve))
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind"] + SPEED)
        w.writerows([["speed"] + r for r in speed])
        w.writerow(["kind"] + CURVE)
        w.writerows([["verify"] + r for r in curve])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=f"{DEFAULT_TARGET},{QWEN}")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--out", default="reports/engine_speed.md")
    args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    start = time.perf_counter()
    bandwidth = read_bandwidth(args.device)
    speed, curve = [], []
    for spec in args.targets.split(","):
        for dtype in args.dtypes.split(","):
            try:
                s, c = measure(spec, dtype, args, bandwidth)
            except SpecbenchError as exc:
                print(f"{spec} {dtype}: skipped ({exc})", file=sys.stderr)
                continue
            speed += s
            curve += c
            write(Path(args.out), args, bandwidth, time.perf_counter() - start, speed, curve)  # after each setting
    out = Path(args.out)
    print(f"wrote {out} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
