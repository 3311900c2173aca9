"""`sampling.argmax_rows`: what greedy verification and the draft's greedy picks read, equal to
torch.argmax on every kind of row (numpy's argmax on CPU float tensors)."""

from __future__ import annotations

import torch

from specserve.sampling import argmax_rows


def test_equals_torch_argmax_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 49152), (5, 1000), (3, 7)]:
        x = torch.randn(*shape, generator=gen)
        assert argmax_rows(x) == x.argmax(-1).tolist()


def test_ties_nans_and_masked_rows_read_as_torch_reads_them():
    x = torch.full((4, 16), float("-inf"))  # [4, 16]
    x[0, 3] = x[0, 9] = 2.0  # a tie: the first maximum
    x[1, 5] = float("nan")  # a NaN counts as the maximum
    x[1, 7] = float("nan")
    x[2, :] = 0.0  # all equal
    # row 3: every token masked (-inf everywhere)
    assert argmax_rows(x) == x.argmax(-1).tolist() == [3, 5, 0, 0]


def test_strided_and_other_dtypes_fall_back_or_read_right():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    assert argmax_rows(x[:, ::3]) == x[:, ::3].argmax(-1).tolist()  # non-contiguous
    assert argmax_rows(x.to(torch.bfloat16)) == x.to(torch.bfloat16).argmax(-1).tolist()
    assert argmax_rows(x.double()) == x.argmax(-1).tolist()
    assert argmax_rows(torch.empty(0, 40)) == []
