"""Run by tests/test_distributed_train.py under torchrun (2 processes) and in-process (1): a
distilled SpS student on a tiny target, trained with the shared Trainer, then resumed for more
steps; every rank saves its trainable parameters."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from methods.sps.student import build_student, distillation_loss  # noqa: E402
from specbench.data import distributed  # noqa: E402
from specbench.training.features import iterate_batches  # noqa: E402
from specbench.training.trainer import Recipe, Trainer  # noqa: E402
from test_training import examples  # noqa: E402
from tiny import tiny_target  # noqa: E402

EXAMPLES, BATCH = 9, 4  # global batches of 4, 4 and 1 rows: rank 1 gets a filler (weight 0) for the last


def train(out: Path) -> None:
    torch.set_num_threads(1)
    world = distributed.init("cpu")
    target = tiny_target(0, layers=4)
    data = examples(target, EXAMPLES)
    student = build_student(target, [0, 3])
    if world.rank == 1:  # rank 0's weights must win, whatever the others were built with
        with torch.no_grad():
            for p in student.parameters():
                if p.requires_grad:
                    p.add_(0.1)

    def batches(epoch):
        return iterate_batches(target, data, [-1], BATCH, 64, seed=epoch, world=world)

    def evals():
        return iterate_batches(target, data[:3], [-1], BATCH, 64, shuffle=False)

    for epochs in (2, 3):  # the second trainer resumes from the first one's checkpoint
        recipe = Recipe(lr=3e-3, epochs=epochs, batch_size=BATCH, max_length=64, eval_every=2, save_every=2)
        trainer = Trainer(student, lambda b: distillation_loss(student, b), recipe, out, save=lambda f: None)
        trainer.fit(batches, steps_per_epoch=(EXAMPLES + BATCH - 1) // BATCH, eval_batches=evals)
    params = {k: v.detach().clone() for k, v in student.named_parameters() if v.requires_grad}
    torch.save({"step": trainer.step, "params": params}, out / f"params-rank{world.rank}.pt")
    distributed.shutdown()


if __name__ == "__main__":
    train(Path(sys.argv[1]))
