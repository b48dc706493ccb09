"""Summarise PACER-related result files: per bench and method, tok/s, speedup, tau, forwards."""
import glob, json, sys
from collections import defaultdict
sys.path.insert(0, ".")
from specbench import metrics
from specbench.records import GenerationRecord

rows = defaultdict(list)
for path in sorted(glob.glob("results/pacer*_T0.jsonl")):
    run = path.split("/")[-1].split("_")[0]
    for line in open(path):
        d = json.loads(line)
        if d.get("type") != "record":
            continue
        r = GenerationRecord.from_dict(d)
        rows[(r.bench, run, r.method)].append(r)
benches = sorted({b for b, _, _ in rows})
print("| bench | run | method | turns | tok/s | speedup | τ | draft fwd | target fwd | preverify fwd | mean γ |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for b in benches:
    for (bb, run, m), recs in sorted(rows.items()):
        if bb != b or m == "vanilla":
            continue
        base = rows[(b, run, "vanilla")]
        f = lambda k: sum(r.forwards.get(k, 0) for r in recs)
        g = [r.extra.get("mean_gamma") for r in recs if r.extra.get("mean_gamma") is not None]
        mg = f"{sum(sum(r.tree_sizes) for r in recs) / max(sum(r.n_verify for r in recs), 1):.2f}"
        print(f"| {b} | {run} | {m} | {len(recs)} | {metrics.tokens_per_second(recs):.2f} | {metrics.speedup(recs, base):.2f}× | "
              f"{metrics.tau(recs):.2f} | {f('drafter')} | {f('target')} | {f('preverify')} | {mg} |")
    base = [r for (bb, run, m), rs in rows.items() if bb == b and m == "vanilla" for r in rs]
    print(f"| {b} | all | vanilla | {len(base)} | {metrics.tokens_per_second(base):.2f} | 1.00× | 1.00 | 0 | {sum(r.forwards.get('target',0) for r in base)} | 0 | 0 |")
