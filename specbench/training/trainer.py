"""One trainer for every drafter: AdamW, cosine schedule with warmup, gradient clipping,
bf16 autocast or fp32, checkpoint and resume, a held-out evaluation with per-depth top-1 accuracy
and an acceptance-length proxy, all logged as JSONL.

Data parallel under ``torchrun --nproc-per-node N``: every rank gets its rows of each global
batch (``iterate_batches(..., world=...)``), and after each backward the gradients become the
token-weighted mean over ranks (one all-reduce), so every rank takes the same optimizer step a
single process would take on the whole batch. (Loss functions call the module directly, not its
``forward``, which DistributedDataParallel would need to wrap.) Rank 0 alone evaluates, logs,
checkpoints and saves; all ranks resume from the same ``trainer_state.pt``."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from specbench.data import distributed
from specbench.engine import interrupt
from specbench.errors import SpecbenchError
from specbench.training.batch import TrainBatch
from specbench.training.learning_curve import read_log

LossFn = Callable[[TrainBatch], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class Recipe:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.05
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 4
    max_length: int = 512
    grad_clip: float = 0.5
    dtype: str = "float32"  # or "bfloat16" (autocast)
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0
    extra: dict = field(default_factory=dict)  # method-specific settings, recorded with the checkpoint


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / max(warmup, 1)
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def acceptance_proxy(accuracies: list[float]) -> float:
    """Expected tokens per verify call of a chain whose depth-k acceptance is acc_k (+1 bonus)."""
    total, survive = 1.0, 1.0
    for acc in accuracies:
        survive *= acc
        total += survive
    return total


def evaluate(loss_fn: LossFn, batches: Iterable[TrainBatch]) -> dict[str, float]:
    """Each metric's mean over the held-out batches, weighted by their loss-bearing tokens (``batch_weight``),
    so a short last batch counts for what it holds and one with nothing to score (prompts that fill
    --max-length) counts not at all."""
    sums: dict[str, float] = {}
    total = 0.0
    with torch.no_grad():
        for batch in batches:
            weight = batch_weight(batch)
            if weight <= 0:
                continue
            _, metrics = loss_fn(batch)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + weight * float(v)
            total += weight
    result = {k: v / total for k, v in sums.items()}
    accs = [result[f"acc_{k}"] for k in range(1, 64) if f"acc_{k}" in result]
    if accs:
        result["tau_proxy"] = acceptance_proxy(accs)
    return result


def batch_weight(batch) -> float:
    """How much of the global batch one rank's mean loss stands for: its loss-bearing tokens
    (``loss_mask``), or its labelled rows (``labels >= 0``), else its rows; 0 for a filler."""
    if getattr(batch, "filler", False):
        return 0.0
    mask = getattr(batch, "loss_mask", None)
    if mask is None and getattr(batch, "labels", None) is not None:
        mask = batch.labels >= 0
    return float(mask.sum()) if mask is not None else float(len(batch))


def autocast_for(module: torch.nn.Module, dtype: str) -> torch.autocast:
    """bf16 autocast on the device type the module's parameters live on (CUDA or CPU), or off
    for fp32. Parameters and optimizer state stay fp32 either way."""
    param = next(module.parameters(), None)
    device_type = param.device.type if param is not None else "cpu"
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


class Trainer:
    """``train_batches(epoch)`` yields TrainBatches; ``save(folder)`` writes the drafter."""

    def __init__(self, module: torch.nn.Module, loss_fn: LossFn, recipe: Recipe, out_dir: str | Path,
                 save: Callable[[Path], None]) -> None:
        self.module, self.loss_fn, self.recipe = module, loss_fn, recipe
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.save = save
        self.world = distributed.current()
        params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay)
        self.step = 0
        self.tokens = 0  # loss-bearing training tokens seen so far (the learning curve's x axis)
        self.log_path = self.out_dir / "train_log.jsonl"
        self.state_path = self.out_dir / "trainer_state.pt"
        self._elapsed_before = 0.0  # training seconds of the runs this one resumes (the card's wall time is the sum)
        self._started = time.time()

    def _checkpoint(self) -> None:
        if not self.world.main:
            return
        tmp = self.state_path.with_suffix(".tmp")
        # RNG states too, so the steps after a resume draw what an uninterrupted run would have drawn.
        torch.save({"step": self.step, "tokens": self.tokens, "elapsed_s": self._elapsed(),
                    "module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "recipe": asdict(self.recipe), "rng": self._rng_state()}, tmp)
        tmp.replace(self.state_path)

    def _elapsed(self) -> float:
        return round(self._elapsed_before + time.time() - self._started, 1)

    def _rng_state(self) -> dict:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        own = getattr(self.loss_fn, "generator", None)  # a loss with its own generator (SpecBlock's cuts)
        if isinstance(own, torch.Generator):
            state["loss"] = own.get_state()
        return state

    def _set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        own = getattr(self.loss_fn, "generator", None)
        if "loss" in state and isinstance(own, torch.Generator):
            own.set_state(state["loss"])

    def _resume(self) -> dict | None:
        """Load the last checkpoint; returns its RNG states (restored just before the next step)."""
        if not self.state_path.exists():
            return None
        try:
            state = torch.load(self.state_path, map_location="cpu", weights_only=False)
            self.module.load_state_dict(state["module"])
            self.optimizer.load_state_dict(state["optimizer"])
        except Exception as exc:  # truncated pickle, another model's state dict, ...
            raise SpecbenchError(f"{self.state_path} cannot be resumed from ({type(exc).__name__}); delete it to "
                                 "start over or pass a new --out") from None
        self.step = state["step"]
        self._elapsed_before = state.get("elapsed_s", self._logged_elapsed(self.step))
        before = state.get("recipe") or {}
        extended = list((before.get("extra") or {}).get("schedule_extended_at_step", []))
        if (before.get("epochs"), before.get("max_steps")) != (self.recipe.epochs, self.recipe.max_steps):
            # Trained on past the schedule it started with (e.g. a second epoch): the cosine schedule is now
            # the longer run's, so the learning rate jumps back up at this step. The card records where.
            extended.append(self.step)
        if extended:
            self.recipe.extra["schedule_extended_at_step"] = extended
        # A checkpoint from before tokens were counted: unknown from here on (the learning curve then
        # estimates every point from its step rather than mixing two scales).
        self.tokens = state.get("tokens")
        return state.get("rng")

    def _logged_elapsed(self, step: int) -> float:
        """A checkpoint from before it carried its wall time: the log's last figure up to its step (one run)."""
        if not self.log_path.exists():
            return 0.0
        return max((e["elapsed_s"] for e in read_log(self.log_path) if "elapsed_s" in e and e["step"] <= step),
                   default=0.0)

    def _tokens(self) -> dict:
        return {} if self.tokens is None else {"tokens": self.tokens}

    def _log(self, entry: dict) -> None:
        if not self.world.main:
            return
        with open(self.log_path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")

    def _sync_grads(self, weight: float) -> None:
        """Each gradient becomes sum_r w_r g_r / sum_r w_r over ranks (one all-reduce); a parameter
        no rank produced a gradient for keeps none, as in one process."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        device = params[0].device
        has = [p.grad is not None and weight > 0 for p in params]
        parts = [p.grad.float().flatten() * weight if h else torch.zeros(p.numel(), device=device)
                 for p, h in zip(params, has)]
        parts.append(torch.tensor([float(h) for h in has] + [weight], device=device))
        flat = distributed.all_reduce_sum(torch.cat(parts))
        total, flags = flat[-1], flat[-1 - len(params):-1]
        offset = 0
        for p, flag in zip(params, flags.tolist()):
            n = p.numel()
            p.grad = (flat[offset: offset + n] / total).view_as(p).to(p.dtype) if flag > 0 else None
            offset += n

    def _mean_metrics(self, weight: float, metrics: dict[str, float], loss: float) -> tuple[dict[str, float], float]:
        """Metrics and loss of the global batch: every rank's, weighted like its gradient."""
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        gathered = distributed.all_gather_object((weight, loss, {k: float(v) for k, v in metrics.items()}))
        for w, _, m in gathered:
            for k, v in m.items():
                if w > 0:
                    sums[k] = sums.get(k, 0.0) + w * v
                    weights[k] = weights.get(k, 0.0) + w
        total = sum(w for w, _, _ in gathered)
        mean_loss = sum(w * x for w, x, _ in gathered) / total if total > 0 else loss
        return {k: sums[k] / weights[k] for k in sums}, mean_loss

    def _train_step(self, batch, weight: float, autocast) -> tuple[dict, float]:
        """Forward, backward and the optimizer step on one batch of ``weight`` (``batch_weight``)
        -> (log entry, shown loss)."""
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss, metrics = self.loss_fn(batch)
        loss.backward()
        shown = float(loss.detach())
        # Data parallel: every rank takes its share of one global batch, so ours x ranks.
        if self.tokens is not None:
            self.tokens += round(weight * (self.world.size if self.world.active else 1))
        if self.world.active:  # data parallel: the gradient and metrics of the global batch
            self._sync_grads(weight)
            metrics, shown = self._mean_metrics(weight, metrics, shown)
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad],
                                              self.recipe.grad_clip)
        self.optimizer.step()
        return {"grad_norm": float(norm), **{k: float(v) for k, v in metrics.items()}}, shown

    def fit(self, train_batches: Callable[[int], Iterator[TrainBatch]], steps_per_epoch: int,
            eval_batches: Callable[[], Iterable[TrainBatch]] | None = None) -> dict[str, float]:
        r = self.recipe
        total = r.max_steps or steps_per_epoch * r.epochs
        warmup = int(total * r.warmup_ratio)
        rng = self._resume()
        # Ranks start from rank 0's weights (a drafter built with unseeded init differs per rank).
        distributed.broadcast_tensors([p for p in self.module.parameters() if p.requires_grad]
                                      + list(self.module.buffers()))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: cosine_with_warmup(s, total, warmup), last_epoch=self.step - 1)
        autocast = autocast_for(self.module, r.dtype)
        self._started = time.time()
        columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
                   TimeRemainingColumn())
        with Progress(*columns, disable=not self.world.main) as progress:
            task = progress.add_task("train", total=total, completed=self.step, loss="")
            epoch = self.step // max(steps_per_epoch, 1)
            while self.step < total:
                for i, batch in enumerate(train_batches(epoch)):
                    if epoch * steps_per_epoch + i < self.step:
                        continue  # resumed mid-epoch: skip what was already trained on
                    if self.step >= total:
                        break
                    if rng is not None:
                        self._set_rng_state(rng)
                        rng = None
                    weight = batch_weight(batch)
                    if weight == 0 and not self.world.active:
                        # Nothing to learn from (e.g. prompts that fill --max-length): no update, the schedule
                        # moves on. (Data parallel: the global batch decides, in _train_step.)
                        entry, shown = {"skipped": "no loss-bearing tokens"}, None
                    else:
                        entry, shown = self._train_step(batch, weight, autocast)
                    scheduler.step()
                    self.step += 1
                    self._log({"step": self.step, **self._tokens(), "epoch": epoch, "lr": scheduler.get_last_lr()[0],
                               **entry, "elapsed_s": self._elapsed()})
                    progress.update(task, advance=1, loss="" if shown is None else f"loss {shown:.3f}")
                    if eval_batches and self.world.main and (self.step % r.eval_every == 0 or self.step == total):
                        self.module.eval()
                        self._log({"step": self.step, **self._tokens(), "eval": evaluate(self.loss_fn, eval_batches())})
                    if self.step % r.save_every == 0:
                        self._checkpoint()
                    if interrupt.requested():  # Ctrl-C / SIGTERM: keep this step, stop; rerunning resumes here
                        if self.step % r.save_every:
                            self._checkpoint()
                        interrupt.check()
                epoch += 1
        self._checkpoint()
        self.module.eval()
        final = evaluate(self.loss_fn, eval_batches()) if eval_batches and self.world.main else {}
        final["wall_time_s"] = self._elapsed()
        final["steps"] = self.step
        if self.world.main:
            self.save(self.out_dir / "drafter")
        distributed.barrier()  # nobody leaves (or resumes) before rank 0 has written the checkpoint
        return final
