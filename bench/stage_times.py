"""Where each side's decode time goes, per verify iteration, pooled over result files: drafting
(and the drafter's own forwards: calls and ms per call), tree building, the engine's compile (tree ->
verify inputs), verify, commit; and α_k.
Explains T_D% differences between methods (e.g. SpecBlock's few wide forwards vs EAGLE-3's many
narrow ones).

    python bench/stage_times.py results/specblock_*_smollm2-135m_T0.jsonl --methods specblock@budget=16,eagle3@budget=16
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from specbench import metrics
from stream_quarters import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--methods", default="", help="comma-separated side labels (default: every non-vanilla side)")
    args = parser.parse_args()
    wanted = set(filter(None, args.methods.split(",")))
    by_method = defaultdict(list)
    for path in args.files:
        for r in load(path):
            if r.method != "vanilla" and (not wanted or r.method in wanted):
                by_method[r.method].append(r)
    print("| method | iterations | draft ms | drafter forwards (calls × ms) | tree ms | compile ms | verify ms | commit ms "
          "| α_1.. |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, recs in sorted(by_method.items()):
        iters = sum(r.n_verify for r in recs)
        ms = {k: 1000 * sum(r.times.get(k, 0.0) for r in recs) / iters
              for k in ("draft", "tree_build", "compile", "verify", "commit")}
        calls = sum(r.forwards.get("drafter", 0) for r in recs)
        fwd_ms = 1000 * sum(r.forward_times.get("drafter", 0.0) for r in recs) / max(calls, 1)
        alphas = " ".join(f"{a:.2f}" for a in metrics.acceptance_rates(recs))
        print(f"| {method} | {iters} | {ms['draft']:.1f} | {calls / iters:.2f} × {fwd_ms:.1f} | {ms['tree_build']:.1f} | "
              f"{ms['compile']:.1f} | {ms['verify']:.1f} | {ms['commit']:.1f} | {alphas} |")


if __name__ == "__main__":
    main()
