"""Each Triton kernel against its PyTorch reference: under the interpreter and on the GPU.

The `device` fixture (conftest.py) runs every test twice: on CPU tensors with TRITON_INTERPRET=1,
and compiled on CUDA (marked `gpu`, skipped without a device). Interpreter cases are kept small;
the grid pairs head dims, GQA ratios and dtypes so each value of each axis appears with both
dtypes, rather than taking the full product.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import (
    STATIC_TREE,
    PagedBatch,
    causal,
    chain_mask,
    make_batch,
    random_tree_mask,
    tree_mask_from_paths,
)

pytest.importorskip("triton")

from specserve.kernels import copy_kv_slots, paged_attention, store_kv  # noqa: E402
from specserve.kernels.attention import paged_attention_triton  # noqa: E402
from specserve.kernels.kv_store import copy_kv_slots_triton, store_kv_triton  # noqa: E402
from specserve.kernels.reference import (  # noqa: E402
    copy_kv_slots_reference,
    paged_attention_reference,
    store_kv_reference,
)
from specserve.speculation.tree import STATIC_TREES  # noqa: E402

DECODE = torch.ones(1, 1, dtype=torch.bool)
NO_QUERIES = torch.ones(0, 0, dtype=torch.bool)  # a request with nothing scheduled this step

# (head_dim, num_q_heads, num_kv_heads, dtype): GQA ratios 1, 4 and 8.
SHAPES = [
    (64, 2, 2, torch.float32),
    (128, 2, 2, torch.bfloat16),
    (64, 8, 2, torch.bfloat16),
    (128, 4, 1, torch.float32),
    (64, 8, 1, torch.float32),
    (128, 16, 2, torch.bfloat16),
]
SHAPE_IDS = [f"d{d}-h{hq}/{hkv}-{str(dt)[6:]}" for d, hq, hkv, dt in SHAPES]


def tolerance(dtype: torch.dtype) -> dict:
    # bf16: one rounding of the output (~4e-3 relative) plus probabilities rounded to bf16
    # before the P @ V product, which the reference (fp32 throughout) does not do.
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 3e-2, "rtol": 2e-2}


def check_attention(batch: PagedBatch, device: str, num_splits: int | None) -> None:
    expected = paged_attention_reference(*batch.args())  # [T, Hq, D]
    out = paged_attention_triton(*batch.to(device).args(), num_splits=num_splits)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), expected, **tolerance(batch.q.dtype))


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_mixed_batch(device: str, shape: tuple, num_splits: int | None):
    """Prompt chunk after cached tokens, every tree kind, a decode token, an idle request."""
    head_dim, num_q_heads, num_kv_heads, dtype = shape
    gen = torch.Generator().manual_seed(1)
    requests = [
        (37, causal(20)),
        (50, tree_mask_from_paths(STATIC_TREE)),
        (70, DECODE),
        (12, NO_QUERIES),
        (33, random_tree_mask(9, gen)),
        (16, chain_mask(5)),
    ]
    batch = make_batch(
        requests, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=dtype,
    )
    check_attention(batch, device, num_splits)


@pytest.mark.parametrize("tree", ["chain", "static", "shipped-medium", "dynamic"])
def test_tree_verify(device: str, tree: str):
    """Tree buffers (speculation.tree) over a context crossing many pages, split-K on."""
    gen = torch.Generator().manual_seed(2)
    mask = {
        "chain": chain_mask(8),
        "static": tree_mask_from_paths(STATIC_TREE),
        "shipped-medium": tree_mask_from_paths(STATIC_TREES["medium"]),
        "dynamic": random_tree_mask(32, gen),
    }[tree]
    batch = make_batch(
        [(150, mask), (21, mask)], num_q_heads=8, num_kv_heads=2, head_dim=64,
        dtype=torch.bfloat16,
    )
    check_attention(batch, device, num_splits=2)


@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode(device: str, shape: tuple, num_splits: int | None):
    """One query per request; contexts from empty to 21 pages, page boundaries included."""
    head_dim, num_q_heads, num_kv_heads, dtype = shape
    requests = [(ctx, DECODE) for ctx in (0, 15, 16, 47, 333)]
    batch = make_batch(
        requests, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=dtype, seed=3,
    )
    check_attention(batch, device, num_splits)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_prefill(device: str, shape: tuple):
    """Causal varlen chunks (local_mask=None): after cached tokens, fresh, several tiles long."""
    head_dim, num_q_heads, num_kv_heads, dtype = shape
    requests = [(40, causal(70)), (0, causal(45)), (5, causal(1))]
    batch = make_batch(
        requests, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=dtype, seed=4, causal_as_none=True,
    )
    check_attention(batch, device, num_splits=None)


def test_public_api_dispatches_to_triton(device: str):
    batch = make_batch(
        [(20, causal(3)), (9, DECODE)], num_q_heads=4, num_kv_heads=2, head_dim=64, seed=5
    )
    on_device = batch.to(device)
    out = paged_attention(*on_device.args(), impl="triton")
    torch.testing.assert_close(out.cpu(), paged_attention_reference(*batch.args()))
    if device == "cuda":  # "auto" picks Triton on CUDA
        torch.testing.assert_close(paged_attention(*on_device.args()), out, atol=0, rtol=0)


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float32), (128, torch.bfloat16)])
def test_store_kv(device: str, head_dim: int, dtype: torch.dtype):
    kv_cache = torch.randn(2, 2, 9, 16, 2, head_dim).to(dtype)  # [L, 2, blocks, 16, Hkv, D]
    key = torch.randn(40, 2, head_dim).to(dtype)  # [T, Hkv, D]
    value = torch.randn(40, 2, head_dim).to(dtype)  # [T, Hkv, D]
    slots = torch.randperm(9 * 16)[:40]  # [T]
    slots[::7] = -1  # padding tokens
    expected = kv_cache.clone()
    store_kv_reference(key, value, expected[1, 0], expected[1, 1], slots)
    kv_dev = kv_cache.to(device)
    store_kv(
        key.to(device), value.to(device), kv_dev[1, 0], kv_dev[1, 1], slots.to(device),
        impl="triton",
    )
    torch.testing.assert_close(kv_dev.cpu(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_kv_slots(device: str, dtype: torch.dtype):
    kv_cache = torch.randn(3, 2, 6, 16, 2, 64).to(dtype)  # [L, 2, blocks, 16, Hkv, D]
    # A path shifted down across a page boundary, a swap, and a three-cycle.
    src = torch.tensor([14, 15, 16, 17, 40, 41, 70, 71, 72])
    dst = torch.tensor([12, 13, 14, 15, 41, 40, 71, 72, 70])
    expected = kv_cache.clone()
    copy_kv_slots_reference(expected, src, dst)
    kv_dev = kv_cache.to(device)
    copy_kv_slots(kv_dev, src.to(device), dst.to(device), impl="triton")
    torch.testing.assert_close(kv_dev.cpu(), expected, atol=0, rtol=0)


def huge_kv_cache(device: str, head_dim: int = 64, block_size: int = 16) -> tuple:
    """A bf16 `[1, 2, num_blocks, 16, 1, D]` cache whose last blocks sit past 2**31 elements.

    K and V are views of one ~4 GiB buffer, V shifted by `spare` blocks, so only the last
    `spare` block ids are safe to use (their K and V do not overlap). On CPU only the touched
    pages become resident.
    """
    block_elems = block_size * head_dim
    spare = 64
    num_blocks = 2**31 // block_elems + spare
    buf = torch.empty((num_blocks + spare) * block_elems, dtype=torch.bfloat16, device=device)
    kv_cache = buf.as_strided(
        (1, 2, num_blocks, block_size, 1, head_dim),
        (buf.numel(), spare * block_elems, block_elems, head_dim, head_dim, 1),
    )
    usable = list(range(num_blocks - spare, num_blocks))
    assert usable[0] * block_elems >= 2**31
    return kv_cache, usable


def test_offsets_past_int32(device: str):
    """Attention (decode and tree shapes), store and copy on blocks past 2**31 elements."""
    kv_cache, usable = huge_kv_cache(device)
    for requests in (
        [(300, DECODE), (200, DECODE)],
        [(250, tree_mask_from_paths(STATIC_TREE)), (90, causal(40))],
    ):
        batch = make_batch(
            requests, num_q_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16,
            kv_cache=kv_cache, block_pool=usable, seed=6,
        )
        on_device = batch.to(device)  # the cache already lives there; the metadata moves
        expected = paged_attention_reference(*on_device.args()).cpu()
        for num_splits in (1, 2):
            out = paged_attention_triton(*on_device.args(), num_splits=num_splits)
            torch.testing.assert_close(out.cpu(), expected, **tolerance(torch.bfloat16))

    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    slots = torch.tensor(usable[-3:]).repeat_interleave(16) * 16 + torch.arange(16).repeat(3)
    slots = slots.to(device)  # [48] the last three blocks
    key = torch.randn(48, 1, 64, dtype=torch.bfloat16, device=device)  # [T, 1, D]
    value = torch.randn(48, 1, 64, dtype=torch.bfloat16, device=device)  # [T, 1, D]
    store_kv_triton(key, value, k_cache, v_cache, slots)
    blocks, offsets = slots // 16, slots % 16
    torch.testing.assert_close(k_cache[blocks, offsets], key, atol=0, rtol=0)
    torch.testing.assert_close(v_cache[blocks, offsets], value, atol=0, rtol=0)

    # Move the last block's K/V one block down (the K and V views overlap, so the expectation is
    # read from the cache itself rather than computed by the reference on it).
    src, dst = slots[-16:], slots[-16:] - 16
    copy_kv_slots_triton(kv_cache, src, dst)
    torch.testing.assert_close(k_cache[dst // 16, dst % 16], key[-16:], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[dst // 16, dst % 16], value[-16:], atol=0, rtol=0)


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    batch = make_batch([(3, DECODE)], num_q_heads=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_attention(*batch.args(), impl="triton")
    # "auto" on CPU tensors is the reference, interpreter or not.
    torch.testing.assert_close(
        paged_attention(*batch.args()), paged_attention_reference(*batch.args())
    )
