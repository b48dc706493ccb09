"""The target's forward cost against the number of rows, on this machine: what a verify over N rows costs
next to vanilla's one-row step, measured apart from any run, stored per hardware and target for the report's Ideal.

    python bench/forward_cost.py                                  # smollm2-135m, fp32 and bf16, rows 1-64
    python bench/forward_cost.py --dtype float32 --rows 1-16,24,32,48,64 --repeats 20
    python bench/forward_cost.py --target qwen2.5-coder-1.5b --dtype bfloat16   # a pair's target
    python bench/forward_cost.py --rows 1-2 --repeats 1 --out /tmp/cost   # a smoke run
    python bench/forward_cost.py --batch 1,2,4,8,16 --rows 1-17,24,32    # the curve at each batch size too

Each measurement is one verify forward through the engine's own path (``Target.compile_tree`` +
``Target.verify`` with its forward clock, chains on the causal kernel and random trees with the ancestor
mask) over N rows after a prefix of ``--prefix`` cached tokens (a realistic context: a prompt plus part
of an answer), the cache cut back to the prefix after each; the median of ``--repeats`` forwards (after
``--warmup``), rows in an interleaved order so that drift spreads over all row counts. The file
``<out>/<hardware-slug>--<target>.json`` (hardware as in a results header) keeps one curve per dtype; a
rerun replaces that dtype's curve and keeps the others. Run it on an idle machine, like the reference set.

With ``--batch B1,B2,...`` the curve is also measured with B requests per forward, through the batched
loop's own path (``BatchTarget.compile_batch`` + ``verify``: B prefixes in the ragged cache, one draft of N
rows per request, every request's rows in one forward), stored as the kinds ``chain@B4``/``tree@B4``: the
report's batch tables price a verify at B on it (``CostCurve.at_batch``), vanilla's step being its one-row point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specbench.engine import kvcache
from specbench.analysis.cost_model import CHAIN, TREE, batch_kind, curve_path
from specbench.engine.batch_target import BatchTarget
from specbench.engine.devices import resolve_device
from specbench.errors import SpecbenchError
from specbench.data.results import environment_metadata
from specbench.run.run_config import parse_batch_sizes
from specbench.engine.target import DEFAULT_TARGET, Target, resolve_dtype
from specbench.engine.timing import PhaseTimer
from specbench.engine.tree import DraftTree

ROOT = Path(__file__).resolve().parent.parent


def parse_rows(spec: str) -> list[int]:
    """'1-16,24,32' -> [1..16, 24, 32]; every value in 1..1024."""
    rows: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, _, hi = part.partition("-")
            rows.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SpecbenchError(f"--rows expects numbers and ranges like 1-16,24,32 (got {spec!r})") from None
    if not rows or min(rows) < 1 or max(rows) > 1024:
        raise SpecbenchError(f"--rows must name row counts between 1 and 1024 (got {spec!r})")
    return sorted(rows)


def draft(rows: int, kind: str, vocab: int, gen: torch.Generator) -> DraftTree:
    """rows - 1 drafted nodes (the bonus row makes ``rows``): a chain, or a random tree (each node's parent
    drawn among the earlier ones), so the masked kernel runs as a tree method's verify does."""
    n = rows - 1
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    if kind == CHAIN or n < 2:
        parents = torch.arange(n) - 1
    else:
        parents = torch.tensor([-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, n)])
    return DraftTree(tokens, parents)


def one_forward(target: Target, tree: DraftTree, prefix: int, root: int) -> float:
    """Seconds of one verify forward over the tree's rows after the prefix; the cache is cut back after."""
    timer = PhaseTimer(target.device)
    compiled = target.compile_tree(root, tree)
    target.verify(compiled, timer=timer)
    timer.resolve()
    kvcache.truncate(target.cache, prefix)
    return timer.forward_ns["target"] / 1e9


def one_batched_forward(batch: BatchTarget, roots: list[int], trees: list[DraftTree], prefix: int) -> float:
    """Seconds of one verify forward over every request's tree after its prefix; each row is cut back after."""
    timer = PhaseTimer(batch.target.device)
    packed = batch.compile_batch(roots, trees)
    batch.verify(packed, timer=timer)
    timer.resolve()
    batch.commit(packed, [[0]] * len(trees))
    for b in range(len(trees)):
        batch.cache.truncate(b, prefix)  # one dead column stays behind the prefix, masked like any other
    return timer.forward_ns["target"] / 1e9


def plan_of(rows: list[int]) -> list[tuple[str, int]]:
    return [(kind, r) for kind in (CHAIN, TREE) for r in rows if kind == CHAIN or r > 2]  # 1-2 rows: a chain


def curves_of(times: dict[tuple[str, int], list[float]], rows: list[int], size: int = 1) -> dict[str, dict]:
    """Median seconds per kind (named for the batch size) and row count; a tree of at most one node is a chain."""
    chain, tree = batch_kind(CHAIN, size), batch_kind(TREE, size)
    curves: dict[str, dict] = {chain: {}, tree: {}}
    for (kind, r), values in times.items():
        curves[batch_kind(kind, size)][str(r)] = statistics.median(values)
    for r in rows:
        if r <= 2:
            curves[tree][str(r)] = curves[chain][str(r)]
    return curves


def measure_batch(target: Target, rows: list[int], prefix: int, repeats: int, warmup: int, seed: int,
                  size: int) -> dict[str, dict]:
    """The curve with ``size`` requests per verify forward (each with its own prefix and a draft of N rows)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    batch = BatchTarget(target)
    for _ in range(size):
        batch.join(torch.randint(0, vocab, (prefix,), generator=gen).tolist())
    roots = torch.randint(0, vocab, (size,), generator=gen).tolist()
    plan = plan_of(rows)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in plan}
    for rep in range(warmup + repeats):
        for kind, r in plan if rep % 2 == 0 else plan[::-1]:
            t = one_batched_forward(batch, roots, [draft(r, kind, vocab, gen) for _ in range(size)], prefix)
            if rep >= warmup:
                times[(kind, r)].append(t)
    return curves_of(times, rows, size)


def measure(target: Target, rows: list[int], prefix: int, repeats: int, warmup: int, seed: int) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    ids = torch.randint(0, vocab, (prefix,), generator=gen).tolist()
    target.prefill(ids)
    root = int(torch.randint(0, vocab, (), generator=gen))
    plan = plan_of(rows)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in plan}
    for rep in range(warmup + repeats):
        order = plan if rep % 2 == 0 else plan[::-1]
        for kind, r in order:
            t = one_forward(target, draft(r, kind, vocab, gen), prefix, root)
            if rep >= warmup:
                times[(kind, r)].append(t)
    return curves_of(times, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", action="append", help="float32 / bfloat16 / float16 (repeatable; default fp32 and bf16)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default="1-64", help="row counts, e.g. 1-16,24,32 (default 1-64)")
    parser.add_argument("--prefix", type=int, default=320, help="cached tokens before the measured rows")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", default="1", help="requests per forward, e.g. 1,2,4,8,16 (default 1)")
    parser.add_argument("--out", default=str(ROOT / "results" / "cost"), help="folder of the per-hardware files")
    args = parser.parse_args()
    try:
        rows = parse_rows(args.rows)
        sizes = parse_batch_sizes(args.batch)
        if args.prefix < 1 or args.repeats < 1 or args.warmup < 0:
            raise SpecbenchError("--prefix and --repeats must be >= 1 and --warmup >= 0")
        device = resolve_device(args.device)
        dtypes = [str(resolve_dtype(d)).replace("torch.", "") for d in (args.dtype or ["float32", "bfloat16"])]
        env = environment_metadata(device)
        path = curve_path(args.out, env["hardware"], args.target)
        data = json.loads(path.read_text()) if path.is_file() else {}
        if data and data.get("hardware") != env["hardware"]:
            raise SpecbenchError(f"{path} holds another machine's curve ({data.get('hardware')}); pass another --out")
        if data.get("target") not in (None, args.target) or data.get("prefix") not in (None, args.prefix):
            raise SpecbenchError(f"{path} was measured with target {data.get('target')} and prefix {data.get('prefix')}; "
                                 "pass the same ones or another --out")
        curves = dict(data.get("curves") or {})
        with torch.inference_mode():
            for dtype in dtypes:
                target = Target.load(args.target, dtype, device)
                if args.prefix + max(rows) > target.max_context:
                    raise SpecbenchError(f"--prefix {args.prefix} + {max(rows)} rows exceeds the target's context "
                                         f"({target.max_context})")
                start = time.time()
                curves[dtype] = measure(target, rows, args.prefix, args.repeats, args.warmup, args.seed)
                for size in (s for s in sizes if s > 1):
                    target.reset()
                    curves[dtype].update(measure_batch(target, rows, args.prefix, args.repeats, args.warmup,
                                                       args.seed, size))
                one = curves[dtype][CHAIN]["1"] if "1" in curves[dtype][CHAIN] else float("nan")
                print(f"{dtype}: {len(rows)} row counts x {args.repeats} repeats in {time.time() - start:.0f} s; "
                      f"one row {1e3 * one:.2f} ms", file=sys.stderr)
                del target
    except SpecbenchError as exc:
        print(f"forward_cost: {exc}", file=sys.stderr)
        sys.exit(2)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"hardware": env["hardware"], "target": args.target, "prefix": args.prefix, "device": str(device),
           "threads": env["threads"], "repeats": args.repeats, "git_sha": env["git_sha"], "versions": env["versions"],
           "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "curves": curves}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
