"""A pipeline stage's links: where its commands come from, where they and its hidden states go,
and where the last stage's results go back to.

Rank (k, j) (stage k, tensor-parallel rank j) hears from (k - 1, j) and passes on to (k + 1, j):
every rank of a stage holds the whole hidden states after its layers' all-reduces, so each sends
its own copy and no stage gathers or scatters. The last stage's TP rank 0 sends each forward's
logits [R, vocab] (float32) and requested hidden rows [Hr, H] back to rank 0, the driver.
Nothing on a link carries a pickle: the header is a fixed-size int64 tensor, and every shape
after it follows from the header and the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import (
    PipelineStage,
    layout,
    recv_header,
    recv_into,
    recv_payload,
    send_async,
    send_header,
    this_rank,
)

DRIVER = 0  # the global rank that runs the engine


@dataclass(frozen=True)
class StageLink:
    prev: int | None  # global rank this one hears from (None: stage 0, told by the control group)
    next: int | None  # global rank it passes on to (None: the last stage)
    returns_results: bool  # the last stage's TP rank 0: results go back to the driver
    last: int  # global rank that returns results (rank 0's side of the link)

    @classmethod
    def here(cls, stage: PipelineStage) -> StageLink:
        grid, rank = layout(), this_rank()
        j = grid.tp_rank_of(rank)
        return cls(prev=None if stage.is_first else grid.rank(stage.index - 1, j),
                   next=None if stage.is_last else grid.rank(stage.index + 1, j),
                   returns_results=stage.is_last and j == 0,
                   last=grid.rank(stage.num_stages - 1, 0))

    # ---- downstream ----------------------------------------------------------------------
    def pass_on(self, header: list[int], payload: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> None:
        """Send a command (and the hidden states that go with it) to the next stage."""
        if self.next is None:
            return
        send_header(header, self.next, payload)
        if hidden is not None:
            send_async(hidden, self.next)

    def return_result(self, x: torch.Tensor) -> None:
        """The last stage: one result tensor back to the driver (nothing when empty)."""
        if self.returns_results and x.numel():
            send_async(x, DRIVER)

    # ---- upstream ------------------------------------------------------------------------
    def header(self) -> list[int]:
        return recv_header(self.prev)

    def payload(self, length: int) -> torch.Tensor:
        return recv_payload(self.prev, length)

    def hidden(self, rows: int, width: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """The previous stage's hidden states [rows, width]."""
        return recv_into(torch.empty(rows, width, dtype=dtype, device=device), self.prev)

    # ---- the driver ------------------------------------------------------------------------
    def result(self, rows: int, width: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """Rank 0: the last stage's next result [rows, width] (no transfer when empty)."""
        out = torch.empty(rows, width, dtype=dtype, device=device)
        return recv_into(out, self.last) if out.numel() else out
