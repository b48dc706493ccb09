"""How PACER's halting threshold t would act on held-out replayed drafts: the shipped pre-verifier scores
every draft of the held-out answers' replayed steps (the trainer's replay cache and split); for each t the
script prints how often the first block (drafts 1..b) passes, i.e. gamma = b vs 2b, and the accepted drafts
per step that choice would keep, beside fixed gamma (the SpS sweep).

    SPECBENCH_DATA=../shared/datasets python bench/pacer_thresholds.py [--pacer drafters/smollm2-135m/pacer]

It replays like `specbench train pacer` (reusing its cache when the data, draft and window match) and
holds out the same answers. Used to pick the tuned t of the reference set's PACER group.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

import torch

from methods.pacer.checkpoint import load_preverifier
from methods.pacer.drafter import keep_drafting
from methods.pacer.objective import acceptance_logits
from methods.pacer.packing import collate
from methods.pacer.trainer import PacerTrainOptions, replay_dataset
from specbench.engine import DEFAULT_TARGET
from specbench.training.fit import held_out_split, training_data


def held_out_steps(pacer: str, options: PacerTrainOptions) -> list[tuple[list[float], int, int]]:
    """(predicted acceptance of each draft, accepted, drafted) for every held-out replayed step: the
    trainer's replay (from its cache when the data, draft and window match) and its held-out split."""
    recipe = json.loads((Path(pacer) / "config.json").read_text())["recipe"]
    options.window = recipe["extra"]["window"]
    t, data_file, examples = training_data(options)
    items, draft_model = replay_dataset(t, examples, data_file, options.draft, options.window)
    _, evals = held_out_split(items, options.held_out, recipe["seed"])
    model = load_preverifier(pacer, t, draft_model, torch.float32).eval()
    steps = []
    with torch.no_grad():
        for item in evals:
            batch = collate([item])
            p = torch.sigmoid(acceptance_logits(model, batch)[0].float())
            row = item["prefix_rows"]
            for (_, m), a in zip(item["steps"], item["accepted"]):
                steps.append((p[row: row + m].tolist(), a, m))
                row += m
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pacer", default="drafters/smollm2-135m/pacer")
    parser.add_argument("--draft", default="", help="the SpS draft it was trained over (empty = the shipped one)")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    # The data of the shipped layer's recipe (bench/train_drafters.py): another choice replays afresh.
    parser.add_argument("--limit", type=int, default=600)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--held-out", type=float, default=0.03)
    parser.add_argument("--block", type=int, default=4)
    args = parser.parse_args()
    b = args.block
    options = PacerTrainOptions(out=Path("unused"), target=args.target, draft=args.draft, limit=args.limit,
                                max_new_tokens=args.max_new_tokens, held_out=args.held_out)
    steps = [s for s in held_out_steps(args.pacer, options) if s[2] >= 2 * b]
    means = [sum(p[:b]) / b for p, _, _ in steps]
    print(f"{len(steps)} held-out steps with {2 * b} drafts; first-block mean predicted acceptance: median "
          f"{statistics.median(means):.3f}, 95th percentile {statistics.quantiles(means, n=20)[-1]:.3f}, "
          f"max {max(means):.3f}")
    print("| t | gamma histogram | accepted drafts per step |\n|---|---|---|")
    for t in (0.7, 0.5, 0.3, 0.2, 0.15, 0.1):
        gammas = [2 * b if keep_drafting(p[:b], t) else b for p, _, _ in steps]
        kept = [min(a, g) for (_, a, _), g in zip(steps, gammas)]
        print(f"| {t} | {dict(sorted(Counter(gammas).items()))} | {sum(kept) / len(kept):.3f} |")
    for g in range(2, 2 * b + 1, 2):
        print(f"| fixed gamma {g} | | {sum(min(a, g) for _, a, _ in steps) / len(steps):.3f} |")


if __name__ == "__main__":
    main()
