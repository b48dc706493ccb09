"""Engine benchmark (prints figures; not a test).

1. Vanilla decoding through our engine vs Hugging Face ``model.generate`` (greedy, KV cache) on
   the same prompts of the default target, interleaved prompt by prompt: tokens/s and ratio.
   Goal: >= 1.0x, i.e. our cache and verify code do not slow the baseline down.
2. The harness overhead share of ``sps``: decode time that is not a model forward.

Usage: python bench/engine_vs_hf.py [--prompts 5] [--max-new-tokens 64] [--dtype bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from methods.sps.drafter import SpSDrafter, SpSOptions
from specbench.engine import DEFAULT_TARGET
from specbench.engine.vanilla import VanillaDrafter
from specbench import metrics
from specbench.data.benchmarks import load_benchmark
from specbench.engine.loop import GenerationConfig, generate
from specbench.engine.prompts import render_chat
from specbench.engine.target import Target

warnings.filterwarnings("ignore")


def hf_generate(target: Target, ids: list[int], max_new: int) -> tuple[int, float]:
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                    pad_token_id=target.tokenizer.eos_token_id)
    return out.shape[1] - len(ids), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sps-draft", default="truncated:4")
    args = ap.parse_args()

    target = Target.load(DEFAULT_TARGET, args.dtype)
    prompts = [render_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
               for p in load_benchmark("mt_bench", limit=args.prompts)]
    vanilla = VanillaDrafter()
    vanilla.setup(target)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    generate(target, vanilla, prompts[0], GenerationConfig(max_new_tokens=8))  # warm-up
    hf_generate(target, prompts[0], 8)

    ours_tps, hf_tps = [], []
    for r in range(args.rounds):
        for i, ids in enumerate(prompts):
            # Alternate who goes first so drift hits both sides alike.
            for side in (("ours", "hf") if (i + r) % 2 == 0 else ("hf", "ours")):
                if side == "ours":
                    rec = generate(target, vanilla, ids, config)
                    ours_tps.append(rec.num_new / rec.total_time)
                else:
                    n, secs = hf_generate(target, ids, args.max_new_tokens)
                    hf_tps.append(n / secs)
    ours, hf = statistics.median(ours_tps), statistics.median(hf_tps)
    # Paired ratios (same prompt, same round, run back to back) cancel most of the machine drift.
    paired = sorted(o / h for o, h in zip(ours_tps, hf_tps))
    q1, q3 = paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
    print(f"target smollm2-135m {args.dtype}, {len(prompts)} mt_bench prompts x {args.rounds} rounds, "
          f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} threads")
    print(f"vanilla through specbench engine: {ours:6.2f} tok/s (median)")
    print(f"HF model.generate:                {hf:6.2f} tok/s (median)")
    print(f"ratio of medians engine / HF:     {ours / hf:6.3f}x")
    print(f"paired ratio, median [IQR]:       {statistics.median(paired):6.3f}x [{q1:.3f}, {q3:.3f}] over {len(paired)} pairs")

    sps = SpSDrafter(SpSOptions(draft=args.sps_draft, gamma=4))
    sps.setup(target)
    records = [generate(target, sps, ids, config) for ids in prompts]
    phases = metrics.phase_breakdown(records)
    print(f"sps (draft={args.sps_draft}, gamma=4): tau {metrics.tau(records):.2f}, "
          f"T_D {100 * metrics.draft_share(records):.0f}%, "
          f"harness overhead (decode time outside model forwards) {100 * metrics.harness_overhead(records):.1f}%, "
          f"commit/bookkeeping {100 * phases['commit'] / sum(r.decode_time for r in records):.1f}%")


if __name__ == "__main__":
    main()
