"""The recipes behind the shipped drafters: one `specbench train` command per drafter, run one after
another, each resumable from its checkpoint (`trainer_state.pt`, every 50 steps).

    python bench/train_drafters.py --list                  # the plan, one command per line
    python bench/train_drafters.py                         # train what is not finished (resumes)
    python bench/train_drafters.py --only eagle3 --only specblock
    python bench/train_drafters.py --install               # copy finished drafters into drafters/<target>/

All drafters train on the target's answers to the same 8,100 ShareGPT prompts (the regenerated
answers ship in specbench/training/responses/), 3% held out; a recipe may set its own data options (PACER replays
speculative decoding over the first 600 answers only). The order matters once: PACER's pre-verifier is
trained on the SpS student trained before it.

Raising a recipe's --epochs continues its finished run from the checkpoint instead of starting over: the
longer run's cosine schedule takes over at that step (the learning rate jumps back up; the drafter's
config records the step as `schedule_extended_at_step`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

TARGET = "smollm2-135m"
ROOT = Path(__file__).resolve().parent.parent
DATA = ["--limit", "8100", "--max-new-tokens", "256", "--held-out", "0.03"]
# Feature-based trainers: 384-token sequences; bf16: the frozen target's taps come from a bf16 forward and
# the drafter trains under autocast (fp32 weights). (PACER packs replayed steps and replays in fp32.)
FAST = ["--epochs", "1", "--dtype", "bfloat16", "--max-length", "384"]
FAST_2_EPOCHS = ["--epochs", "2", *FAST[2:]]  # the same, two epochs
# SpecBlock keeps the paper's 2 target-shaped layers; a 1,024-token head keeps it under 20 MiB.
SPECBLOCK_HEAD = ["--draft-vocab", "1024", "--rank-hidden", "128"]
SPECBLOCK = ["specblock", *FAST_2_EPOCHS, *SPECBLOCK_HEAD]
# SpecBlock's ablation table: four drafters (three ablated, one full) trained alike, 400 steps (0.44 epoch) on
# a cosine schedule of their own. float32, so all four train the same way on whichever CPU each one gets
# (bf16 is native on some CPUs and emulated, several times slower, on others): 7-22 s per step on a 2-core
# AVX2-only CPU, 1.5-2.7 h per drafter with its evaluations, inside one working session there.
ABLATION_STEPS = 400
SPECBLOCK_ABLATION = ["specblock", "--epochs", "1", "--dtype", "float32", "--max-length", "384",
                      "--max-steps", str(ABLATION_STEPS), *SPECBLOCK_HEAD]
# EAGLE-3 and SpecBlock trained one epoch, still improving, then a second: a one-epoch cosine run extended
# to a two-epoch one (the learning rate jumps back up at step 914).
EXTENDED = ("eagle3", "specblock")
# SpecBlock's ablation table compares drafters trained alike: the three ablated drafters and
# `specblock-400-steps`, the full drafter on the same schedule, shipped as the table's base. All four start from
# the identity W_shift (those with a shift); the two-epoch `specblock` predates it and started from a random one.
# The first of them trained in a session fills the feature cache; later ones read the target's taps from it.
ABLATION_BASE = f"specblock-{ABLATION_STEPS}-steps"


def recipes(runs: Path) -> dict[str, list[str]]:
    """drafter name (its folder under drafters/<target>/) -> `specbench train` arguments, in run order."""
    # PACER replays greedy SD of the student over each answer, drafting `--window` tokens from every step
    # (0.6 s per answer at window 8 on one CPU thread): 600 answers (75k replayed steps) and window 8 instead
    # of the paper's 50 (the student's drafts past 8 are almost never accepted; later positions reuse e_8).
    PACER = ["pacer", "--draft", str(runs / "sps" / "drafter"), "--epochs", "2", "--window", "8", "--limit", "600"]
    return {
        "eagle3": ["eagle3", *FAST_2_EPOCHS, "--draft-vocab", "4096"],
        "specblock": SPECBLOCK,
        # Two layers (the default three are 22 MiB in bf16, over the 20 MiB a shipped drafter may take);
        # two epochs: a block drafter predicts 15 positions from one anchor and learns slower than EAGLE-3.
        # Its held-out pass scores every anchor of every answer (~4.5 min here): every 200 steps, not 100.
        "dflash": ["dflash", *FAST_2_EPOCHS, "--layers", "2", "--eval-every", "200"],
        "sps": ["sps-student", *FAST],
        "medusa": ["medusa", *FAST],
        "pacer": PACER,
        "pacer-no-pos": [*PACER, "--no-position-embedding"],
        ABLATION_BASE: SPECBLOCK_ABLATION,
        "specblock-no-broadcast": [*SPECBLOCK_ABLATION, "--variant", "no-broadcast"],
        "specblock-no-shift": [*SPECBLOCK_ABLATION, "--variant", "no-shift"],
        "specblock-no-valid-prefix": [*SPECBLOCK_ABLATION, "--variant", "no-valid-prefix"],
    }


def data_options(argv: list[str]) -> list[str]:
    """The shared DATA options a recipe does not set itself."""
    return [arg for flag, value in zip(DATA[::2], DATA[1::2]) if flag not in argv for arg in (flag, value)]


def command(runs: Path, name: str, argv: list[str]) -> list[str]:
    return ["train", *argv, "--target", TARGET, *data_options(argv), "--out", str(runs / name)]


def stages(name: str, argv: list[str]) -> list[list[str]]:
    """The recipe as it runs: an EXTENDED drafter first trains one epoch, then continues to its --epochs."""
    epochs = epochs_of(argv)
    if name not in EXTENDED or not epochs or epochs == 1:
        return [argv]
    at = argv.index("--epochs") + 1
    return [argv[:at] + [str(e)] + argv[at + 1:] for e in range(1, epochs + 1)]


def epochs_of(argv: list[str]) -> int | None:
    return int(argv[argv.index("--epochs") + 1]) if "--epochs" in argv else None


def finished(runs: Path, name: str, epochs: int | None = None) -> bool:
    """The run wrote its drafter (the learning curve comes last), trained for at least ``epochs``."""
    folder = runs / name / "drafter"
    if not (folder / "learning_curve.csv").is_file():
        return False
    if epochs is None:
        return True
    try:
        trained = json.loads((folder / "config.json").read_text())["recipe"]["epochs"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return trained >= epochs


def install(runs: Path, name: str) -> Path:
    """Replace drafters/<target>/<name> with the finished run's drafter folder."""
    dest = ROOT / "drafters" / TARGET / name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(runs / name / "drafter", dest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "drafters",
                        help="folder of the training runs (one subfolder per drafter: log, checkpoint, drafter)")
    parser.add_argument("--only", action="append", help="train only these drafters")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument("--install", action="store_true", help="copy the finished drafters into drafters/ and exit")
    args = parser.parse_args()
    runs = args.runs.resolve()
    plan = recipes(runs)
    unknown = sorted(set(args.only or []) - set(plan))
    if unknown:
        sys.exit(f"train_drafters: unknown drafter {unknown[0]!r}; choose from {', '.join(plan)}")
    for name, argv in plan.items():
        if args.only and name not in args.only:
            continue
        if args.list:
            for stage in stages(name, argv):
                print(shlex.join(["specbench", *command(runs, name, stage)]))
        elif args.install:
            print(f"{name}: {install(runs, name)}" if finished(runs, name, epochs_of(argv))
                  else f"{name}: not finished, skipped")
        elif finished(runs, name, epochs_of(argv)):
            print(f"{name}: finished, skipped")
        else:
            for stage in stages(name, argv):
                if finished(runs, name, epochs_of(stage)):
                    continue
                full = command(runs, name, stage)
                print(f"[{time.strftime('%H:%M:%S')}] {shlex.join(['specbench', *full])}", flush=True)
                code = subprocess.call([sys.executable, "-m", "specbench.cli", *full])
                if code:
                    sys.exit(f"train_drafters: {name} stopped with exit code {code}; rerun to resume it")


if __name__ == "__main__":
    main()
