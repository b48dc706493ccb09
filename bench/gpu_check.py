"""`make gpu-check`, second half: a short `specbench run` per method on the default target with the
shipped drafters (drafters/smollm2-135m/*), records under results/gpu/, then one summary table. With
--batch (`make gpu-batch`): the reference set's bf16 batch group instead (B = 1-16, both benches,
results/gpu/batch-bf16_*), whose batch table `specbench report` prints.

Tree sizes are the README's CPU-sized options, so the numbers compare with the committed CPU runs.
Every method's drafter is shipped (the SpecBlock ablations' are the 400-step ones); a missing one fails
its run with specbench's one-line error, which the summary lists.

Usage: python bench/gpu_check.py [--device cuda] [--limit 5] [--max-new-tokens 64] [--methods sps,eagle3] [--batch]
"""

from __future__ import annotations

import argparse
import glob
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from methods.specblock.drafter import SpecBlockDrafter  # noqa: E402
from specbench.engine.registry import available_methods, method_class  # noqa: E402

CPU_SIZED = {  # README: trees sized for a CPU
    "eagle3": ["total_tokens=16", "depth=4", "top_k=4"],
    "medusa": ["max_nodes=15"],
    "ddtree": ["budget=16"],
}
SPECBLOCK_CPU = ["budget=16", "beam_width=4"]  # every SpecBlock variant's tree


def cpu_sized(method: str) -> list[str]:
    """The CPU-sized tree options of a method; every registered SpecBlock variant (found through the
    registry, so a new variant needs no entry here) shares SPECBLOCK_CPU."""
    if method in CPU_SIZED:
        return CPU_SIZED[method]
    registered = method in available_methods()  # an unknown name fails in its own `specbench run`
    return SPECBLOCK_CPU if registered and issubclass(method_class(method), SpecBlockDrafter) else []


def batch_sweeps(device: str, out_dir: Path) -> list[tuple[Path, list[str]]]:
    """The reference set's bf16 batch runs (its sides, sizes, prompts and tokens), on ``device``, into ``out_dir``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reference_set", REPO / "bench" / "reference_set.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    group = reference.BATCH_GROUP + reference.BF16_SUFFIX
    runs = []
    for out, argv in reference.plan(limit=reference.BATCH_LIMIT, repeats=1, stream_limit=1, passes=1):
        if Path(out).name.startswith(group + "_"):
            moved, argv = reference.relocated(out, argv, out_dir, "--device", device)
            runs.append((Path(moved), reference.resuming(moved, argv)))
    return runs


def run_batch_sweeps(device: str, out_dir: Path) -> None:
    """Each sweep resumes where a stopped one ended; the first failure ends the check with its error."""
    for out, argv in batch_sweeps(device, out_dir):
        start = time.time()
        run = subprocess.run([sys.executable, "-c", "from specbench.cli import main; main()", *argv])
        print(f"{out.name}: {'ok' if run.returncode == 0 else 'FAIL'} in {time.time() - start:.0f}s", flush=True)
        if run.returncode:
            sys.exit(run.returncode)
    print(f"batch table: specbench report '{out_dir}/batch-bf16_*.jsonl' --out-dir {out_dir}/reports")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bench", default="humaneval")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--methods", default="", help="comma-separated (default: every registered method)")
    ap.add_argument("--out-dir", default="results/gpu")
    ap.add_argument("--batch", action="store_true", help="run the reference set's bf16 batch sweeps instead")
    args = ap.parse_args()
    if args.batch:
        run_batch_sweeps(args.device, Path(args.out_dir))
        return

    methods = [m for m in (args.methods.split(",") if args.methods else available_methods()) if m and m != "vanilla"]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done, failed = [], []
    for method in methods:
        out = out_dir / f"{method}_{args.bench}_smollm2-135m_T0.jsonl"
        cmd = [sys.executable, "-c", "from specbench.cli import main; main()", "run", "--method", method,
               "--bench", args.bench, "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
               "--device", args.device, "--out", str(out), "--overwrite"]
        for opt in cpu_sized(method):
            cmd += ["--opt", opt]
        start = time.time()
        run = subprocess.run(cmd, capture_output=True, text=True)
        took = time.time() - start
        if run.returncode == 0:
            done.append(out)
            print(f"{method:28s} ok   {took:6.1f}s -> {out}", flush=True)
        else:
            failed.append(method)
            tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
            print(f"{method:28s} FAIL {took:6.1f}s: {' | '.join(tail)}", flush=True)

    if done:
        from rich.console import Console

        from specbench.analysis.report import load_results
        from specbench.run.runner import summary_table

        # Every file has its own interleaved vanilla turns; pooled, they are one baseline per prompt set.
        records, _ = load_results([str(p) for p in done])
        Console(width=160).print(summary_table(records, 0.0))
    print(f"{len(done)} ran, {len(failed)} failed {failed or ''}")
    print("records:", " ".join(sorted(glob.glob(str(out_dir / "*.jsonl")))))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
