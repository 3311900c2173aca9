"""What the engine hands back: per-step deltas for streams, whole outputs for `LLM.generate`."""

from __future__ import annotations

from dataclasses import dataclass, field


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
