"""T = 1 on the real target, with power: every method's acceptance walk replayed on its real trees.

For each method (its shipped drafter), generate a few real prompts at temperature 1 with the default
target in float32; at every verify step replay the engine's walk on the captured tree and rows
``--replays`` times (specbench/engine/replay_check.py), plus the same replay with a 0.5% TV bias
injected at every row, which must be caught. Writes a Markdown table: per method the rule its trees
got, trees, replays, the chi-square p-value, the mean TV per committed token with its 99% bound, the
control's verdict, the q check and the largest TV between a captured row and a plain forward's.

Usage: python bench/replay_t1.py [--methods sps,specblock] [--prompts 3] [--max-new-tokens 32]
       [--replays 1000000] [--out reports/t1_replay_table.md]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from specbench.engine.loop import GenerationConfig
from specbench.engine.prompts import render_chat
from specbench.engine.registry import available_methods, create_drafter
from specbench.engine.replay_check import CONTROL_TV, ReplaySummary, replay_check
from specbench.engine.target import DEFAULT_TARGET, Target
from specbench.engine.verify import SamplingParams
from specbench.errors import SpecbenchError

warnings.filterwarnings("ignore")
ISSUE_PROMPT = "Tell me a short story about a cat."  # the prompt of the first SpecBlock chi-square readings
BENCHES = ("mt_bench", "humaneval", "math500")  # one prompt each after the issue's


def prompts(target: Target, count: int) -> list[tuple[str, list[int]]]:
    texts = [("story", ISSUE_PROMPT)]
    from specbench.run.benchmarks import load_benchmark

    for bench in BENCHES[: max(count - 1, 0)]:
        try:
            texts.append((bench, load_benchmark(bench, limit=1)[0].turns[0]))
        except SpecbenchError as exc:
            print(f"note: {bench} skipped ({exc})", file=sys.stderr)
    return [(name, render_chat(target.tokenizer, [{"role": "user", "content": text}], chat=target.chat))
            for name, text in texts[:count]]


def pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def row(s: ReplaySummary) -> str:
    rules = ", ".join(f"{k} {v}" for k, v in sorted(s.rules.items()))
    q = (f"{s.redrawn_nodes}/{s.sampled_nodes} redrawn" if s.sampled_nodes else
         f"deterministic, {s.deterministic_draws} drew")
    if s.draft_checks_failed:
        q += f", {s.draft_checks_failed} trees FAIL"
    control = f"p {s.control.p_value:.1e}, TV {pct(s.control.tv)}" + (" caught" if s.control.detected else " MISSED")
    left = f"{s.left / max(s.trees * s.replays, 1):.2%}" if s.sampled_nodes else "-"
    return (f"| {s.method} | {rules} | {s.trees} | {s.nodes / max(s.trees, 1):.1f} | {s.replays:,} | "
            f"{s.clean.visits:,} | {s.clean.p_value:.3f} | {pct(s.clean.tv)} | **{pct(s.clean.tv_bound)}** | {control} | {left} | {q} | {s.row_tv_max:.1e} | "
            f"{'yes' if s.passed else 'NO'} |")


def table(summaries: list[ReplaySummary], args, prompt_names: list[str]) -> str:
    head = [
        "# T = 1 replay on real trees",
        "",
        f"Target {DEFAULT_TARGET} (float32), temperature 1, prompts: {', '.join(prompt_names)}; "
        f"{args.max_new_tokens} new tokens each, seeds {args.seed}.., {args.replays:,} replayed walks per captured "
        f"tree (clean) and as many with a {pct(CONTROL_TV)} TV bias injected at every row (control). "
        "Command: `python bench/replay_t1.py " + " ".join(sys.argv[1:]) + "`.",
        "",
        "Per row a tree's walk reaches, the committed token is compared with that row's target law "
        "(cells: drafted tokens, the 32 likeliest, 8 tail bins of equal mass; specbench/engine/replay_stats.py). "
        "*chi2 p*: Pearson over all rows; *bound*: 99% upper bound on the mean, over committed tokens, of the "
        "TV between the token's law at its row and the row's target law (from the chi-square noncentrality; "
        "*TV* is its point estimate). *control*: the same replay with the bias injected (must be caught, "
        "p < 1e-3). *left*: sampled trees' replayed walks that accepted a redrawn token "
        "outside the captured rows (counted there, not deeper). *q*: sampled nodes whose draw, repeated "
        "from their q on the generator state propose started from, gives back their token; deterministic "
        "trees whose propose drew random numbers. *rows*: largest TV between a captured verify row and "
        "the same row from a plain causal forward.",
        "",
        "| method | rule (trees) | trees | nodes/tree | replays/tree | tokens counted | chi2 p | TV | "
        "bound | control 0.5% | left | q | rows | pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + [row(s) for s in summaries]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="", help="comma-separated; default every registered method")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--replays", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    target = Target.load(DEFAULT_TARGET, "float32")
    named = prompts(target, args.prompts)
    methods = [m for m in args.methods.split(",") if m] or list(available_methods())
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=1.0),
                              seed=args.seed)
    summaries = []
    for name in methods:
        drafter = create_drafter(name)
        try:
            drafter.setup(target)
        except SpecbenchError as exc:
            print(f"{name}: skipped ({exc})", file=sys.stderr)
            continue
        s = replay_check(target, drafter, [ids for _, ids in named], config, args.replays, args.seed, method=name)
        summaries.append(s)
        print(row(s), f"{s.seconds:.0f}s", flush=True)
    text = table(summaries, args, [n for n, _ in named])
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
