"""What the engine's clock costs (prints figures; not a test).

Vanilla decoding through the engine with its per-phase / per-forward timer (CUDA events on a GPU,
perf_counter_ns on a CPU) vs the same engine with a timer that records nothing, on the same
prompts, interleaved prompt by prompt (the order alternates), several rounds. Throughput is
measured outside the engine with perf_counter (after a synchronize on CUDA). Prints the median
paired ratio timed / untimed tokens/s; the goal is >= 0.98.

Usage: python bench/timing_overhead.py [--device auto|cpu|cuda] [--target smollm2-135m] [--dtype auto]
       [--prompts 5] [--max-new-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from specbench.engine import DEFAULT_TARGET
from specbench.engine.vanilla import VanillaDrafter
from specbench.data.benchmarks import load_benchmark
from specbench.engine.devices import choose_dtype, resolve_device
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.prompts import render_chat
from specbench.data.results import hardware
from specbench.engine.target import Target
from specbench.engine.timing import NullTimer, synchronize

warnings.filterwarnings("ignore")


def tokens_per_second(target: Target, drafter, ids: list[int], config: GenerationConfig, timed: bool) -> float:
    synchronize(target.device)
    start = time.perf_counter()
    record = generate(target, drafter, ids, config, timer=None if timed else NullTimer())
    synchronize(target.device)
    return len(record.new_tokens) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    device = resolve_device(args.device)
    dtype, why = choose_dtype(args.dtype, device)
    target = Target.load(args.target, dtype, device, args.attn)
    prompts = [render_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
               for p in load_benchmark("mt_bench", limit=args.prompts)]
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    # No EOS stop: every generation is exactly max_new_tokens long on both sides.
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_on_eos=False)
    for timed in (True, False):  # warm-up (kernels, allocator, event pool)
        tokens_per_second(target, vanilla, prompts[0], GenerationConfig(max_new_tokens=8, stop_on_eos=False), timed)

    ratios, timed_tps, untimed_tps = [], [], []
    for r in range(args.rounds):
        for i, ids in enumerate(prompts):
            order = (True, False) if (i + r) % 2 == 0 else (False, True)
            got = {timed: tokens_per_second(target, vanilla, ids, config, timed) for timed in order}
            timed_tps.append(got[True])
            untimed_tps.append(got[False])
            ratios.append(got[True] / got[False])
    ratios.sort()
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    print(f"target {args.target} {dtype} ({why}) on {device} [{hardware(device)}], attn {args.attn}, "
          f"{len(prompts)} mt_bench prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"vanilla timed (engine clock):   {statistics.median(timed_tps):8.2f} tok/s (median)")
    print(f"vanilla untimed (NullTimer):    {statistics.median(untimed_tps):8.2f} tok/s (median)")
    print(f"timed / untimed, paired median: {statistics.median(ratios):8.3f} [IQR {q1:.3f}, {q3:.3f}] "
          f"over {len(ratios)} pairs (goal >= 0.98)")


if __name__ == "__main__":
    main()
