"""T = 1 on the real target, with power: every method's acceptance walk replayed on its real trees.

For each method (its shipped drafter), generate a few real prompts at temperature 1 with the default
target in float32; at every verify step replay the engine's walk on the captured tree and rows
``--replays`` times (specbench/engine/replay_check.py), plus the same replay with a 0.5% TV bias
injected at every row, which must be caught. Writes a Markdown table: per method the rule its trees
got, trees, replays, the chi-square p-value, the mean TV per committed token with its 99% bound, the
control's verdict, the q check and the largest TV between a captured row and a plain forward's.

Usage: python bench/replay_t1.py [--methods sps,specblock] [--prompts 3] [--max-new-tokens 24]
       [--replays 500000] [--seed 0] [--seeds 1] [--out reports/t1_replay_table.md]
(a rerun with the same settings and --methods replaces those rows and keeps the others)
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from specbench.engine import VANILLA
from specbench.engine.loop import GenerationConfig
from specbench.engine.prompts import render_chat
from specbench.engine.registry import available_methods, create_drafter
from specbench.engine.replay_check import CONTROL_TV, ReplaySummary, replay_check
from specbench.engine.target import DEFAULT_TARGET, Target
from specbench.engine.verify import SamplingParams
from specbench.errors import SpecbenchError

warnings.filterwarnings("ignore")
STORY_PROMPT = "Tell me a short story about a cat."  # the prompt of the first SpecBlock chi-square readings
BENCHES = ("mt_bench", "humaneval", "math500")  # one prompt each after the story


def prompts(target: Target, count: int) -> list[tuple[str, list[int]]]:
    texts = [("story", STORY_PROMPT)]
    from specbench.data.benchmarks import load_benchmark

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
    control = f"p {s.control.p_value:.1e} ({pct(s.injected_tv)} injected)" + (" caught" if s.control.detected else
                                                                               " MISSED")
    left = f"{s.left / max(s.trees * s.replays, 1):.2%}" if s.sampled_nodes else "-"
    return (f"| {s.method} | {rules} | {s.trees} | {s.nodes / max(s.trees, 1):.1f} | {s.clean.visits:,} | "
            f"{s.clean.p_value:.3f} | {pct(s.clean.tv)} | **{pct(s.clean.tv_bound)}** | {control} | {left} | {q} | "
            f"{s.row_tv_max:.1e} | {'yes' if s.passed else 'NO'} |")


HEADER = """# T = 1 replay on real trees

Target {target} (float32), temperature 1, prompts: {names}; {seeds} generation(s) of {tokens} new tokens each
(generation i seeded {seed} + i);
{replays:,} replayed walks per captured tree, and as many again with a {control} TV bias injected at every row
(the negative control). Command: `{command}` (`--methods a,b` reruns some rows of this file).

Per row a tree's walk reaches, the token committed there is compared with that row's target law, on cells
fixed by the law and the tree (the drafted tokens, the 32 likeliest, 8 tail bins of equal mass;
specbench/engine/replay_stats.py). *tokens counted*: committed tokens at rows visited often enough to test.
*chi2 p*: Pearson over all rows. *bound*: 99% upper bound on the mean, over committed tokens, of the TV
between the token's law at its row and that row's target law (from the chi-square noncentrality; *TV* is its
point estimate). *control*: chi2 p of the replay with the bias injected, which must be caught (p < 1e-3),
and the mean TV it injected per committed token. *left*: replayed walks of sampled trees that accepted a
redrawn token other than the captured one (counted at that row, not deeper). *q*: sampled nodes whose
draw, repeated from their q on the generator state propose started from, gives back their token;
deterministic trees whose propose drew random numbers. *rows*: largest TV between a captured verify row
and the same row from a plain causal forward of the target.

| method | rule (trees) | trees | nodes/tree | tokens counted | chi2 p | TV | bound | control 0.5% | left | q | rows | pass |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""
SETTINGS = "<!-- settings: {} -->"


def write_table(path: Path, rows: dict[str, str], settings: dict, prompt_names: list[str]) -> None:
    """The table at ``path``, keeping the rows of methods not rerun when the file has the same settings."""
    marker = SETTINGS.format(json.dumps(settings, sort_keys=True))
    if path.is_file() and marker in path.read_text():
        for line in path.read_text().splitlines():
            name = line.split("|")[1].strip() if line.startswith("| ") else ""
            if name in available_methods() and name not in rows:
                rows[name] = line
    order = [VANILLA] + [m for m in available_methods() if m != VANILLA]
    command = (f"python bench/replay_t1.py --prompts {settings['prompts']} --seeds {settings.get('seeds', 1)} "
               f"--max-new-tokens {settings['tokens']} --replays {settings['replays']} --seed {settings['seed']} "
               f"--out {path}")
    text = HEADER.format(target=DEFAULT_TARGET, names=", ".join(prompt_names), command=command,
                         control=pct(CONTROL_TV), **{"seeds": 1, **settings})
    text += "\n".join(rows[m] for m in sorted(rows, key=order.index)) + "\n\n" + marker + "\n"
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="", help="comma-separated; default every registered method")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--replays", type=int, default=500_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1, help="generations per prompt, each with its own seed")
    ap.add_argument("--out", default="reports/t1_replay_table.md")
    args = ap.parse_args()

    target = Target.load(DEFAULT_TARGET, "float32")
    named = prompts(target, args.prompts)
    methods = [m for m in args.methods.split(",") if m] or list(available_methods())
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=1.0),
                              seed=args.seed)
    settings = {"prompts": args.prompts, "tokens": args.max_new_tokens, "replays": args.replays, "seed": args.seed}
    if args.seeds != 1:
        settings["seeds"] = args.seeds
    rows: dict[str, str] = {}
    for name in methods:
        try:
            drafter = create_drafter(name)
            drafter.setup(target)
        except SpecbenchError as exc:
            print(f"{name}: skipped ({exc})", file=sys.stderr)
            continue
        runs = [ids for _, ids in named for _ in range(args.seeds)]  # generation i is seeded seed + i
        s = replay_check(target, drafter, runs, config, args.replays, args.seed, method=name)
        rows[name] = row(s)
        print(rows[name], f"{s.seconds:.0f}s", flush=True)
        write_table(Path(args.out), dict(rows), settings, [n for n, _ in named])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
