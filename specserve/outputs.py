"""What the engine hands back: per-step deltas for streams, whole outputs for `LLM.generate`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The target's log-probability of one token at one position, and the likeliest tokens there.

    Raw model log-probabilities (log_softmax of the target's logits), before temperature, top-k
    or top-p: what vLLM returns by default, and the same whatever the request samples with.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # [(token_id, logprob)], likeliest first; as many as asked


@dataclass
class RequestDelta:
    """One request's news from one engine step (what a stream yields)."""

    request_id: str
    token_ids: list[int]  # tokens committed this step
    text: str  # text that became final this step (UTF-8 safe, stop strings held back)
    num_draft_accepted: int = 0  # how many of token_ids were accepted draft tokens
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    metrics: dict | None = None  # the request's final metrics, with the last delta
    error: str | None = None  # set when a step failed for this request
    time: float = 0.0  # monotonic time the tokens were committed
    logprobs: list[TokenLogprob] | None = None  # one per token_ids, when the request asked
    # With the first delta, when the request asked: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated only
    text: str
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token
