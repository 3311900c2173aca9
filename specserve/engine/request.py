"""One request's state as the engine sees it: tokens, KV progress, stop conditions, metrics.

There is no prefill or decode phase. A request has tokens (prompt + output so far) and
`num_computed_tokens` of them have KV in the target cache; the scheduler schedules the
difference. During decoding the difference is exactly one token: the last one committed, which
is also the root of the next token tree. `KVProgress` is the one writer of how far the target
and draft KV reach.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..outputs import TokenLogprob
from ..sampling import SamplingParams, make_generator
from .detokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation counters of one request (same meaning as the engine-wide ones)."""

    num_drafts: int = 0  # steps in which a token tree was verified
    num_draft_tokens: int = 0  # tree nodes proposed, root excluded
    num_accepted_tokens: int = 0  # draft tokens committed
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at depth 1, 2, ...
    drafted_per_pos: list[int] = field(default_factory=list)  # drafts reaching depth 1, 2, ...
    num_target_steps: int = 0  # target forwards that committed tokens for this request
    # Time of the draft and target-forward stages of the steps this request took part in.
    draft_time_s: float = 0.0
    target_forward_time_s: float = 0.0


class KVProgress:
    """How many of a request's tokens have KV in the target cache and in the draft cache.

    The only place either count changes. Within one step the order is:
    1. `draft_reached(n)`: the proposer's catch-up forward wrote draft KV up to n tokens;
    2. after the target forward, either `prompt_chunk_computed(n)` (no logits wanted) or
    3. `step_committed(...)`: verification chose the accepted path, both caches' KV for it has
       been moved into place (the proposer reports the draft's new length), and the target count
       advances past the root and the accepted tokens.
    `restart(n)` sets both after admission (n prefix-cache hits) or preemption (0).
    """

    __slots__ = ("target", "draft")

    def __init__(self) -> None:
        self.target = 0  # target KV
        self.draft = 0  # draft KV (lags the target by at most a step)

    def restart(self, num_cached: int) -> None:
        self.target = self.draft = num_cached

    def draft_reached(self, num_tokens: int) -> None:
        self.draft = num_tokens

    def prompt_chunk_computed(self, num_new_tokens: int) -> None:
        self.target += num_new_tokens

    def step_committed(self, num_new_tokens: int, num_accepted: int,
                       draft_after_verify: int | None) -> None:
        """`draft_after_verify`: the draft's KV length once its accepted path moved into place
        (None: this step's proposer keeps no draft KV)."""
        self.target += num_new_tokens + num_accepted
        if draft_after_verify is not None:
            self.draft = draft_after_verify


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int], tokenizer=None, speculation=None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.speculation = speculation  # a parsed per-request override, or None for the engine's
        self.eos_token_ids = eos_token_ids
        self.generator: torch.Generator = make_generator(params.seed)
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None

        self.block_table: list[int] = []
        self.kv = KVProgress()
        self.block_hashes: list[int] = []  # chained hashes of the full committed blocks so far
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.num_prefix_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        # Disaggregated prefill: on a prefill server, keep the blocks once finished until the
        # decode server has read them; on a decode server, how long the KV transfer took.
        self.kv_hold = False
        self.kv_transfer_ms: float | None = None

        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids)
                            if tokenizer else None)
        self.output_text = ""
        self.num_emitted_chars = 0
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

        # The target's log-probabilities, when asked for: one per output token, and one per
        # prompt token (None for the first, which nothing predicts), filled in as computed.
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None)

        self.spec = SpecStats()
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # ---- tokens ---------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose target KV is in place."""
        return self.kv.target

    @property
    def num_draft_computed(self) -> int:
        """Tokens whose draft KV is in place."""
        return self.kv.draft

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last committed token (the next tree's root) lacks KV."""
        return bool(self.output_token_ids) and self.num_uncomputed == 1

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities are asked for and not all computed yet."""
        done = self.prompt_logprobs
        return done is not None and len(done) < len(self.prompt_token_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> bool:
        """Commit one token and apply the stop conditions; True when the request is now done.

        Called once per committed token, so a step that accepts several tokens stops exactly at
        EOS, max_tokens or the end of a stop string, and nothing after it is committed.
        """
        self.output_token_ids.append(token_id)
        if self.detokenizer is not None:
            self.output_text += self.detokenizer.push(token_id)
            if self.params.stop and self._apply_stop_strings():
                return True
        if token_id in self.eos_token_ids and not self.params.ignore_eos:
            self.finish("stop")
        elif len(self.output_token_ids) >= self.params.max_tokens:
            self.finish("length")
        return self.is_finished

    def _apply_stop_strings(self) -> bool:
        # Only the tail can contain a new match: the text before it was checked already.
        window_start = max(0, self.num_emitted_chars - self._holdback)
        hits = [i for s in self.params.stop
                if (i := self.output_text.find(s, window_start)) >= 0]
        if not hits:
            return False
        self.output_text = self.output_text[:min(hits)]
        self.finish("stop", flush=False)  # the text ends where the stop string began
        return True

    def take_text_delta(self) -> str:
        """Text not yet streamed, holding back a tail that could still become a stop string."""
        end = len(self.output_text)
        if self.params.stop and not self.is_finished:
            end = max(self.num_emitted_chars, end - self._holdback)
        delta = self.output_text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta

    def finish(self, reason: str, flush: bool = True) -> None:
        """End the request. Its text then ends as a decode of all its tokens does: bytes held
        back for an incomplete character come out as U+FFFD (unless `flush` is False: a stop
        string cut the text)."""
        if flush and self.detokenizer is not None:
            self.output_text += self.detokenizer.flush()
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finished_time = time.monotonic()

    # ---- metrics --------------------------------------------------------------------------
    def metrics(self) -> dict:
        end = self.finished_time or time.monotonic()
        spec = self.spec
        steps = spec.num_target_steps
        # Tokens per target forward while decoding; the forward that finished the prompt
        # commits one token whatever the speculation, so it is left out.
        decode_steps = steps - 1
        return {
            "acceptance_length": ((len(self.output_token_ids) - 1) / decode_steps
                                  if decode_steps > 0 else 1.0),
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "accepted_per_pos": list(spec.accepted_per_pos),
            # Of the drafts that reached depth d, the share whose depth-d token was accepted.
            "acceptance_rate_per_pos": [a / n for a, n in zip(
                spec.accepted_per_pos + [0] * len(spec.drafted_per_pos), spec.drafted_per_pos)],
            "draft_time_s": spec.draft_time_s,
            "target_forward_time_s": spec.target_forward_time_s,
            "num_target_steps": steps,
            "num_prompt_tokens": len(self.prompt_token_ids),
            "num_output_tokens": len(self.output_token_ids),
            "num_prefix_cached_tokens": self.num_prefix_cached_tokens,
            "num_preemptions": self.num_preemptions,
            "queue_s": (self.first_scheduled_time or end) - self.arrival_time,
            "ttft_s": (self.first_token_time or end) - self.arrival_time,
            "e2e_s": end - self.arrival_time,
            **({"kv_transfer_ms": self.kv_transfer_ms} if self.kv_transfer_ms is not None
               else {}),
        }
