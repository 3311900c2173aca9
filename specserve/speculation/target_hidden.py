"""The target's final hidden states an EAGLE-style draft has yet to read, per request.

Such a draft computes position p from token p and the target's hidden state at p - 1 (the state
the target predicted token p from). The target writes those rows in its own forwards (prompt
chunks, then the root and accepted nodes of each verified tree); the draft reads them when it
catches up, one or more steps later, and the rows it no longer needs are dropped.

Rows the target never computed read as zeros: position 0 has no previous position, and after a
prefix-cache hit of c tokens the target's state at c - 1 was computed by an earlier request.
A zero row costs the draft some accuracy at that one position, never correctness: the target
verifies every drafted token.
"""

from __future__ import annotations

import torch


class TargetHiddenStore:
    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        # request id -> (position of the first row, rows [n, H] for consecutive positions)
        self._rows: dict[str, tuple[int, torch.Tensor]] = {}

    def record(self, request_id: str, first_position: int, hidden: torch.Tensor) -> None:
        """The target's hidden states [n, H] at positions first_position, +1, ... . A position
        at or before the stored ones (a recomputation after preemption) replaces them."""
        hidden = hidden.detach().float()
        start, rows = self._rows.get(request_id, (first_position, hidden[:0]))
        if not start <= first_position <= start + len(rows):
            start, rows = first_position, hidden[:0]
        self._rows[request_id] = (start, torch.cat([rows[:first_position - start], hidden]))

    def reach(self, request_id: str) -> int:
        """How many tokens the draft can have KV for: position p needs the row of p - 1."""
        start, rows = self._rows.get(request_id, (0, None))
        return 0 if rows is None else start + len(rows) + 1

    def inputs(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """[end - start, H] the rows the draft reads with positions start..end-1 (those of
        positions start-1..end-2), zeros where the target computed none."""
        first, rows = self._rows.get(request_id, (0, torch.zeros(0, self.hidden_size)))
        out = rows.new_zeros(end - start, self.hidden_size)  # on the device the rows are on
        lo, hi = max(start - 1, first), min(end - 1, first + len(rows))
        if lo < hi:
            out[lo - (start - 1):hi - (start - 1)] = rows[lo - first:hi - first]
        return out

    def drop_before(self, request_id: str, position: int) -> None:
        """Forget the rows of positions before `position` (the draft has read them)."""
        if request_id not in self._rows:
            return
        first, rows = self._rows[request_id]
        cut = min(max(0, position - first), len(rows))
        self._rows[request_id] = (first + cut, rows[cut:])

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)
