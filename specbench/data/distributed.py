"""Several processes (``torchrun --nproc-per-node N``): the process group and the few collective
helpers that evaluation and training share.

Outside torchrun every helper is a no-op for a world of one, so single-process code paths stay
exactly as they were. Backend: NCCL when the ranks run on CUDA, gloo on the CPU. Each rank uses
``cuda:LOCAL_RANK``; every rank is assumed to see the same filesystem (parts, checkpoints, caches).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from specbench.errors import SpecbenchError

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched() -> World:
    """What torchrun announced in the environment (a world of one when not launched by it)."""
    return World(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def current() -> World:
    """The initialised process group's world, or a world of one."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    return World()


def rank_device(device: str, world: World) -> str:
    """The device this rank runs on: ``cuda``/``cuda:N``/``auto`` (with CUDA) become
    ``cuda:LOCAL_RANK`` under several processes; anything else is left as given."""
    if not world.active:
        return device
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return f"cuda:{world.local_rank}"
    return "cpu" if device == "auto" else device


def init(device: str = "cpu") -> World:
    """Join torchrun's process group (once per process); returns the world. NCCL for CUDA ranks,
    gloo otherwise."""
    world = launched()
    if not world.active:
        return world
    if not dist.is_initialized():
        cuda = rank_device(device, world).startswith("cuda")
        if cuda and torch.cuda.device_count() <= world.local_rank:
            raise SpecbenchError(f"rank {world.rank} needs cuda:{world.local_rank} but this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s); lower --nproc-per-node or use --device cpu")
        if cuda:
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
    return current()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if current().active:
        dist.barrier()


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (filling any on-disk cache it writes), then the other ranks,
    so no two processes write the same cache file at once."""
    world = current()
    if world.active and not world.main:
        dist.barrier()
    yield
    if world.active and world.main:
        dist.barrier()


def shard(items: Sequence[T], world: World) -> list[T]:
    """Item i goes to rank i % size (deterministic, order kept)."""
    return list(items[world.rank::world.size])


def rows_of(batch: Sequence[T], world: World) -> tuple[list[T], bool]:
    """This rank's rows of a global batch (rank, rank + N, ...) and whether they are a filler: a
    rank left without a row takes the first one, to be weighted 0, so that every rank runs every
    step's loss (losses that count their own steps stay in step)."""
    mine = list(batch[world.rank::world.size])
    return (mine, False) if mine else (list(batch[:1]), True)


def all_gather_object(obj):
    """Every rank's ``obj``, in rank order (``[obj]`` for a world of one)."""
    world = current()
    if not world.active:
        return [obj]
    gathered = [None] * world.size
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite every rank's tensors (in place) with rank ``src``'s."""
    if not current().active:
        return
    for t in tensors:
        if t.is_contiguous():
            dist.broadcast(t.data, src)
        else:
            dense = t.data.contiguous()
            dist.broadcast(dense, src)
            t.data.copy_(dense)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if current().active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
