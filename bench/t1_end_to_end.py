"""T = 1 end to end on the real target: every method's own committed tokens against the target's exact law.

For each registered method (its shipped drafter), ``loop.generate`` draws N continuations of ``--tokens``
tokens of one fixed prompt at temperature 1 on the default target in float32 (seeds 0 .. N - 1), and
the draws are compared with the target's law after each observed prefix, from plain causal forwards
(specbench/engine/sampling_check.py: chi-square per position summed over prefixes, the joint law of the first
two tokens, and the mean TV the test detects with 90% power). Adaptive drafters (those that learn while
serving, and PACER's growth) are warmed up on a few longer generations first and keep adapting while
sampled; their trees are compared with a fresh drafter's (PACER: the same one without growth) on the first
seeds. Then each wrong walk of specbench/engine/walk_controls.py runs through a method whose rule reaches
it and must be caught. Writes a Markdown table and a CSV beside it, after every run.

N per run: ``--draws``, cut to what ``--run-minutes`` allows at the time of one draw (measured on three draws
first), at least 50. A run with too few draws for any cell (0 degrees of freedom) is "no test", never a pass.
The table accumulates across invocations: rows of runs not made this time are kept from the CSV beside
``--out``, and each row names the CPU and the commit that made it, so the methods can be split over
sessions (``--methods a,b``, ``--no-methods`` for the controls alone).

Usage: python bench/t1_end_to_end.py [--methods sps,eagle3 | --no-methods] [--draws 1500] [--run-minutes 10]
       [--tokens 3] [--no-controls] [--controls unnormalised-residual]
       [--control-sps draft=truncated:30@draft_temperature=0.5] [--out reports/t1_end_to_end_table.md]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

from specbench.data.results import environment_metadata
from specbench.engine import DEFAULT_TARGET, VANILLA
from specbench.engine.drafter import Drafter
from specbench.engine.registry import available_methods, create_drafter
from specbench.engine.sampling_check import ALPHA, ExactLaw, changed_trees, draw_sequences, judge_draws
from specbench.engine.target import Target
from specbench.engine.verify import SamplingParams, TreeRule
from specbench.engine.walk_controls import CONTROLS, REACHED_BY
from specbench.errors import SpecbenchError
from specbench.sides import parse_spec

warnings.filterwarnings("ignore")
PROMPT = "Once upon a time, there was a"  # plain text, no chat template: the first tokens spread over many
T1 = SamplingParams(temperature=1.0)
WARMUP, WARMUP_TOKENS = 6, 32  # generations an adaptive drafter learns from before it is sampled
PROBES = 20  # sampled seeds redrawn with the reference drafter to compare trees
MIN_DRAWS = 50
B = TreeRule.RECURSIVE_REJECTION
# (control, method, rule): each through a method whose rule reaches it; each method's clean run (SpS with the
# controls' options) first, so a control is judged against a walk that passes unpatched.
CONTROL_RUNS = [(None, "sps", None), ("unnormalised-residual", "sps", None), ("reused-uniform", "sps", None),
                (None, "eagle3", B), ("sibling-bias", "eagle3", B), ("unnormalised-residual", "eagle3", B)]
COLUMNS = ["run", "rules", "draws", "mean accepted", "chi2", "dof", "p positions", "p joint", "p", "TV 90% power",
           "TV 99% bound", "adapted", "verdict", "cpu", "git", "tokens", "prompt"]


def adaptive(drafter: Drafter) -> bool:
    return drafter.learns or getattr(drafter.options, "rho", 1.0) > 1.0  # PACER's growth factor


def reference_for(name: str, drafter: Drafter, target: Target) -> Drafter:
    """A fresh drafter of the method; PACER's: the same drafter without growth."""
    if getattr(drafter.options, "rho", 1.0) > 1.0 and not drafter.learns:
        twin = drafter.fork()
        twin.options = dataclasses.replace(drafter.options, rho=1.0)
        return twin
    fresh = create_drafter(name)
    fresh.setup(target)
    return fresh


def row(label: str, result, adapted: str, verdict: str, env: dict, tokens: int, prompt: str) -> list[str]:
    rules = ", ".join(f"{k} {v}" for k, v in sorted(result.rules.items())) or "-"
    o = result.overall
    return [label, rules, str(result.draws), f"{result.mean_accepted:.2f}", f"{o.chi2:.1f}", str(o.dof),
            f"{o.p_value:.3g}", f"{result.joint.p_value:.3g}", f"{result.p_value:.3g}", f"{100 * result.tv90:.1f}%",
            f"{100 * o.tv_bound:.1f}%", adapted, verdict, env["hardware"], short_sha(env["git_sha"]), str(tokens), prompt]


def short_sha(sha: str) -> str:
    return sha[:12] + ("-dirty" if sha.endswith("-dirty") else "")


def verdict_of(result, control: bool) -> str:
    """caught/MISSED for a control, pass/FAIL for a method; "no test" where no cell was expected often enough."""
    if result.overall.dof == 0 and result.joint.dof == 0 and not result.impossible:
        return "no test (too few draws)"
    if control:
        return "caught" if result.detected(ALPHA) else "MISSED"
    return "FAIL" if result.detected(ALPHA) else "pass"


def earlier_rows(out: Path) -> dict[tuple[str, str, str], list[str]]:
    """(kind, run, prompt) -> row of the CSV beside ``out`` written by an earlier invocation (none if its columns
    differ; rows written before the prompt had a column were made with PROMPT)."""
    path = out.with_suffix(".csv")
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        lines = list(csv.reader(f))
    if lines and lines[0] == ["kind"] + COLUMNS[:-1]:
        lines = [lines[0] + ["prompt"]] + [line + [PROMPT] for line in lines[1:]]
    if not lines or lines[0] != ["kind"] + COLUMNS:
        print(f"{path}: columns of another version; its rows are not kept", file=sys.stderr)
        return {}
    return {(line[0], line[1], line[-1]): line[1:] for line in lines[1:] if len(line) == len(COLUMNS) + 1}


HEADER = """# T = 1 end to end: the engine's own committed tokens

Target {target} (float32), temperature 1, a plain-text prompt per row (*prompt*; no chat template; the default
"{prompt}"), the first *tokens* tokens of N generations per run (seeds 0 .. N - 1) through `loop.generate`. Rows accumulate over
invocations of `python bench/t1_end_to_end.py` (each row names the CPU and the commit that made it; the last
invocation: `{command}`, {seconds:.0f} s).

Per run, each observed prefix's next-token counts against the target's law after it (plain causal forwards;
cells: the 32 likeliest tokens, the tail in 8 equal-mass bins, cells expected under 5 times merged), summed
over prefixes and positions (*chi2*, *dof*, *p positions*), and the first two tokens as pairs (*p joint*);
*p*: the two, Bonferroni; verdict at p < {alpha:g} ("no test" where too few draws left any cell). *TV 90%
power*: the mean TV per counted token that this many draws detect with 90% power (noncentral chi-square; TV <=
sqrt(chi-square divergence) / 2); *TV 99% bound*: the 99% upper bound on it from the statistic. *rules*: the
verify steps per rule. *adapted*: for drafters that adapt (learn while serving; PACER's growth), warmed up on
{warmup} generations of {warmup_tokens} tokens and adapting while sampled, the first seeds on which their trees
differ from a fresh drafter's (PACER: the same drafter without growth).

The controls (specbench/engine/walk_controls.py) patch `verify` itself, so the engine commits a wrong walk;
each runs through a method whose rule reaches it and must be caught.

"""


def write(path: Path, header: str, methods: list[list[str]], controls: list[list[str]]) -> None:
    def table(rows: list[list[str]], first: str) -> str:
        lines = ["| " + " | ".join([first] + COLUMNS[1:]) + " |", "|" + "---|" * len(COLUMNS)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
    text = header + "## Methods\n\n" + table(methods, "method")
    text += "\n## Controls\n\n" + table(controls, "control (through)") + "\n"
    text += "".join(f"- *{name}*: {reached}.\n" for name, reached in REACHED_BY.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    with path.with_suffix(".csv").open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["kind"] + COLUMNS)
        out.writerows([["method"] + r for r in methods] + [["control"] + r for r in controls])


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="", help="comma-separated; default every registered method")
    ap.add_argument("--no-methods", action="store_true", help="the controls alone")
    ap.add_argument("--draws", type=int, default=1500, help="most draws per run")
    ap.add_argument("--run-minutes", type=float, default=10.0, help="time budget of each run's draws")
    ap.add_argument("--tokens", type=int, default=3, help="committed tokens per draw (K)")
    ap.add_argument("--no-controls", action="store_true")
    ap.add_argument("--through", default="", help="only the control runs through these methods (comma-separated), "
                    "e.g. sps")
    ap.add_argument("--controls", default="", help="only these controls (comma-separated names of "
                    "specbench/engine/walk_controls.py)")
    ap.add_argument("--prompt", default=PROMPT, help="plain-text prompt (no chat template); each row records its own. "
                    "The controls have power only where drafts are often accepted: a predictable prompt helps")
    ap.add_argument("--control-sps", default="", help="SpS's options for the controls run through SpS, as an --also "
                    "spec's (e.g. draft=truncated:30@draft_temperature=0.5: the target as its own draft at another "
                    "temperature): a draft the target often accepts, and often rejects, gives them power")
    ap.add_argument("--out", default="reports/t1_end_to_end_table.md")
    args = ap.parse_args()
    registered = list(available_methods())
    methods = [] if args.no_methods else [m for m in args.methods.split(",") if m] or registered
    unknown = [m for m in methods if m not in registered]
    if unknown:
        fail(f"unknown method {unknown[0]!r}; `specbench list methods` names them")
    if args.draws < MIN_DRAWS or args.run_minutes <= 0 or not 2 <= args.tokens <= 8:
        fail(f"--draws must be >= {MIN_DRAWS}, --run-minutes > 0 and --tokens in [2, 8]")
    if args.no_methods and args.no_controls:
        fail("--no-methods and --no-controls leave nothing to run")
    only = [c for c in args.controls.split(",") if c]
    if any(c not in CONTROLS for c in only):
        fail(f"unknown control in --controls {args.controls!r}; the controls: {', '.join(CONTROLS)}")
    through = [m for m in args.through.split(",") if m]
    try:
        control_sps = parse_spec("sps" + (f"@{args.control_sps}" if args.control_sps else ""), "--control-sps")
    except SpecbenchError as exc:
        fail(str(exc))
    out = Path(args.out)
    if out.suffix != ".md":
        fail(f"--out {out} must end in .md (the CSV goes beside it)")

    start = time.perf_counter()
    kept = earlier_rows(out)
    target = Target.load(DEFAULT_TARGET, "float32")
    env = environment_metadata(target.device)
    if not args.prompt.strip():
        fail("--prompt is empty")
    prompt = target.tokenizer(args.prompt).input_ids
    law = ExactLaw(target, prompt, T1, max_rows=2048)
    runs = [(None, m, None, False) for m in sorted(methods, key=lambda m: (m != VANILLA, m))]
    chosen = [] if args.no_controls else [(c, n, r) for c, n, r in CONTROL_RUNS if not through or n in through]
    if only:  # the chosen controls, and the clean runs of the methods they go through
        chosen = [(c, n, r) for c, n, r in chosen if c in only or (c is None and any(
            c2 in only and (n2, r2) == (n, r) for c2, n2, r2 in chosen))]
    runs += [(c, n, r, True) for c, n, r in chosen]
    command = "python bench/t1_end_to_end.py " + " ".join(sys.argv[1:])
    for control, name, rule, for_controls in runs:
        options = dict(control_sps.options) if for_controls and name == "sps" else {}
        label = name + "".join(f"@{k}={v}" for k, v in options.items()) + (f" (rule {rule.value})" if rule else "")
        try:
            drafter = create_drafter(name, options)
            drafter.setup(target)
        except SpecbenchError as exc:
            print(f"{label}: skipped ({exc})", file=sys.stderr)
            continue
        adapts = control is None and rule is None and adaptive(drafter)
        if adapts:
            draw_sequences(target, None, prompt, WARMUP_TOKENS, WARMUP, T1, seed=10_000, drafter=drafter)
        probe = draw_sequences(target, None, prompt, args.tokens, 3, T1, seed=900_000, tree_rule=rule,
                               drafter=drafter)
        n = max(MIN_DRAWS, min(args.draws, int(args.run_minutes * 60 / (probe.seconds / 3))))
        print(f"{control or 'clean'} {label}: N = {n} ({probe.seconds / 3:.3f} s a draw)", flush=True)
        with CONTROLS[control]() if control else nullcontext():
            draws = draw_sequences(target, None, prompt, args.tokens, n, T1, tree_rule=rule, method=name,
                                   drafter=drafter)
        result = judge_draws(draws, law)
        adapted = "-"
        if adapts:
            reference = draw_sequences(target, None, prompt, args.tokens, PROBES, T1,
                                       drafter=reference_for(name, drafter, target))
            adapted = f"{changed_trees(draws, reference)}/{PROBES} seeds"
        run_label = f"{control} ({label})" if control else label
        kind = "control" if control else "method"
        kept[kind, run_label, args.prompt] = row(run_label, result, adapted, verdict_of(result, bool(control)), env,
                                                 args.tokens, args.prompt)
        print(" | ".join(kept[kind, run_label, args.prompt]), f"{draws.seconds:.0f}s", flush=True)
        header = HEADER.format(target=DEFAULT_TARGET, prompt=PROMPT,
                               seconds=time.perf_counter() - start, command=command, alpha=ALPHA, warmup=WARMUP,
                               warmup_tokens=WARMUP_TOKENS)
        write(out, header, ordered(kept, "method", registered), ordered(kept, "control", []))
    print(f"wrote {out} and {out.with_suffix('.csv')}")


def ordered(rows: dict[tuple[str, str, str], list[str]], kind: str, names: list[str]) -> list[list[str]]:
    """The rows of ``kind``: vanilla first, then by name (methods) or in the order the controls run; a run's rows
    of several prompts together, in prompt order."""
    order = [f"{c} ({n}{f' (rule {r.value})' if r else ''})" for c, n, r in CONTROL_RUNS if c] if kind == "control" \
        else sorted(names, key=lambda m: (m != VANILLA, m))
    rank = {label: i for i, label in enumerate(order)}
    mine = sorted(((label, prompt), r) for (k, label, prompt), r in rows.items() if k == kind)
    return [r for (label, _), r in sorted(mine, key=lambda item: (rank.get(item[0][0], len(rank)), item[0]))]


if __name__ == "__main__":
    main()
