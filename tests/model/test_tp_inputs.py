"""What rank 0 broadcasts for one forward: `StepInputs` survive the trip through one int64
payload, with and without a tree mask."""

from __future__ import annotations

import torch

from specserve.model.loader import load_model
from specserve.model.runner import ModelRunner, Segment, StepInputs


def _roundtrip(inputs: StepInputs) -> StepInputs:
    header = inputs.header()
    payload = inputs.payload()
    assert payload.dtype == torch.int64 and len(payload) == StepInputs.payload_len(header)
    return StepInputs.unpack(header, payload.clone())


def _assert_same(a: StepInputs, b: StepInputs) -> None:
    for name in ("token_ids", "positions", "slot_mapping", "block_tables", "query_start_loc",
                 "context_lens", "logit_rows"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.max_query_len == b.max_query_len
    assert (a.local_mask is None) == (b.local_mask is None)
    if a.local_mask is not None:
        assert a.local_mask.dtype == b.local_mask.dtype == torch.bool
        assert torch.equal(a.local_mask, b.local_mask)


def test_step_inputs_roundtrip(tiny_target):
    runner = ModelRunner(load_model(tiny_target), num_blocks=8, block_size=4)
    prompt = Segment(list(range(10, 19)), range(9), 0, [3, 5, 1], [8])
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = Segment([7, 8, 9], [5, 6, 6], 5, [2, 4], [0, 1, 2], tree_mask)
    decode = Segment([42], [3], 3, [6], [])
    causal = runner.prepare([prompt, decode])
    assert causal.local_mask is None
    _assert_same(causal, _roundtrip(causal))
    masked = runner.prepare([prompt, tree, decode])
    assert masked.local_mask.shape == (13, 9)
    _assert_same(masked, _roundtrip(masked))
    # The worker runs exactly what rank 0 runs: same logits from the unpacked inputs.
    fresh = ModelRunner(load_model(tiny_target), num_blocks=8, block_size=4)
    assert torch.equal(runner.execute(masked), fresh.execute(_roundtrip(masked)))
