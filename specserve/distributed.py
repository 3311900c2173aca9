"""Tensor-parallel process groups, collectives and the rank-0 -> worker command channel.

Tensor parallelism (TP) runs one process per rank: gloo on CPU, NCCL on CUDA. Rank 0 runs the
engine; every other rank runs the worker loop (`specserve.model.tp_worker`) and does what rank 0's
model runners tell it over the *control* channel: a fixed-size int64 header, then one int64
payload, both broadcast from rank 0 (tensors only, never pickles).

Two groups over the same ranks: the default group carries the model's collectives with a
bounded timeout (`COMPUTE_TIMEOUT`), so a rank that stops answering mid-step ends the step with an
error; the control group waits without a practical limit, because workers sit in it for as long
as the server is idle. A rank that dies closes its sockets, and gloo fails the pending collective
at once; rank 0 also watches spawned workers (see `tp_worker.TensorParallelWorkers`) and records
the failure here, so every later call fails fast with the same message.

A layer holds a `TPShard` (its rank and the world size it is split over) instead of asking the
process group, so a model split across ranks and a draft kept whole on rank 0 live side by side.
At world size 1 every collective is the identity and no process group is needed.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

# Longest a rank waits for the others inside one step's collectives.
COMPUTE_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("SPECSERVE_TP_TIMEOUT_S", 300)))
# Workers wait for rank 0's next command for as long as the server stays up.
CONTROL_TIMEOUT = datetime.timedelta(days=3650)
HEADER_LEN = 8


@dataclass(frozen=True)
class TPShard:
    """Where one model's weights live: this process holds shard `rank` of `world_size`.

    `model` numbers the models split across the group (0 = target, 1 = the draft at draft_tp),
    so a command from rank 0 names which one a worker runs.
    """

    rank: int = 0
    world_size: int = 1
    model: int = 0

    @property
    def is_split(self) -> bool:
        return self.world_size > 1


WHOLE = TPShard()


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering: the engine cannot go on."""


@dataclass
class CollectiveStats:
    """Model collectives on this rank since start (count and wall time): the cost of TP."""

    all_reduce_count: int = 0
    all_reduce_s: float = 0.0
    gather_count: int = 0
    gather_s: float = 0.0
    control_count: int = 0
    control_s: float = 0.0

    def add(self, kind: str, seconds: float) -> None:
        """Count one `kind` ("all_reduce", "gather" or "control") collective of `seconds`."""
        setattr(self, f"{kind}_count", getattr(self, f"{kind}_count") + 1)
        setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds)


@dataclass
class _State:
    control: object = None  # the control process group (rank 0 -> workers)
    failure: str | None = None
    # Rank 0: names the rank that died, when it can tell (the launcher's process watch).
    diagnose: Callable[[], str | None] | None = None
    split_checkpoints: dict[Path, TPShard] = field(default_factory=dict)
    stats: CollectiveStats = field(default_factory=CollectiveStats)


_state = _State()


# ---- process group setup ---------------------------------------------------------------
def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, device: str, master_addr: str | None = None,
               master_port: int | None = None) -> None:
    """Join the tensor-parallel group (every rank calls this, in the same order).

    Without `master_addr`/`master_port` the torchrun environment (MASTER_ADDR, MASTER_PORT) is
    used. On CUDA each rank takes the device `cuda:LOCAL_RANK` (or its rank on one machine).
    """
    if master_addr is not None:
        os.environ["MASTER_ADDR"] = master_addr
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COMPUTE_TIMEOUT)
    # The control channel always goes over gloo: it carries small int64 tensors from the host.
    _state.control = dist.new_group(list(range(world_size)), timeout=CONTROL_TIMEOUT,
                                    backend="gloo")
    _state.failure = None


def destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _state.control = None
    _state.diagnose = None
    _state.split_checkpoints.clear()


def mark_failed(message: str) -> None:
    """Record why the group cannot go on; every later collective raises with this message."""
    if _state.failure is None:
        _state.failure = message


def set_diagnose(diagnose: Callable[[], str | None]) -> None:
    """Rank 0: `diagnose()` explains a failed collective (which rank died), or returns None."""
    _state.diagnose = diagnose


def failure() -> str | None:
    return _state.failure


def check_alive() -> None:
    if _state.failure is not None:
        raise TensorParallelError(_state.failure)


def collective_stats() -> CollectiveStats:
    return _state.stats


# ---- which checkpoints load split (rank 0) ------------------------------------------------
def register_split_checkpoint(path: str | Path, shard: TPShard) -> None:
    """Rank 0: loading `path` gives this shard of it (the launcher registers target and draft)."""
    _state.split_checkpoints.setdefault(Path(path).resolve(), shard)


def shard_for_checkpoint(path: str | Path) -> TPShard:
    """How this process holds the model at `path`: a registered split, else the whole model."""
    return _state.split_checkpoints.get(Path(path).resolve(), WHOLE)


# ---- model collectives --------------------------------------------------------------------
def _run(op, kind: str, *args, **kwargs):
    check_alive()
    start = time.perf_counter()
    try:
        op(*args, **kwargs)
    except RuntimeError as exc:  # a peer closed its sockets or timed out
        cause = _state.diagnose() if _state.diagnose is not None else None
        mark_failed(cause or f"tensor-parallel collective failed (a rank died or stopped "
                             f"answering): {exc}")
        raise TensorParallelError(_state.failure) from exc
    _state.stats.add(kind, time.perf_counter() - start)


def all_reduce_sum(x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place); identity when whole."""
    if shard.is_split:
        _run(dist.all_reduce, "all_reduce", x)
    return x


def gather_last_dim(x: torch.Tensor, shard: TPShard) -> torch.Tensor | None:
    """Concatenate vocab-parallel logits along the last dim on rank 0 (None on the others)."""
    if not shard.is_split:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(shard.world_size)] if shard.rank == 0 else None
    _run(dist.gather, "gather", x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast_from_rank0(x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """Rank 0's `x` into every rank's `x` (in place) over the model group; identity when whole.

    Carries model data that follows a control command (the hidden rows of `ModelRunner.logits`);
    counted with the control traffic."""
    if shard.is_split:
        _run(dist.broadcast, "control", x, src=0)
    return x


# ---- the control channel (rank 0 -> workers) ----------------------------------------------
def send_command(header: list[int], payload: torch.Tensor | None = None) -> None:
    """Rank 0: broadcast a command header [HEADER_LEN] int64 and its int64 payload (if any)."""
    if len(header) > HEADER_LEN:
        raise ValueError(f"command header has {len(header)} fields; at most {HEADER_LEN}")
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    head[: len(header)] = torch.tensor(header, dtype=torch.int64)
    _run(dist.broadcast, "control", head, src=0, group=_state.control)
    if payload is not None:
        _run(dist.broadcast, "control", payload.contiguous(), src=0, group=_state.control)


def receive_header() -> list[int]:
    """Worker: block until rank 0's next command header."""
    head = torch.empty(HEADER_LEN, dtype=torch.int64)
    _run(dist.broadcast, "control", head, src=0, group=_state.control)
    return head.tolist()


def receive_payload(length: int) -> torch.Tensor:
    """Worker: the int64 payload [length] that follows a header."""
    payload = torch.empty(length, dtype=torch.int64)
    _run(dist.broadcast, "control", payload, src=0, group=_state.control)
    return payload
