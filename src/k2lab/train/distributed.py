"""Data-parallel training with FSDP2: process group, sharding, batch slicing, reductions, full state dicts.

``torchrun --nproc_per_node W -m k2lab train ...`` runs ``W`` processes; ``setup()`` reads torchrun's
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and starts a process group (gloo on CPU; NCCL for CUDA tensors
plus gloo for CPU ones when CUDA is available and the recipe does not say ``device = "cpu"``; ``"cuda"``
without a CUDA device is refused, as in one process). Joint vision-text runs are refused under a launcher of
several processes (``check_text_only``). Without those variables (or with ``WORLD_SIZE=1``)
training is one plain process on ``local_device`` (the GPU where torch sees one, unless the recipe says
``device = "cpu"``): the model and every batch are moved there, and the reductions are the identity.

Data parallelism is exact with respect to one process with the same *global* batch ``B``: every rank
runs the same deterministic batch iterator and keeps rows ``[r·B/W, (r+1)·B/W)`` (``local_rows``), it
backpropagates its token-weighted share of the micro-batch's mean loss (``k2lab.train.token_mean``: ranks
may hold different numbers of scored tokens, as SFT rows do) and FSDP2 averages the gradients over ranks,
so the averaged gradient is the one-process gradient of the whole batch (up to float summation order).
Scalars reported per step are averaged over ranks (``all_reduce_mean``).

Checkpoints hold full (unsharded) tensors only: ``full_state_dict`` / ``full_optimizer_state_dict``
gather every DTensor (a collective: call them on every rank), rank 0 writes, and
``load_full_state_dict`` / ``load_full_optimizer_state_dict`` cut each rank's shard back out of the full
tensors that every rank read from disk. So a checkpoint of a W-process run loads in one process and the
other way round.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from k2lab.data.packing import Batch
from k2lab.errors import K2LabError
from k2lab.hardware import DeviceChoice
from k2lab.optim import dtensor

_STATE: dict[str, Any] = {
    "owned": False,
    "used": False,
    "device": torch.device("cpu"),  # this rank's device in a process group
    "local": torch.device("cpu"),  # the one process's device inside a session (``local_device``)
}


# ---- process group ------------------------------------------------------------------------------------
def launched_world_size() -> int:
    """``WORLD_SIZE`` as torchrun (or any launcher following its conventions) set it; 1 without one."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 1
    return int(os.environ["WORLD_SIZE"])


def setup(requested: DeviceChoice = "auto") -> bool:
    """Start the process group from torchrun's environment when there are several processes; alone, put
    the process on ``local_device(requested)``.

    Returns whether this process is one of several data-parallel ranks. A process group that the caller
    already started is used as is (and left for the caller to destroy).
    """
    if is_distributed():
        _STATE["device"] = _pick_device()
        return True
    if launched_world_size() <= 1 or not dist.is_available():
        _STATE["local"] = local_device(requested)
        return False
    check_cuda(requested)  # before the group starts: each rank refuses alone
    if torch.cuda.is_available() and requested != "cpu":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        # NCCL for the model's CUDA tensors, gloo for the small CPU ones (expert loads, scalars)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    _STATE["owned"] = True
    _STATE["device"] = _pick_device()
    return True


def local_device(requested: DeviceChoice = "auto") -> torch.device:
    """Where one process trains: the current CUDA device for ``cuda``, and for ``auto`` where torch sees
    one; else the CPU. Several ranks (``setup``) each take their local GPU under NCCL for ``auto`` and
    ``cuda`` where torch sees one, the CPU under gloo otherwise."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    check_cuda(requested)
    return torch.device("cuda", torch.cuda.current_device())


def check_cuda(requested: DeviceChoice) -> None:
    """``device = 'cuda'`` where torch sees no CUDA device is a ``K2LabError`` (one process or several)."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise K2LabError(
            f"device = 'cuda' but this torch ({torch.__version__}) sees no CUDA device; use 'auto' or 'cpu'"
        )


def check_text_only(vision_language: bool) -> None:
    """Refuse joint vision-text training under a launcher of several processes before the run starts
    (``K2LabError``): its batches are not split across data-parallel ranks yet (``local_batch``), nor is the
    vision-language model sharded (``shard_model``)."""
    if vision_language and launched_world_size() > 1:
        raise K2LabError(
            "joint vision-text batches are not split across data-parallel ranks yet; train this "
            f"vision-language recipe in one process (this launch has WORLD_SIZE={launched_world_size()})"
        )


def _pick_device() -> torch.device:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown() -> None:
    """Barrier, then destroy the process group if ``setup()`` started it (every rank must call this)."""
    if _STATE["owned"] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _STATE["owned"] = False
        _STATE["used"] = True


@contextlib.contextmanager
def session(requested: DeviceChoice = "auto") -> Iterator[bool]:
    """``setup(requested)`` on entry; on a normal exit ``shutdown()``; on an error the group is just
    destroyed (no barrier: the other ranks may never reach it; torchrun stops them when this one fails).
    A one-process session's device lasts as long as the session."""
    distributed = setup(requested)
    try:
        yield distributed
    except BaseException:
        if _STATE["owned"] and dist.is_initialized():
            dist.destroy_process_group()
            _STATE["owned"] = False
            _STATE["used"] = True
        raise
    else:
        shutdown()
    finally:
        _STATE["local"] = torch.device("cpu")


@contextlib.contextmanager
def exit_without_teardown() -> Iterator[None]:
    """For ``python -m k2lab`` under torchrun: after a distributed run ends, exit without interpreter
    teardown. Gloo worker threads that still hold finished work objects can abort the process during
    finalisation (pytorch/pytorch#179291) after everything was written; the exit status is kept."""
    try:
        yield
    except SystemExit as stop:
        if not _STATE.get("used"):
            raise
        code = stop.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        _flush_and_exit(code or 0)
    else:
        if _STATE.get("used"):
            _flush_and_exit(0)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def is_distributed() -> bool:
    """Whether this process is one of several data-parallel ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_main() -> bool:
    """Rank 0 (or the only process): the one that prints, logs metrics and writes files."""
    return rank() == 0


def device() -> torch.device:
    """Where this rank's model and batches live: ``cuda:LOCAL_RANK`` under NCCL, else the CPU; alone, the
    session's ``local_device`` (the CPU outside a session)."""
    return _STATE["device"] if is_distributed() else _STATE["local"]


def barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (e.g. fills a cache), the other ranks after it (e.g. read the cache)."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


# ---- model and data -----------------------------------------------------------------------------------
def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, final norm, LM head).

    Every rank must hold the same weights beforehand (the model is built from the same seed on each):
    each keeps its own slice, nothing is broadcast. Without a process group the model is moved to
    ``device()`` (in place, as ``Module.to`` does) and returned.
    """
    if not is_distributed():
        return model.to(device())
    from torch.distributed.device_mesh import init_device_mesh  # lazy: only sharding needs them
    from torch.distributed.fsdp import fully_shard

    target = device()
    model.to(target)
    mesh = init_device_mesh(target.type, (world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_batch_size(batch_size: int) -> None:
    """The global batch must split evenly over the ranks (``K2LabError`` naming both numbers if not)."""
    world = world_size()
    if batch_size % world:
        raise K2LabError(
            f"batch_size {batch_size} (the global batch) does not split over {world} data-parallel "
            f"processes; use a multiple of {world}"
        )


def local_rows(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows ``[r·B/W, (r+1)·B/W)`` of a ``[B, ...]`` batch tensor, on ``device()``.

    A batch whose rows do not split evenly (a short last validation batch) is kept whole on every rank:
    each then computes the same value, so averaging over ranks still gives the one-process result.
    """
    if not is_distributed():
        return tensor.to(device())
    rows, world = tensor.shape[0], world_size()
    if rows % world == 0:
        share = rows // world
        tensor = tensor[rank() * share : (rank() + 1) * share]
    return tensor.to(device())


def local_batch(batch: Batch) -> Batch:
    """This rank's rows of every tensor of a global ``Batch`` (alone: the batch, on ``device()``)."""
    if not is_distributed():
        return batch if device().type == "cpu" else batch.to(device())
    if batch.media is not None:
        raise NotImplementedError(
            "joint vision-text batches are not split across data-parallel ranks yet; train them in one process"
        )
    segments = batch.segment_ids
    return Batch(
        local_rows(batch.input_ids),
        local_rows(batch.labels),
        None if segments is None else local_rows(segments),
    )


def local_batches(batches: Iterable[Batch]) -> Iterator[Batch]:
    """Global training batches -> this rank's rows of each (alone: each batch, on ``device()``)."""
    if not is_distributed():
        yield from map(local_batch, batches)
        return
    for batch in batches:
        if batch.input_ids.shape[0] % world_size():
            check_batch_size(batch.input_ids.shape[0])
        yield local_batch(batch)


def all_reduce_mean(values: float | Sequence[float]) -> Any:
    """The mean over ranks of a float (or of each float of a sequence, in one collective).

    Without a process group the values come back unchanged (the same objects).
    """
    if not is_distributed():
        return values
    single = isinstance(values, (int, float))
    flat = torch.tensor([values] if single else list(values), dtype=torch.float64)
    dist.all_reduce(flat)
    means = (flat / world_size()).tolist()
    return means[0] if single else means


def all_reduce_max(values: dict[str, float]) -> dict[str, float]:
    """The maximum over ranks of each value (keys in the same order on every rank); unchanged without a
    process group."""
    if not is_distributed() or not values:
        return values
    flat = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return dict(zip(values, flat.tolist(), strict=True))


class Discard:
    """Stands in for rank 0's metrics logger on the other ranks: a context manager whose methods do nothing."""

    def __enter__(self) -> Discard:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def on_main(factory: Callable[[], Any]) -> Any:
    """``factory()`` on rank 0, a ``Discard`` elsewhere (loggers and writers that only rank 0 may own)."""
    return factory() if is_main() else Discard()


# ---- full (unsharded) state -----------------------------------------------------------------------------
def full_tensor(value: Any) -> Any:
    """A DTensor gathered to a plain tensor (a collective), anything else as is."""
    return dtensor.full(value)


def _gather(value: Any, keep: bool) -> Any:
    """``value`` with every DTensor inside (dicts, lists, tuples) gathered to a plain CPU tensor.

    The traversal order is the container order, the same on every rank, so the collectives match.
    """
    if dtensor.is_dtensor(value):
        full = value.full_tensor()
        return full.cpu() if keep else None
    if isinstance(value, dict):
        return type(value)((key, _gather(item, keep)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_gather(item, keep) for item in value)
    return value


def _has_dtensor(value: Any) -> bool:
    if dtensor.is_dtensor(value):
        return True
    if isinstance(value, dict):
        return any(_has_dtensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_dtensor(item) for item in value)
    return False


def full_state_dict(model: torch.nn.Module, rank0_only: bool = False) -> dict[str, Any]:
    """The model's state dict with every sharded parameter gathered to a plain (CPU) tensor.

    A collective under FSDP2: every rank must call it. ``rank0_only`` returns ``{}`` on the other
    ranks (they still take part in the gathers). An unsharded model's ``state_dict()`` comes back as is.
    """
    state = model.state_dict()
    if not _has_dtensor(state):
        return state
    keep = is_main() or not rank0_only
    gathered = _gather(state, keep)
    return gathered if keep else {}


def load_full_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load a full state dict (e.g. from a checkpoint every rank read) into a sharded or plain model.

    Each sharded parameter keeps its own slice of the full tensor (``distribute_tensor`` without
    communication); buffers are copied whole.
    """
    current = model.state_dict()
    if not _has_dtensor(current):
        model.load_state_dict(state)
        return
    model.load_state_dict({key: _like(value, current.get(key)) for key, value in state.items()})


def _like(full: Any, reference: Any) -> Any:
    """``full`` sharded like the DTensor ``reference`` (this rank's slice, no communication)."""
    if not dtensor.is_dtensor(reference) or not isinstance(full, torch.Tensor) or dtensor.is_dtensor(full):
        return full
    if tuple(full.shape) != tuple(reference.shape):
        raise K2LabError(
            f"checkpoint tensor of shape {tuple(full.shape)} does not fit a parameter of shape "
            f"{tuple(reference.shape)}"
        )
    return dtensor.like(full.to(device=reference.device, dtype=reference.dtype), reference)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` itself, or the one a wrapper such as ``MuonClip`` holds."""
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer


def full_optimizer_state_dict(optimizer: Any, rank0_only: bool = False) -> dict[str, Any]:
    """``optimizer.state_dict()`` with its DTensor states (Muon momentum, AdamW moments) gathered to plain
    CPU tensors. A collective under FSDP2; works for ``torch.optim`` optimizers and ``MuonClip``."""
    state = optimizer.state_dict()
    if not _has_dtensor(state):
        return state
    keep = is_main() or not rank0_only
    gathered = _gather(state, keep)
    return gathered if keep else {}


def load_full_optimizer_state_dict(optimizer: Any, state: dict[str, Any]) -> None:
    """Load a full optimizer state dict into an optimizer over (possibly) sharded parameters.

    Per-parameter state tensors shaped like their parameter are sharded like it; scalars (``step``) stay.
    The torch optimizer's state dict may be nested in a wrapper's (``MuonClip``: under ``"optimizer"``).
    """
    inner = _torch_optimizer(optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    if any(dtensor.is_dtensor(p) for p in params):
        state = _shard_optimizer_state(state, params)
    optimizer.load_state_dict(state)


def _shard_optimizer_state(state: Any, params: list[torch.Tensor]) -> Any:
    if isinstance(state, dict) and "state" in state and "param_groups" in state:
        per_param = {
            index: {key: _like(value, params[int(index)]) for key, value in entry.items()}
            for index, entry in state["state"].items()
        }
        return {**state, "state": per_param}
    if isinstance(state, dict):
        return {key: _shard_optimizer_state(value, params) for key, value in state.items()}
    return state


def gather_model(model: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
    """An unsharded copy of a sharded model on rank 0 (``build()`` loaded with the full state), ``None``
    on the other ranks; a collective. An unsharded model is returned itself."""
    if not _has_dtensor(model.state_dict()):
        return model
    state = full_state_dict(model, rank0_only=True)
    if not is_main():
        return None
    plain = build()
    plain.load_state_dict(state)
    return plain
