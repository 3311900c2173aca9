"""EngineCore.step(): schedule -> propose -> verify -> accept -> update.

One step runs one target forward over every scheduled request: prompt chunks, plain decode
tokens and token trees (root + draft nodes) side by side. The draft model (if any) drafts
first, in a handful of small forwards of its own. Requests that sample this step get a verdict
(accepted path + bonus/recovered token); the accepted path's KV is moved into place in both
caches, tokens are committed one at a time through the stop conditions, and finished requests
release their blocks before the next step is scheduled.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import EngineConfig
from ..kernels import cpu_build
from ..model.loader import load_model, load_tokenizer
from ..model.runner import ModelRunner, Segment, kv_bytes_per_block
from ..outputs import RequestDelta
from ..sampling import SamplingParams, process_logits
from ..spec.adaptive import AdaptiveController
from ..spec.modes import SpecMode, parse_speculation
from ..spec.proposers import DraftModelProposer, NgramProposer, spec_slots_for
from ..spec.tree import build_tree_buffers, node_depths
from ..spec.verify import TokenTree, Verdict, verify_greedy, verify_sampled
from .block_manager import BlockManager
from .request import Request
from .scheduler import ScheduledRequest, Scheduler


@dataclass
class EngineStats:
    """Engine-wide counters since start (the /metrics endpoint exports them)."""

    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    num_finished: int = 0
    schedule_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0  # target forwards
    accept_time_s: float = 0.0  # verification, KV moves, commits

    @property
    def acceptance_length(self) -> float:
        drafts = self.num_drafts
        return 1.0 + self.num_accepted_tokens / drafts if drafts else 1.0


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.target)
        self.target = load_model(config.target, config.dtype, config.device)
        self.draft = (load_model(config.draft, config.dtype, config.device, target=self.target)
                      if config.draft else None)
        if self.draft is not None:
            _check_same_vocabulary(config.target, config.draft, self.tokenizer)
        if str(config.device).startswith("cpu"):
            cpu_build.library()  # compile the CPU kernels now, not inside the first request
        self.default_mode = parse_speculation(config.speculation, self.draft is not None,
                                              str(config.device))
        self.eos_token_ids = _eos_token_ids(config.target, self.tokenizer)
        self.max_model_len = min([config.scheduler.max_model_len,
                                  self.target.spec.max_position_embeddings]
                                 + ([self.draft.spec.max_position_embeddings]
                                    if self.draft else []))

        cache = config.cache
        dtype = next(self.target.parameters()).dtype
        per_block = kv_bytes_per_block(self.target, cache.block_size, dtype)
        if self.draft is not None:
            per_block += kv_bytes_per_block(self.draft, cache.block_size, dtype)
        num_blocks = cache.num_blocks or max(1, cache.kv_cache_memory_bytes // per_block)
        self.block_manager = BlockManager(num_blocks, cache.block_size,
                                          cache.enable_prefix_caching)
        self.runner = ModelRunner(self.target, num_blocks, cache.block_size)
        self.proposer = (DraftModelProposer(ModelRunner(self.draft, num_blocks, cache.block_size))
                         if self.draft is not None else None)
        self.ngram = NgramProposer()
        self.adaptive = AdaptiveController()
        sched_config = config.scheduler
        if sched_config.max_model_len != self.max_model_len:
            from dataclasses import replace
            sched_config = replace(sched_config, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(sched_config, self.block_manager, self._spec_slots,
                                   track_draft_kv=self.draft is not None)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, speculation=None) -> Request:
        """Validate and queue a request; errors are ValueError with a clear message."""
        req = self.make_request(prompt, params, request_id, speculation)
        self.add(req)
        return req

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, speculation=None) -> Request:
        """Tokenize and validate without touching engine state (safe from another thread)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        mode = (parse_speculation(speculation, self.draft is not None)
                if speculation is not None else None)
        return Request(request_id, ids, params, self.eos_token_ids, self.tokenizer, mode)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The one place request limits are checked."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.target.spec.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds the model's context of "
                             f"{self.max_model_len} tokens")
        blocks_needed = -(-total // self.block_manager.block_size)
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(f"request needs {blocks_needed} KV blocks; the pool has "
                             f"{self.block_manager.num_blocks}")

    def abort(self, request_id: str) -> RequestDelta | None:
        """Cancel a request and free its blocks now; None if it is unknown or already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req)
        self.adaptive.forget(request_id)
        req.finish("abort")
        return RequestDelta(request_id, [], req.take_text_delta(), finish_reason="abort",
                            metrics=req.metrics(), time=time.monotonic())

    def fail_all(self, message: str) -> list[RequestDelta]:
        """After a failed step: end every request with an error and free its blocks."""
        return [RequestDelta(rid, [], "", finish_reason="error", error=message,
                             metrics=req.metrics(), time=time.monotonic())
                for rid, req in list(self.requests.items())
                if self.abort(rid) is not None]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- the step -------------------------------------------------------------------------
    def _configured_mode(self, req: Request) -> SpecMode:
        return req.speculation if req.speculation is not None else self.default_mode

    def _mode(self, req: Request) -> SpecMode:
        """The mode a request runs this step ("adaptive" resolves to a chain length or off)."""
        mode = self._configured_mode(req)
        return self.adaptive.mode_for(req.request_id) if mode.kind == "adaptive" else mode

    def _spec_slots(self, req: Request) -> int:
        return spec_slots_for(self._mode(req), req.remaining_tokens)

    def step(self) -> list[RequestDelta]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.stats.schedule_time_s += t1 - t0
        if not out.scheduled:
            return []
        for item in out.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = time.monotonic()
        trees = self._propose(out.scheduled)
        t2 = time.perf_counter()
        segments = [self._target_segment(item, trees.get(item.request.request_id))
                    for item in out.scheduled]
        logits = self.runner.forward(segments)
        t3 = time.perf_counter()
        for item in out.scheduled:
            item.request.spec.draft_time_s += t2 - t1
            item.request.spec.verify_time_s += t3 - t2
        deltas = self._accept(out.scheduled, trees, segments, logits)
        t4 = time.perf_counter()
        stats = self.stats
        stats.num_steps += 1
        stats.draft_time_s += t2 - t1
        stats.verify_time_s += t3 - t2
        stats.accept_time_s += t4 - t3
        draft = self.proposer
        self.adaptive.observe_step(t3 - t2, sum(len(seg.token_ids) for seg in segments),
                                   draft.last_levels_time_s if draft else 0.0,
                                   draft.last_num_levels if draft else 0)
        return deltas

    def _propose(self, scheduled: list[ScheduledRequest]) -> dict[str, TokenTree]:
        draft_modes, ngram = {}, []
        for item in scheduled:
            if item.num_spec_slots:
                mode = self._mode(item.request)
                if mode.kind == "ngram":
                    ngram.append((item.request, item.num_spec_slots))
                else:
                    draft_modes[item.request.request_id] = mode
        trees = self.ngram.propose(ngram) if ngram else {}
        if self.proposer is not None:
            # Requests that never use the draft (off, n-gram) skip its prompt catch-up too.
            drafting = [item for item in scheduled
                        if self._configured_mode(item.request).needs_draft_model]
            trees.update(self.proposer.propose(drafting, draft_modes))
        return {rid: tree for rid, tree in trees.items() if len(tree) > 1}

    def _target_segment(self, item: ScheduledRequest, tree: TokenTree | None) -> Segment:
        req = item.request
        start = req.num_computed_tokens
        if tree is not None:
            buffers = build_tree_buffers(tree.parents)
            return Segment(tree.tokens, buffers.positions(start).tolist(), start,
                           req.block_table, range(len(tree)), buffers.tree_mask)
        end = start + item.num_new_tokens
        samples = end == req.num_tokens
        return Segment(req.all_token_ids[start:end], range(start, end), start, req.block_table,
                       [item.num_new_tokens - 1] if samples else [])

    def _accept(self, scheduled: list[ScheduledRequest], trees: dict[str, TokenTree],
                segments: list[Segment], logits: list[torch.Tensor]) -> list[RequestDelta]:
        stats = self.stats
        greedy_rows = [lg for item, lg in zip(scheduled, logits)
                       if lg.shape[0] and item.request.params.greedy]
        # One host transfer for every greedy request's argmax.
        argmax = iter(torch.cat(greedy_rows).argmax(-1).tolist() if greedy_rows else [])
        deltas = []
        now = time.monotonic()
        for item, seg, lg in zip(scheduled, segments, logits):
            req = item.request
            if not req.output_token_ids:
                stats.num_prompt_tokens += item.num_new_tokens
            if lg.shape[0] == 0:  # a prompt chunk that does not reach the end of the prompt
                req.num_computed_tokens += item.num_new_tokens
                self.scheduler.cache_full_blocks(req)
                continue
            tree = trees.get(req.request_id) or TokenTree([seg.token_ids[-1]], [-1])
            if req.params.greedy:
                verdict = verify_greedy(tree, [next(argmax) for _ in range(len(tree))])
            else:
                verdict = verify_sampled(tree, process_logits(lg, req.params), req.generator)
            deltas.append(self._commit(item, tree, verdict, now))
        return deltas

    def _commit(self, item: ScheduledRequest, tree: TokenTree, verdict: Verdict,
                now: float) -> RequestDelta:
        req, stats = item.request, self.stats
        root = req.num_computed_tokens + item.num_new_tokens - 1
        accepted = verdict.accepted
        if len(tree) > 1:
            self.runner.move_kv([(req.block_table, root + node, root + depth)
                                 for depth, node in enumerate(accepted, start=1)])
            if tree.draft_rows is not None and self.proposer is not None and \
                    self._mode(req).needs_draft_model:
                self.proposer.after_verify(req, tree, verdict)
            _count_draft(req.spec, stats, len(tree) - 1, len(accepted),
                         max(node_depths(tree.parents)))
        if item.num_new_tokens == 1 and self._configured_mode(req).kind == "adaptive":
            self.adaptive.observe_verdict(req.request_id, len(tree) - 1, len(accepted))
        req.num_computed_tokens += item.num_new_tokens + len(accepted)
        committed = []
        for token in [tree.tokens[n] for n in accepted] + [verdict.next_token]:
            committed.append(token)
            if req.append_token(token):
                break
        if req.first_token_time is None:
            req.first_token_time = now
        req.spec.num_target_steps += 1
        stats.num_generation_tokens += len(committed)
        delta = RequestDelta(req.request_id, committed, "",
                             num_draft_accepted=min(len(accepted), len(committed)), time=now)
        if req.is_finished:
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            self.adaptive.forget(req.request_id)
            stats.num_finished += 1
            delta.finish_reason = req.finish_reason
            delta.metrics = req.metrics()
        else:
            self.scheduler.cache_full_blocks(req)
        delta.text = req.take_text_delta()
        return delta


def _count_draft(spec, stats: EngineStats, num_nodes: int, num_accepted: int,
                 depth: int) -> None:
    for counters in (spec, stats):
        counters.num_drafts += 1
        counters.num_draft_tokens += num_nodes
        counters.num_accepted_tokens += num_accepted
        for per_pos, count in ((counters.accepted_per_pos, num_accepted),
                               (counters.drafted_per_pos, depth)):
            per_pos.extend([0] * (count - len(per_pos)))
            for d in range(count):
                per_pos[d] += 1


def _eos_token_ids(path: Path, tokenizer) -> frozenset[int]:
    from transformers import GenerationConfig

    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


def _check_same_vocabulary(target: Path, draft: Path, tokenizer) -> None:
    draft_tokenizer = load_tokenizer(draft)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"draft {draft} and target {target} have different tokenizers; "
                         f"speculation needs one shared vocabulary")
