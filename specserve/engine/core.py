"""EngineCore.step(): schedule -> propose -> target forward -> verify -> commit.

One step runs one target forward over every scheduled request: prompt chunks, plain decode
tokens and token trees (root + draft nodes) side by side. The proposers draft first (the draft
model, if any, in a handful of small forwards of its own), driven through the `Proposer`
protocol. Requests that sample this step get a verdict (accepted path + bonus/recovered token);
committing it moves the accepted path's KV into place in both caches, advances the request's
`KVProgress`, commits tokens one at a time through the stop conditions, and either finishes the
request (its blocks return before the next step is scheduled) or offers its full blocks to the
prefix cache. Requests that asked for log-probabilities get them from this same forward
(`logprobs.py`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..config import EngineConfig
from ..kernels import cpu_build
from ..model.loader import load_model, load_tokenizer
from ..model.quant import draft_quantization
from ..model.runner import ModelRunner, Segment, kv_bytes_per_block
from ..outputs import RequestDelta
from ..sampling import SamplingParams, argmax_rows, process_logits
from ..speculation.adaptive import AdaptiveController, acceptance_prior
from ..speculation.modes import OFF, SpecKind, SpecMode, parse_speculation
from ..speculation.proposers import (
    DraftModelProposer,
    NgramProposer,
    Proposal,
    Proposer,
    ProposerInput,
)
from ..speculation.suffix import SuffixMatch, SuffixProposer
from ..speculation.tree import TokenTree, build_tree_buffers, node_depths
from ..speculation.verify import Verdict, verify_greedy, verify_sampled
from ..structured.compiler import GrammarCompiler
from ..structured.matcher import RequestGrammar, apply_bitmask
from ..validation import RequestLimits, check_lengths, check_prompt_ids
from .block_manager import BlockManager
from .interface import EngineLimits, EngineStats, KVPoolStats, ModelInfo
from .logprobs import chunked_token_logprobs, token_logprobs
from .request import Request
from .scheduler import ScheduledRequest, Scheduler


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.target)
        self.target = load_model(config.target, config.dtype, config.device, config.quantization)
        self.draft = (load_model(config.draft, config.dtype, config.device,
                                 draft_quantization(self.target, config.draft_quantization),
                                 target=self.target)
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
        # Each model's cache holds its own dtype (a bf16 draft beside a float32 target).
        per_block = kv_bytes_per_block(self.target, cache.block_size)
        if self.draft is not None:
            per_block += kv_bytes_per_block(self.draft, cache.block_size)
        num_blocks = cache.num_blocks or max(1, cache.kv_cache_memory_bytes // per_block)
        self.block_manager = BlockManager(num_blocks, cache.block_size,
                                          cache.enable_prefix_caching)
        self.runner = ModelRunner(self.target, num_blocks, cache.block_size)
        self.proposer = (DraftModelProposer(ModelRunner(self.draft, num_blocks, cache.block_size,
                                                        head_rows=True))
                         if self.draft is not None else None)
        if self.draft is not None and self.draft.spec.target_feature_layers:
            # The draft reads these layers' outputs too: the target's hidden rows carry them.
            self.runner.tap_layers(self.draft.spec.target_feature_layers)
        self.ngram = NgramProposer()
        self.suffix = SuffixProposer()  # its store holds every request's text, whatever its mode
        self.adaptive = AdaptiveController(engine_acceptance=acceptance_prior(config.draft))
        sched_config = config.scheduler
        if sched_config.max_model_len != self.max_model_len:
            sched_config = replace(sched_config, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(sched_config, self.block_manager, self._spec_slots,
                                   track_draft_kv=self.draft is not None)
        self.requests: dict[str, Request] = {}
        # Structured output: compiled grammars (cached, shared with the server's compile) and
        # the matcher of every constrained request, at its committed output.
        self.grammars = GrammarCompiler(self.tokenizer, self.target.spec.vocab_size,
                                        self.eos_token_ids)
        self._grammar: dict[str, RequestGrammar] = {}
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
        if params.structured is not None:
            self.grammars.compile(params.structured)  # GrammarError (a ValueError) names it
        mode = (parse_speculation(speculation, self.draft is not None)
                if speculation is not None else None)
        return Request(request_id, ids, params, self.eos_token_ids, self.tokenizer, mode)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.params.structured is not None:  # compiled in make_request: a cache hit
            self._grammar[req.request_id] = RequestGrammar(
                self.grammars.compile(req.params.structured), self.target.spec.vocab_size)
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """A request's token ids and length against this engine's vocabulary, context and KV
        pool, with the same checks (and messages) the server applies (specserve.validation)."""
        limits = self.limits
        check_prompt_ids(prompt_ids, self.target.spec.vocab_size)
        check_lengths(len(prompt_ids), params.max_tokens,
                      RequestLimits.for_context(min(limits.max_model_len, limits.kv_pool_tokens)),
                      prompt_param="prompt")

    def abort(self, request_id: str) -> RequestDelta | None:
        """Cancel a request and free its blocks now; None if it is unknown or already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req)
        self._forget(req)
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

    # ---- read-only views (see interface.py) -----------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(self.config.target, self.config.draft, self.target.spec.vocab_size,
                         self.default_mode)

    @property
    def limits(self) -> EngineLimits:
        blocks = self.block_manager
        return EngineLimits(self.max_model_len, blocks.num_blocks * blocks.block_size,
                            self.config.scheduler.max_num_seqs)

    def kv_pool(self) -> KVPoolStats:
        blocks = self.block_manager
        return KVPoolStats(blocks.num_blocks, blocks.num_free_blocks, blocks.prefix_hit_rate)

    # ---- the step -------------------------------------------------------------------------
    def _configured_mode(self, req: Request) -> SpecMode:
        return req.speculation if req.speculation is not None else self.default_mode

    def _mode(self, req: Request) -> SpecMode:
        """The mode a request runs this step (adaptive resolves to a chain length or off;
        suffix+MODE to suffix where the text occurred before, else to MODE)."""
        mode = self._configured_mode(req)
        if mode.kind is not SpecKind.SUFFIX:
            return self._resolved(req, mode)
        match = self.suffix.lookup(req.request_id, req.all_token_ids)
        if mode.fallback is None:
            return mode if match.match_length else OFF
        if match.beats_a_draft(mode.num_tokens):
            from_store = self._suffix_step(mode, match)
            if from_store.enabled:
                return from_store
        fallback = self._resolved(req, mode.fallback)
        # Where the draft would not draft this step (adaptive found it does not pay), any
        # match is better than nothing if its verified rows pay, as `suffix` alone.
        if not fallback.enabled and match.match_length:
            return self._suffix_step(mode, match)
        return fallback

    def _suffix_step(self, mode: SpecMode, match: SuffixMatch) -> SpecMode:
        """suffix:K+MODE drafting from the store this step: with an adaptive MODE, the tree's
        nodes that pay for their rows (adaptive.suffix_nodes; OFF where none does)."""
        if not mode.fallback.is_adaptive:
            return replace(mode, fallback=None)
        nodes = self.adaptive.suffix_nodes(match.match_length, mode.num_tokens)
        return replace(mode, num_tokens=nodes, fallback=None) if nodes else OFF

    def _resolved(self, req: Request, mode: SpecMode) -> SpecMode:
        return self.adaptive.mode_for(req.request_id) if mode.is_adaptive else mode

    def _proposer_for(self, mode: SpecMode) -> Proposer | None:
        """Who drafts under `mode` (a configured adaptive or suffix+MODE mode drafts with the
        draft model: it catches up on the prompt and keeps the target's states)."""
        if mode.kind is SpecKind.NGRAM:
            return self.ngram
        if mode.kind is SpecKind.SUFFIX and mode.fallback is None:
            return self.suffix
        return self.proposer if mode.needs_draft_model else None

    def _spec_slots(self, req: Request) -> int:
        mode = self._mode(req)
        proposer = self._proposer_for(mode)
        return proposer.spec_slots(mode, req.remaining_tokens) if proposer is not None else 0

    def step(self) -> list[RequestDelta]:
        """Schedule -> propose -> target forward -> verify -> commit."""
        timer = _StepTimer()
        out = self.scheduler.schedule()
        timer.lap("schedule")
        for req in out.preempted:  # recomputed from the start: its target states come again
            self._forget_target_hidden(req)
        if not out.scheduled:
            self.stats.schedule_time_s += timer.laps["schedule"]
            return []
        modes = self._start_step(out.scheduled)
        trees, levels = self._propose(out.scheduled, modes)
        timer.lap("draft")
        segments = [self._target_segment(item, trees.get(item.request.request_id))
                    for item in out.scheduled]
        hidden: list[torch.Tensor] = []  # per segment, its hidden_rows (prompt logprobs)
        logits = self.runner.forward(segments, hidden)
        timer.lap("target_forward")
        verdicts = self._verify(out.scheduled, trees, segments, logits)
        timer.lap("verify")
        self._record_target_hidden(out.scheduled, segments, hidden, trees, verdicts)
        now = time.monotonic()
        deltas = [self._commit(item, tree, verdict, modes.get(item.request.request_id, OFF),
                               now)
                  for item, tree, verdict in verdicts]
        self._score(out.scheduled, segments, logits, hidden, verdicts, deltas)
        timer.lap("commit")
        self._record_step(out.scheduled, timer, segments, levels)
        return deltas

    def _start_step(self, scheduled: list[ScheduledRequest]) -> dict[str, SpecMode]:
        """Stamp first-scheduled times; fix the mode of each request that speculates."""
        now = time.monotonic()
        for item in scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now
        return {item.request.request_id: self._mode(item.request)
                for item in scheduled if item.num_spec_slots}

    def _propose(self, scheduled: list[ScheduledRequest], modes: dict[str, SpecMode]
                 ) -> tuple[dict[str, TokenTree], Proposal | None]:
        """Token trees of the requests that speculate this step, and the draft model's proposal
        (for its timing). Requests that never use the draft (off, n-gram) skip its prompt
        catch-up too."""
        trees: dict[str, TokenTree] = {}
        draft_proposal = None
        for proposer in (self.ngram, self.suffix, self.proposer):
            batch = [_proposer_input(item, modes.get(item.request.request_id, OFF),
                                     self._grammar.get(item.request.request_id))
                     for item in scheduled
                     if proposer is not None and self._step_proposer(item, modes) is proposer]
            if not batch:
                continue
            proposal = proposer.propose(batch)
            for rid, end in proposal.draft_computed.items():
                self.requests[rid].kv.draft_reached(end)
            trees.update(proposal.trees)
            if proposer is self.proposer:
                draft_proposal = proposal
        # A constrained request's tree loses the nodes its grammar rejects (a proposer that
        # does not mask, such as n-gram lookup, may propose them).
        trees = {rid: self._grammar[rid].prune(tree) if rid in self._grammar else tree
                 for rid, tree in trees.items()}
        return {rid: tree for rid, tree in trees.items() if len(tree) > 1}, draft_proposal

    def _step_proposer(self, item: ScheduledRequest, modes: dict[str, SpecMode]
                       ) -> Proposer | None:
        """Who sees a request this step: the proposer of its step mode when it speculates,
        else the one of its configured mode (the draft model catches up on prompt chunks)."""
        req = item.request
        if item.num_spec_slots:
            return self._proposer_for(modes[req.request_id])
        return self._proposer_for(self._configured_mode(req))

    def _feeds_draft_hidden(self, req: Request) -> bool:
        """Whether the draft of this request's configured mode reads the target's hidden
        states (an EAGLE-style draft), so the target's forwards keep them."""
        proposer = self._proposer_for(self._configured_mode(req))
        return proposer is self.proposer and proposer is not None and \
            proposer.reads_target_hidden

    def _target_segment(self, item: ScheduledRequest, tree: TokenTree | None) -> Segment:
        req = item.request
        start = req.num_computed_tokens
        every_row = self._feeds_draft_hidden(req)
        if tree is not None:
            buffers = build_tree_buffers(tree.parents)
            return Segment(tree.tokens, buffers.positions(start).tolist(), start,
                           req.block_table, range(len(tree)), buffers.tree_mask,
                           hidden_rows=range(len(tree)) if every_row else ())
        end = start + item.num_new_tokens
        samples = end == req.num_tokens
        hidden_rows = (range(item.num_new_tokens) if every_row
                       else _prompt_logprob_rows(req, start, end))
        return Segment(req.all_token_ids[start:end], range(start, end), start, req.block_table,
                       [item.num_new_tokens - 1] if samples else [], hidden_rows=hidden_rows)

    def _record_target_hidden(self, scheduled: list[ScheduledRequest], segments: list[Segment],
                              hidden: list[torch.Tensor], trees: dict[str, TokenTree],
                              verdicts: list[tuple[ScheduledRequest, TokenTree, Verdict]]
                              ) -> None:
        """Hand a hidden-reading draft the target's states at this step's committed positions:
        every row of a prompt chunk or plain decode, the root and accepted nodes of a tree (the
        root sits at the segment's start, the accepted path right behind it)."""
        accepted = {item.request.request_id: verdict.accepted for item, _, verdict in verdicts}
        for item, seg, hid in zip(scheduled, segments, hidden):
            req = item.request
            if not self._feeds_draft_hidden(req):
                continue
            rid = req.request_id
            rows = [0] + accepted[rid] if rid in trees else list(range(len(seg.token_ids)))
            self.proposer.record_target_hidden(rid, seg.start, hid[rows])  # [n, (1 + k) H]

    def _verify(self, scheduled: list[ScheduledRequest], trees: dict[str, TokenTree],
                segments: list[Segment], logits: list[torch.Tensor]
                ) -> list[tuple[ScheduledRequest, TokenTree, Verdict]]:
        """A verdict for every request that samples this step; prompt chunks that do not reach
        the end of the prompt only advance. A constrained request's logits are masked by its
        grammar at every node first (argmax and distribution alike)."""
        logits = [self._mask_logits(item.request, seg, lg, trees)
                  for item, seg, lg in zip(scheduled, segments, logits)]
        greedy_rows = [lg for item, lg in zip(scheduled, logits)
                       if lg.shape[0] and item.request.params.greedy]
        # Every greedy request's argmax: on CPU each tensor's as it is (no copy), elsewhere
        # one host transfer for all of them.
        on_cpu = all(lg.device.type == "cpu" for lg in greedy_rows)
        argmax = iter([i for lg in greedy_rows for i in argmax_rows(lg)] if on_cpu
                      else argmax_rows(torch.cat(greedy_rows)))
        verdicts = []
        for item, seg, lg in zip(scheduled, segments, logits):
            req = item.request
            if not req.output_token_ids:
                self.stats.num_prompt_tokens += item.num_new_tokens
            if lg.shape[0] == 0:
                req.kv.prompt_chunk_computed(item.num_new_tokens)
                self.scheduler.cache_full_blocks(req)
                continue
            tree = trees.get(req.request_id) or TokenTree([seg.token_ids[-1]], [-1])
            if req.params.greedy:
                verdict = verify_greedy(tree, [next(argmax) for _ in range(len(tree))])
            else:
                verdict = verify_sampled(tree, process_logits(lg, req.params), req.generator)
            verdicts.append((item, tree, verdict))
        return verdicts

    def _mask_logits(self, req: Request, seg: Segment, lg: torch.Tensor,
                     trees: dict[str, TokenTree]) -> torch.Tensor:
        """lg [n, V] with the tokens the grammar disallows after each node at -inf."""
        grammar = self._grammar.get(req.request_id)
        if grammar is None or lg.shape[0] == 0:
            return lg
        tree = trees.get(req.request_id) or TokenTree([seg.token_ids[-1]], [-1])
        return apply_bitmask(lg, grammar.tree_bitmask(tree), grammar.vocab_size)

    def _score(self, scheduled: list[ScheduledRequest], segments: list[Segment],
               logits: list[torch.Tensor], hidden: list[torch.Tensor],
               verdicts: list[tuple[ScheduledRequest, TokenTree, Verdict]],
               deltas: list[RequestDelta]) -> None:
        """Log-probabilities where requests asked for them: of prompt tokens from this step's
        hidden rows, of committed tokens from the verify logits (no extra forward). The prompt's
        ride on the request's first delta."""
        for item, seg, hid in zip(scheduled, segments, hidden):
            rows = _prompt_logprob_rows(item.request, seg.start, seg.start + len(seg.token_ids))
            if rows:  # hid holds seg.hidden_rows (a range that includes `rows`)
                offset = seg.hidden_rows.start
                self._score_prompt(item.request, seg.start + rows.start,
                                   hid[rows.start - offset:rows.stop - offset])
        verify_logits = {item.request.request_id: lg for item, lg in zip(scheduled, logits)}
        scored = []  # (request, its delta, verify logits rows of its committed tokens)
        for (item, _, verdict), delta in zip(verdicts, deltas):
            req = item.request
            if req.logprobs is not None:
                # Each committed token is scored from its parent's row: root, accepted nodes.
                rows = ([0] + verdict.accepted)[:len(delta.token_ids)]
                scored.append((req, delta, verify_logits[req.request_id][rows]))
            if req.prompt_logprobs is not None and \
                    len(req.output_token_ids) == len(delta.token_ids):  # the first delta
                delta.prompt_logprobs = req.prompt_logprobs
        if scored:
            self._score_outputs(scored)

    def _score_prompt(self, req: Request, first_row: int, hidden: torch.Tensor) -> None:
        """Prompt log-probabilities of the tokens that the hidden rows [n, H] of positions
        first_row, +1, ... predict."""
        first = first_row + 1  # the first prompt token scored
        targets = req.prompt_token_ids[first:first + len(hidden)]
        req.prompt_logprobs += chunked_token_logprobs(hidden, targets, req.params.prompt_logprobs,
                                                      self.runner.logits)

    def _score_outputs(self, scored: list[tuple[Request, RequestDelta, torch.Tensor]]) -> None:
        """Log-probabilities of every token committed this step, in one call."""
        rows = torch.cat([lg for _, _, lg in scored])  # [committed tokens, V]
        token_ids = [t for _, delta, _ in scored for t in delta.token_ids]
        counts = [req.params.logprobs for req, delta, _ in scored for _ in delta.token_ids]
        logprobs = iter(token_logprobs(rows, token_ids, counts))
        for req, delta, _ in scored:
            delta.logprobs = [next(logprobs) for _ in delta.token_ids]
            req.logprobs += delta.logprobs

    def _commit(self, item: ScheduledRequest, tree: TokenTree, verdict: Verdict,
                mode: SpecMode, now: float) -> RequestDelta:
        """Apply one verdict: KV into place, counters, tokens, then finish or cache blocks."""
        req = item.request
        draft_kv = self._keep_accepted_kv(item, tree, verdict, mode)
        req.kv.step_committed(item.num_new_tokens, len(verdict.accepted), draft_kv)
        self._count_verdict(item, tree, verdict, mode)
        committed = self._commit_tokens(req, tree, verdict)
        return self._emit(req, committed, len(verdict.accepted), now)

    def _keep_accepted_kv(self, item: ScheduledRequest, tree: TokenTree, verdict: Verdict,
                          mode: SpecMode) -> int | None:
        """Move the accepted path's KV behind the root in the target cache and, through the
        proposer, in the draft cache; return the draft KV length (None: unchanged)."""
        if len(tree) == 1:
            return None
        req = item.request
        root = req.num_computed_tokens + item.num_new_tokens - 1
        self.runner.move_kv([(req.block_table, root + node, root + depth)
                             for depth, node in enumerate(verdict.accepted, start=1)])
        proposer = self._proposer_for(mode)
        return proposer.after_verify(req.block_table, root, tree, verdict) if proposer else None

    def _count_verdict(self, item: ScheduledRequest, tree: TokenTree, verdict: Verdict,
                       mode: SpecMode) -> None:
        req, accepted = item.request, verdict.accepted
        if len(tree) > 1:
            _count_draft(req.spec, self.stats, len(tree) - 1, len(accepted),
                         max(node_depths(tree.parents)))
        configured = self._configured_mode(req)
        # The controller learns the draft model's acceptance: not from suffix steps.
        adaptive = configured.is_adaptive or (configured.fallback is not None
                                              and configured.fallback.is_adaptive)
        if item.num_new_tokens == 1 and adaptive and mode.kind is not SpecKind.SUFFIX:
            self.adaptive.observe_verdict(req.request_id, len(tree) - 1, len(accepted))
        elif adaptive and mode.kind is SpecKind.SUFFIX and len(tree) > 1:
            # The store's acceptance by match length sizes its later trees (suffix_nodes).
            match = self.suffix.lookup(req.request_id, req.all_token_ids)
            self.adaptive.observe_suffix(match.match_length, max(node_depths(tree.parents)),
                                         len(accepted))
        req.spec.num_target_steps += 1

    def _commit_tokens(self, req: Request, tree: TokenTree, verdict: Verdict) -> list[int]:
        """The accepted tokens and the bonus/recovered one, up to the first stop condition."""
        committed = []
        grammar = self._grammar.get(req.request_id)
        for token in [tree.tokens[n] for n in verdict.accepted] + [verdict.next_token]:
            committed.append(token)
            done = req.append_token(token)
            if grammar is not None and grammar.commit(token) and not done:
                req.finish("stop")  # the grammar's stop token under ignore_eos: output done
                done = True
            if done:
                break
        self.stats.num_generation_tokens += len(committed)
        return committed

    def _emit(self, req: Request, committed: list[int], num_accepted: int,
              now: float) -> RequestDelta:
        """The step's delta; a finished request leaves the engine and frees its blocks, a
        running one offers its newly full blocks to the prefix cache."""
        if req.first_token_time is None:
            req.first_token_time = now
        delta = RequestDelta(req.request_id, committed, "",
                             num_draft_accepted=min(num_accepted, len(committed)), time=now)
        if req.is_finished:
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            self._forget(req)
            self.stats.num_finished += 1
            delta.finish_reason = req.finish_reason
            delta.metrics = req.metrics()
        else:
            self.scheduler.cache_full_blocks(req)
        delta.text = req.take_text_delta()
        return delta

    def _forget(self, req: Request) -> None:
        """A request left the engine: drop what adaptive speculation and the draft keep of it;
        its text stays in the suffix store for later requests."""
        self.adaptive.forget(req.request_id)
        self._grammar.pop(req.request_id, None)
        self.suffix.finish(req.request_id, req.all_token_ids)
        self._forget_target_hidden(req)

    def _forget_target_hidden(self, req: Request) -> None:
        if self.proposer is not None:
            self.proposer.forget(req.request_id)

    def _record_step(self, scheduled: list[ScheduledRequest], timer: _StepTimer,
                     segments: list[Segment], draft: Proposal | None) -> None:
        """Step timings into the engine and request counters and the adaptive cost model."""
        laps, stats = timer.laps, self.stats
        for item in scheduled:
            item.request.spec.draft_time_s += laps["draft"]
            item.request.spec.target_forward_time_s += laps["target_forward"]
        stats.num_steps += 1
        for phase, seconds in laps.items():
            setattr(stats, f"{phase}_time_s", getattr(stats, f"{phase}_time_s") + seconds)
        # A verified row costs beyond the target forward too (its logits checked, its KV moved
        # on acceptance): the chain's cost model sees the whole step outside drafting, of steps
        # whose rows are all decode and verify rows (a prompt's rows cost what they cost in
        # the prompt's products, not what a verified row adds).
        decoding = all(item.num_new_tokens == 1 for item in scheduled)
        self.adaptive.observe_step(laps["schedule"] + laps["target_forward"] + laps["verify"]
                                   + laps["commit"],
                                   sum(len(seg.token_ids) for seg in segments) if decoding
                                   else None,
                                   draft.levels_time_s if draft else 0.0,
                                   draft.num_levels if draft else 0)


class _StepTimer:
    """Wall time of a step's phases, in order."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = now - self._last
        self._last = now


def _prompt_logprob_rows(req: Request, start: int, end: int) -> range:
    """Local rows of a chunk at positions [start, end) that predict prompt tokens whose
    log-probabilities are asked for and not yet computed (empty if none)."""
    if not req.needs_prompt_logprobs:
        return range(0)
    first = max(start, len(req.prompt_logprobs) - 1)
    return range(first - start, max(first, min(end, len(req.prompt_token_ids) - 1)) - start)


def _proposer_input(item: ScheduledRequest, mode: SpecMode,
                    grammar: RequestGrammar | None) -> ProposerInput:
    req = item.request
    return ProposerInput(req.request_id, req.all_token_ids, req.block_table, req.params,
                         req.generator, req.num_computed_tokens, req.num_draft_computed,
                         item.num_new_tokens, req.is_decoding, req.remaining_tokens,
                         item.num_spec_slots, mode, grammar)


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
    target_vocab, draft_vocab = tokenizer.get_vocab(), load_tokenizer(draft).get_vocab()
    if draft_vocab != target_vocab:
        # The first ids where they part: what a user needs to see that these are two families.
        target_tokens = {i: t for t, i in target_vocab.items()}
        draft_tokens = {i: t for t, i in draft_vocab.items()}
        differ = sorted(i for i in target_tokens.keys() | draft_tokens.keys()
                        if target_tokens.get(i) != draft_tokens.get(i))[:3]
        examples = ", ".join(f"id {i}: target {target_tokens.get(i)!r}, draft "
                             f"{draft_tokens.get(i)!r}" for i in differ)
        raise ValueError(f"draft {draft} ({len(draft_vocab)} tokens) and target {target} "
                         f"({len(target_vocab)} tokens) have different vocabularies ({examples}); "
                         f"speculation needs one shared vocabulary")
