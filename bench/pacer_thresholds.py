"""How PACER's halting threshold t would act on held-out replayed drafts: the shipped pre-verifier scores
every draft of the held-out answers' replayed steps (the trainer's replay cache and split); for each t the
script prints how often the first block (drafts 1..b) passes, i.e. gamma = b vs 2b, and the accepted drafts
per step that choice would keep, beside fixed gamma (the SpS sweep).

    SPECBENCH_DATA=../shared/datasets python bench/pacer_thresholds.py [--pacer drafters/smollm2-135m/pacer]

It reads the replay cache `specbench train pacer` wrote (run that first on this machine). Used to pick
the tuned t of the reference set's PACER group.
"""

from __future__ import annotations

import argparse
import glob
import random
import statistics
from collections import Counter

import torch

from methods.pacer import collate, load_preverifier
from methods.sps import SpSDrafter, SpSOptions
from specbench.target import Target, cache_dir


def held_out_steps(pacer: str, target: str, held_out: float) -> list[tuple[list[float], int, int]]:
    """(predicted acceptance of each draft, accepted, drafted) for every held-out replayed step."""
    caches = sorted(glob.glob(str(cache_dir() / "pacer" / "*.pt")))
    if not caches:
        raise SystemExit("pacer_thresholds: no replay cache; run `specbench train pacer` first")
    items = torch.load(caches[-1], weights_only=False)
    random.Random(0).shuffle(items)  # the trainer's split (recipe seed 0)
    evals = items[: max(1, int(len(items) * held_out))]
    t = Target.load(target, "float32")
    sps = SpSDrafter(SpSOptions())
    sps.setup(t)
    model = load_preverifier(pacer, t, sps.model, torch.float32).eval()
    steps = []
    with torch.no_grad():
        for item in evals:
            b = collate([item])
            mask = torch.zeros(b.mask.shape).masked_fill_(~b.mask, torch.finfo(torch.float32).min)
            p = torch.sigmoid(model(b.hidden.float(), b.draft_pos, b.position_ids, attention_mask=mask)[0].float())
            row = item["prefix_rows"]
            for (_, m), a in zip(item["steps"], item["accepted"]):
                steps.append((p[row: row + m].tolist(), a, m))
                row += m
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pacer", default="drafters/smollm2-135m/pacer")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--held-out", type=float, default=0.03)
    parser.add_argument("--block", type=int, default=4)
    args = parser.parse_args()
    b = args.block
    steps = [s for s in held_out_steps(args.pacer, args.target, args.held_out) if s[2] >= 2 * b]
    means = [sum(p[:b]) / b for p, _, _ in steps]
    print(f"{len(steps)} held-out steps with {2 * b} drafts; first-block mean predicted acceptance: median "
          f"{statistics.median(means):.3f}, 95th percentile {statistics.quantiles(means, n=20)[-1]:.3f}, "
          f"max {max(means):.3f}")
    print("| t | gamma histogram | accepted drafts per step |\n|---|---|---|")
    for t in (0.7, 0.5, 0.3, 0.2, 0.15, 0.1):
        gammas = [2 * b if m > t else b for m in means]
        kept = [min(a, g) for (_, a, _), g in zip(steps, gammas)]
        print(f"| {t} | {dict(sorted(Counter(gammas).items()))} | {sum(kept) / len(kept):.3f} |")
    for g in range(2, 2 * b + 1, 2):
        print(f"| fixed gamma {g} | | {sum(min(a, g) for _, a, _ in steps) / len(steps):.3f} |")


if __name__ == "__main__":
    main()
