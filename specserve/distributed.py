"""Process groups, collectives and command channels of tensor and pipeline parallelism.

Tensor parallelism (TP) runs one process per rank: gloo on CPU, NCCL on CUDA. Rank 0 runs the
engine; every other rank runs the worker loop (`specserve.model.tp_worker`) and does what rank 0's
model runners tell it over the *control* channel: a fixed-size int64 header, then one int64
payload, both broadcast from rank 0 (tensors only, never pickles).

Pipeline parallelism (PP) splits the layers into `pp` stages of `tp` ranks each (`Layout`:
global rank = stage * tp + tp rank, so torchrun with `--nproc-per-node tp` puts one stage on each
machine). Each stage has its own TP group for its collectives; the control channel reaches stage
0's ranks; every later stage hears its commands from the previous stage over point-to-point
*links* (rank (k, j) -> (k + 1, j)): the same header and payload, then the hidden states, whose
shape and dtype follow from the header. Sends are asynchronous (`send_async`): gloo's send waits
until the receiver posts its receive, and a stage must not wait for the next one to finish the
previous micro-batch.

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
HEADER_LEN = 10


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


@dataclass(frozen=True)
class PipelineStage:
    """Which layers this process holds: stage `index` of `num_stages`, a contiguous range.

    The first stage holds the embedding, the last the final norm and LM head. Earlier stages take
    one more layer when the layers do not split evenly: rank 0 sizes the KV pool from its own
    stage's layers, so every other stage's cache is at most as large."""

    index: int = 0
    num_stages: int = 1

    @property
    def is_split(self) -> bool:
        return self.num_stages > 1

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def layers(self, num_layers: int) -> range:
        """The global layer indices of this stage."""
        if num_layers < self.num_stages:
            raise ValueError(f"{num_layers} layers cannot be split over pp={self.num_stages} "
                             f"stages (at least one layer each)")
        base, extra = divmod(num_layers, self.num_stages)
        start = self.index * base + min(self.index, extra)
        return range(start, start + base + (self.index < extra))


WHOLE_MODEL = PipelineStage()


@dataclass(frozen=True)
class Layout:
    """pp stages x tp ranks; global rank = stage * tp + tp rank (stage-major)."""

    pp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, j) for j in range(self.tp)]

    def describe(self, rank: int) -> str:
        """How a message names a rank: its stage too under pipeline parallelism."""
        if self.pp == 1:
            return f"tensor-parallel worker rank {rank}"
        return (f"pipeline stage {self.stage_of(rank)} (tp rank {self.tp_rank_of(rank)}) "
                f"worker rank {rank}")


class TensorParallelError(RuntimeError):
    """A rank of the tensor- or pipeline-parallel group died or stopped answering: the engine
    cannot go on."""


@dataclass
class CollectiveStats:
    """Model collectives on this rank since start (count and wall time): the cost of TP; and the
    point-to-point traffic of PP (`send`: posting, `recv`: waiting for the data to arrive, which
    includes the sender's compute; bytes of each)."""

    all_reduce_count: int = 0
    all_reduce_s: float = 0.0
    gather_count: int = 0
    gather_s: float = 0.0
    control_count: int = 0
    control_s: float = 0.0
    send_count: int = 0
    send_s: float = 0.0
    send_bytes: int = 0
    recv_count: int = 0
    recv_s: float = 0.0
    recv_bytes: int = 0

    def add(self, kind: str, seconds: float, nbytes: int = 0) -> None:
        """Count one `kind` ("all_reduce", "gather", "control", "send" or "recv") operation of
        `seconds` (and `nbytes`, for point-to-point)."""
        setattr(self, f"{kind}_count", getattr(self, f"{kind}_count") + 1)
        setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds)
        if nbytes:
            setattr(self, f"{kind}_bytes", getattr(self, f"{kind}_bytes") + nbytes)


@dataclass
class _State:
    control: object = None  # the control process group (rank 0 -> stage 0's workers)
    layout: Layout = field(default_factory=Layout)
    rank: int = 0
    tp_group: object = None  # this rank's stage's TP group (None: the default group, pp=1)
    link: object = None  # the pipeline's header group (waits as long as the control group)
    outbox: list = field(default_factory=list)  # (work, tensor) of sends not yet received
    failure: str | None = None
    # Rank 0: names the rank that died, when it can tell (the launcher's process watch).
    diagnose: Callable[[], str | None] | None = None
    split_checkpoints: dict[Path, tuple[TPShard, PipelineStage]] = field(default_factory=dict)
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
               master_port: int | None = None, pp: int = 1) -> None:
    """Join the process groups (every rank calls this, in the same order): `world_size` ranks
    as `pp` pipeline stages of world_size / pp tensor-parallel ranks.

    Without `master_addr`/`master_port` the torchrun environment (MASTER_ADDR, MASTER_PORT) is
    used. On CUDA each rank takes the device `cuda:LOCAL_RANK` (or its rank on one machine).
    """
    if world_size % pp:
        raise ValueError(f"{world_size} ranks do not make pp={pp} equal stages")
    layout = Layout(pp, world_size // pp)
    if master_addr is not None:
        os.environ["MASTER_ADDR"] = master_addr
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COMPUTE_TIMEOUT)
    _state.layout, _state.rank = layout, rank
    if pp > 1:  # new_group is collective: every rank creates every stage's group, in order
        groups = [dist.new_group(layout.stage_ranks(s), timeout=COMPUTE_TIMEOUT)
                  for s in range(pp)]
        _state.tp_group = groups[layout.stage_of(rank)]
    # The control channel and the links' headers always go over gloo: small int64 tensors from
    # the host.
    _state.control = dist.new_group(layout.stage_ranks(0), timeout=CONTROL_TIMEOUT,
                                    backend="gloo")
    if pp > 1:
        _state.link = dist.new_group(list(range(world_size)), timeout=CONTROL_TIMEOUT,
                                     backend="gloo")
    _state.failure = None


def layout() -> Layout:
    return _state.layout


def this_rank() -> int:
    return _state.rank


def destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _state.control = None
    _state.tp_group = None
    _state.link = None
    _state.outbox.clear()
    _state.layout, _state.rank = Layout(), 0
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
def register_split_checkpoint(path: str | Path, shard: TPShard,
                              stage: PipelineStage = WHOLE_MODEL) -> None:
    """Rank 0: loading `path` gives this shard (and pipeline stage) of it (the launcher
    registers target and draft)."""
    _state.split_checkpoints.setdefault(Path(path).resolve(), (shard, stage))


def shard_for_checkpoint(path: str | Path) -> tuple[TPShard, PipelineStage]:
    """How this process holds the model at `path`: a registered split, else the whole model."""
    return _state.split_checkpoints.get(Path(path).resolve(), (WHOLE, WHOLE_MODEL))


# ---- model collectives --------------------------------------------------------------------
def _fail(exc: Exception) -> TensorParallelError:
    cause = _state.diagnose() if _state.diagnose is not None else None
    mark_failed(cause or f"{'pipeline' if _state.layout.pp > 1 else 'tensor'}-parallel "
                         f"communication failed (a rank died or stopped answering): {exc}")
    return TensorParallelError(_state.failure)


def _run(op, kind: str, *args, nbytes: int = 0, **kwargs):
    check_alive()
    start = time.perf_counter()
    try:
        result = op(*args, **kwargs)
    except RuntimeError as exc:  # a peer closed its sockets or timed out
        raise _fail(exc) from exc
    _state.stats.add(kind, time.perf_counter() - start, nbytes)
    return result


def _tp_root() -> int:
    """The global rank of tensor-parallel rank 0 of this process's stage."""
    return _state.layout.rank(_state.layout.stage_of(_state.rank), 0)


def all_reduce_sum(x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place); identity when whole."""
    if shard.is_split:
        _run(dist.all_reduce, "all_reduce", x, group=_state.tp_group)
    return x


def gather_last_dim(x: torch.Tensor, shard: TPShard) -> torch.Tensor | None:
    """Concatenate vocab-parallel logits along the last dim on the stage's TP rank 0 (None on
    the others)."""
    if not shard.is_split:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(shard.world_size)] if shard.rank == 0 else None
    _run(dist.gather, "gather", x, parts, dst=_tp_root(), group=_state.tp_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast_from_rank0(x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """TP rank 0's `x` into every rank's `x` (in place) over the stage's group; identity when
    whole.

    Carries model data that follows a control command (the hidden rows of `ModelRunner.logits`);
    counted with the control traffic."""
    if shard.is_split:
        _run(dist.broadcast, "control", x, src=_tp_root(), group=_state.tp_group)
    return x


# ---- pipeline links (point to point) ------------------------------------------------------
# At most this many sends wait for their receivers before a new send waits for the oldest: a
# stage runs at most a few micro-batches ahead of the next.
MAX_PENDING_SENDS = 32


def _reap_sends(keep: int) -> None:
    """Forget completed sends; wait for the oldest until at most `keep` are pending."""
    outbox = _state.outbox
    outbox[:] = [(work, t) for work, t in outbox if not work.is_completed()]
    while len(outbox) > keep:
        work, _ = outbox.pop(0)
        check_alive()
        start = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as exc:  # the receiver died or stopped answering
            raise _fail(exc) from exc
        _state.stats.send_s += time.perf_counter() - start


def send_async(x: torch.Tensor, dst: int, header: bool = False) -> None:
    """Send `x` to global rank `dst` without waiting for its receive (the tensor is kept until
    then). `header`: over the link group, whose receivers may wait for as long as the server is
    idle; else over the default group (NCCL on CUDA) with the compute timeout."""
    x = x.contiguous()
    work = _run(dist.isend, "send", x, dst, group=_state.link if header else None,
                nbytes=x.numel() * x.element_size())
    _state.outbox.append((work, x))
    _reap_sends(MAX_PENDING_SENDS)


def flush_sends(timeout_s: float) -> bool:
    """Wait (at most `timeout_s`) until every send of this rank has been received; False when
    some were not (the receiver is gone or stuck: the caller is shutting down anyway)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _reap_sends(MAX_PENDING_SENDS)  # drops the completed ones
        if not _state.outbox:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def recv_into(x: torch.Tensor, src: int, header: bool = False) -> torch.Tensor:
    """Receive global rank `src`'s next send (of `x`'s shape and dtype) into `x`."""
    _run(dist.recv, "recv", x, src, group=_state.link if header else None,
         nbytes=x.numel() * x.element_size())
    return x


def send_header(header: list[int], dst: int, payload: torch.Tensor | None = None) -> None:
    """A command header [HEADER_LEN] int64 (and its int64 payload) down a pipeline link."""
    send_async(_pack_header(header), dst, header=True)
    if payload is not None:
        send_async(payload.to(torch.int64), dst, header=True)


def recv_header(src: int) -> list[int]:
    """The next command header from the previous stage's rank `src`."""
    return recv_into(torch.empty(HEADER_LEN, dtype=torch.int64), src, header=True).tolist()


def recv_payload(src: int, length: int) -> torch.Tensor:
    """The int64 payload [length] that follows a header on a pipeline link."""
    return recv_into(torch.empty(length, dtype=torch.int64), src, header=True)


# ---- the control channel (rank 0 -> workers) ----------------------------------------------
def _pack_header(header: list[int]) -> torch.Tensor:
    if len(header) > HEADER_LEN:
        raise ValueError(f"command header has {len(header)} fields; at most {HEADER_LEN}")
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    head[: len(header)] = torch.tensor(header, dtype=torch.int64)
    return head


def send_command(header: list[int], payload: torch.Tensor | None = None) -> None:
    """Rank 0: broadcast a command header [HEADER_LEN] int64 and its int64 payload (if any) to
    stage 0's ranks."""
    head = _pack_header(header)
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
