"""Training on several processes: under ``torchrun`` each process joins the group here (gloo on CPU,
NCCL on GPU) and takes rows ``rank::world`` of every batch; the models are wrapped in
DistributedDataParallel, and rank 0 alone writes checkpoints and results. A plain run is rank 0 of 1."""

from __future__ import annotations

import os

import torch


def join() -> tuple[int, int]:
    """(rank, world size), joining the process group when launched by ``torchrun``."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def leave() -> None:
    """Leave the process group, if this process joined one: a process that exits with gloo's
    threads still running may abort in the C++ runtime's teardown ("terminate called without an
    active exception") after all its work is done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """``model`` in DistributedDataParallel when there are several processes (gradients averaged)."""
    return torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model


def barrier(world: int) -> None:
    """Wait for every process (after rank 0 has written something the others may read)."""
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def share(tensors: tuple[torch.Tensor, ...] | None, owner: int, world: int) -> tuple[torch.Tensor, ...]:
    """``tensors`` of process ``owner`` on every process (the others pass None): each tensor's
    dtype and shape first, then its bytes (which every backend sends, bfloat16 or not)."""
    if world <= 1:
        return tensors
    import torch.distributed as dist

    box = [None if tensors is None else [(t.dtype, tuple(t.shape)) for t in tensors]]
    dist.broadcast_object_list(box, src=owner)
    out = []
    for k, (dtype, shape) in enumerate(box[0]):
        t = tensors[k].contiguous() if tensors is not None else torch.empty(shape, dtype=dtype)
        dist.broadcast(t.reshape(-1).view(torch.uint8), src=owner)
        out.append(t)
    return tuple(out)
