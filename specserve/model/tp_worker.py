"""Tensor- and pipeline-parallel ranks: rank 0 starts and watches the workers; each worker
serves rank 0's commands on its shard (and pipeline stage) of the model.

`tp` x `pp` ranks (`distributed.Layout`): rank r is TP rank r % tp of pipeline stage r // tp.
Stage 0's workers hear rank 0's control broadcasts; a later stage's workers hear the previous
stage over their links (`pipeline.link`). The draft (whole on rank 0, or split over stage 0's TP
ranks with draft_tp = tp) never leaves stage 0.

Two ways to get N = tp x pp ranks:

- Spawned (one machine, the default): `launch(config)` on rank 0 starts N-1 worker processes
  (torch.multiprocessing, spawn), which meet rank 0 at MASTER_ADDR (127.0.0.1 unless the
  environment sets it) on a free port. Rank 0 watches them: a worker that exits makes every
  later model call fail with a `TensorParallelError` naming it (and its stage), the surviving
  workers are
  stopped, and registered `on_failure` callbacks run (the server uses one to exit). `shutdown`
  stops them all.
- torchrun (one or several machines): every process runs the same command; `launch` reads RANK,
  WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and on every rank but 0 it serves commands until rank 0
  shuts down, then ends the process. torchrun's agent watches the processes. With
  `--nnodes pp --nproc-per-node tp` each machine holds one stage: the all-reduces stay inside a
  machine, and only one hidden-state row per token crosses between machines.

Threads: the machine's cores are split between the ranks on it (`torch.set_num_threads(cores //
ranks)`); the C kernels take torch's thread count, so each rank's kernels use its share.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ..distributed import (
    Layout,
    PipelineStage,
    TensorParallelError,
    TPShard,
    destroy_group,
    failure,
    flush_sends,
    free_port,
    init_group,
    mark_failed,
    receive_header,
    receive_payload,
    register_split_checkpoint,
    send_command,
    set_diagnose,
)
from ..pipeline.link import StageLink
from .architectures import DecoderLM
from .loader import load_model
from .quant import draft_quantization
from .runner import Command, ModelRunner, StepInputs

log = logging.getLogger("specserve.tp")

TARGET, DRAFT = 0, 1  # model numbers in TPShard.model


@dataclass(frozen=True)
class ModelsSpec:
    """What every rank loads: its stage of the target split over the stage's `tp` ranks, and on
    stage 0 the draft too when `draft_split` (otherwise the draft stays whole on rank 0)."""

    target: Path
    draft: Path | None
    dtype: str
    device: str
    tp: int
    draft_split: bool
    quantization: str | None = None
    draft_quantization: str | None = None
    pp: int = 1

    @classmethod
    def from_config(cls, config) -> ModelsSpec:
        tp, draft_tp, pp = config.tp, config.draft_tp, config.pp
        if draft_tp not in (1, tp):
            raise ValueError(f"draft_tp must be 1 (the draft whole on rank 0) or tp={tp}; "
                             f"got {draft_tp}")
        if tp * pp > 1 and ":" in str(config.device):
            raise ValueError(f"with tp={tp}, pp={pp} give the device without an index "
                             f"({config.device!r} -> {str(config.device).split(':')[0]!r}): "
                             f"each rank takes its own")
        return cls(Path(config.target), Path(config.draft) if config.draft else None,
                   config.dtype, str(config.device), tp, config.draft is not None and
                   draft_tp == tp and tp > 1, config.quantization, config.draft_quantization,
                   pp)

    @property
    def layout(self) -> Layout:
        return Layout(self.pp, self.tp)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def shard(self, rank: int, model: int) -> TPShard:
        return TPShard(self.layout.tp_rank_of(rank), self.tp, model)

    def stage(self, rank: int) -> PipelineStage:
        return PipelineStage(self.layout.stage_of(rank), self.pp)


def threads_per_rank(ranks_on_machine: int) -> int:
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return max(1, cores // ranks_on_machine)


class TensorParallelWorkers:
    """Rank 0's handle on the worker processes it spawned (or on torchrun's ranks)."""

    def __init__(self, spec: ModelsSpec, processes: list) -> None:
        self.spec = spec
        self.processes = processes  # rank r is processes[r - 1]; empty under torchrun
        self._callbacks: list[Callable[[str], None]] = []
        self._closing = False
        self._lock = threading.Lock()
        # The watcher thread and a failed collective (through set_diagnose) may describe a dead
        # worker at once: two threads joining one process race in waitpid, and the loser reads
        # its exit code as None.
        self._reap_lock = threading.Lock()
        if processes:
            set_diagnose(self._dead_worker)
            threading.Thread(target=self._watch, name="specserve-tp-watch", daemon=True).start()
        atexit.register(self.shutdown)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def failure(self) -> str | None:
        return failure()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(message)` (from the watcher thread) when a worker dies."""
        self._callbacks.append(callback)
        if failure() is not None:
            callback(failure())

    def _dead_worker(self, wait_s: float = 2.0) -> str | None:
        """A worker that has exited (waiting up to `wait_s` for one), described. When several
        have, one killed by a signal is named before those that exited because a peer went
        away (a later stage whose link closed exits with code 1)."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels), timeout=wait_s)
        if not ready:
            return None
        dead = sorted(sentinels[s] for s in ready)
        with self._reap_lock:
            for rank in dead:
                self.processes[rank - 1].join(1)
            rank = min(dead, key=lambda r: (self.processes[r - 1].exitcode == 1, r))
            proc = self.processes[rank - 1]
            return (f"{self.spec.layout.describe(rank)} (pid {proc.pid}) exited with code "
                    f"{proc.exitcode}; the engine cannot continue (restart it)")

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.processes])
        if self._closing:
            return
        message = self._dead_worker()
        mark_failed(message)
        message = failure()  # a failed collective may have recorded it first
        log.error(message)
        self._stop_processes(timeout=2)
        for callback in self._callbacks:
            callback(message)

    def shutdown(self) -> None:
        """Stop every worker (asking first) and leave the process group. Safe to repeat."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if failure() is None:
            try:
                send_command([Command.STOP])
                if self.spec.pp > 1:  # stage 0's other ranks pass it on from their side
                    StageLink.here(self.spec.stage(0)).pass_on([Command.STOP])
                    flush_sends(timeout_s=10)
            except TensorParallelError:
                pass
        self._stop_processes(timeout=10)
        destroy_group()
        atexit.unregister(self.shutdown)

    def _stop_processes(self, timeout: float) -> None:
        for proc in self.processes:
            proc.join(timeout if failure() is None else 0)
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()


def launch(config) -> TensorParallelWorkers | None:
    """Start tensor/pipeline parallelism for an engine config (None at tp = pp = 1); run
    before the engine loads.

    On rank 0 this returns once every rank has joined the group and the checkpoints to split are
    registered for the loader. On another torchrun rank it serves commands and ends the process.
    """
    spec = ModelsSpec.from_config(config)
    if spec.world_size == 1:
        return None
    if torch.distributed.is_initialized():
        raise RuntimeError("a tensor- or pipeline-parallel group is already running in this "
                           "process; shut the previous engine down first (LLM.shutdown())")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _join_torchrun(spec)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or free_port(addr))
    threads = threads_per_rank(spec.world_size)
    ctx = mp.get_context("spawn")
    processes = [ctx.Process(target=_spawned_worker, args=(rank, spec, addr, port, threads),
                             name=f"specserve-tp{rank}", daemon=True)
                 for rank in range(1, spec.world_size)]
    for proc in processes:
        proc.start()
    try:
        _join_as_rank0(spec, addr, port, threads)
    except BaseException:
        for proc in processes:
            proc.kill()
        raise
    return TensorParallelWorkers(spec, processes)


def _join_as_rank0(spec: ModelsSpec, addr: str | None, port: int | None, threads: int) -> None:
    torch.set_num_threads(threads)
    init_group(0, spec.world_size, spec.device, addr, port, pp=spec.pp)
    register_split_checkpoint(spec.target, spec.shard(0, TARGET), spec.stage(0))
    if spec.draft_split:
        register_split_checkpoint(spec.draft, spec.shard(0, DRAFT))


def _join_torchrun(spec: ModelsSpec) -> TensorParallelWorkers:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != spec.world_size:
        raise ValueError(f"torchrun started {world} processes but tp x pp = {spec.tp} x "
                         f"{spec.pp}; give --nproc-per-node x --nnodes = tp x pp")
    threads = threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if rank == 0:
        _join_as_rank0(spec, None, None, threads)
        return TensorParallelWorkers(spec, [])
    run_worker(rank, spec, None, None, threads)
    raise SystemExit(0)


def _spawned_worker(rank: int, spec: ModelsSpec, addr: str, port: int, threads: int) -> None:
    try:
        run_worker(rank, spec, addr, port, threads)
    except TensorParallelError as exc:  # rank 0 went away: nothing to serve
        log.error("tensor-parallel worker rank %d: %s", rank, exc)
        raise SystemExit(1) from exc


def run_worker(rank: int, spec: ModelsSpec, addr: str | None, port: int | None,
               threads: int) -> None:
    """Join the groups, load this rank's shards and serve rank 0's commands until STOP."""
    torch.set_num_threads(threads)
    init_group(rank, spec.world_size, spec.device, addr, port, pp=spec.pp)
    stage = spec.stage(rank)
    try:
        models = {TARGET: load_model(spec.target, spec.dtype, spec.device, spec.quantization,
                                     spec.shard(rank, TARGET), stage=stage)}
        if spec.draft_split and stage.is_first:
            models[DRAFT] = load_model(spec.draft, spec.dtype, spec.device,
                                       draft_quantization(models[TARGET], spec.draft_quantization),
                                       spec.shard(rank, DRAFT), target=models[TARGET])
        if spec.device.startswith("cpu"):
            from ..kernels import cpu_build
            cpu_build.library()
        serve_commands(models, StageLink.here(stage) if stage.is_split else None)
    finally:
        destroy_group()


def serve_commands(models: dict[int, DecoderLM], link: StageLink | None = None) -> None:
    """The worker loop: mirror each of rank 0's runner calls on this rank's shard.

    `link`: this rank's pipeline links (None without pipeline parallelism). Stage 0's ranks
    hear rank 0's control broadcasts; a later stage's hear the previous stage, and receive
    the hidden states that come with a forward or an LM-head call; each runner passes every
    command on to the next stage."""
    upstream = link is not None and link.prev is not None
    header_of, payload_of = ((link.header, link.payload) if upstream
                             else (receive_header, receive_payload))
    runners: dict[int, ModelRunner] = {}

    def hidden_in(runner: ModelRunner, rows: int) -> torch.Tensor | None:
        return (link.hidden(rows, runner.model.spec.hidden_size, runner.dtype, runner.device)
                if upstream else None)

    while True:
        command, runner_id, *fields = header_of()
        if command == Command.STOP:
            if link is not None:
                link.pass_on([Command.STOP])
                flush_sends(timeout_s=10)
            return
        if command == Command.INIT_CACHE:
            model, num_blocks, block_size = fields[:3]
            runners[runner_id] = ModelRunner(models[model], num_blocks, block_size, runner_id)
        elif command == Command.FORWARD:
            header = fields[:StepInputs.FIELDS]
            inputs = StepInputs.unpack(header, payload_of(StepInputs.payload_len(header)))
            runner = runners[runner_id]
            runner.execute(inputs, hidden_in(runner, len(inputs.token_ids)))
        elif command == Command.MOVE_KV:
            runners[runner_id].copy_slots(payload_of(2 * fields[0]))
        elif command == Command.LOGITS:
            runner = runners[runner_id]
            runner.serve_logits(fields[0], hidden_in(runner, fields[0]))
        else:
            raise TensorParallelError(f"unknown tensor-parallel command {command}")
