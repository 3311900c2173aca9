"""Paged attention and the KV store on CPU through the C kernels in `cpu_attention.c` (any ISA
of cpu_build).

Same arguments and result as `paged_attention_reference` and `store_kv_reference`, for bf16 or
fp32 tensors; the dispatcher in `__init__.py` sends CPU calls here when the kernel library is
built. `paged_attention_cpu` also takes a sliding window (the rows' positions beside it): the
mask of `masked_attention` in specserve/model/attention.py, its reference. At decode the
reference store is a handful of indexing ops (~85 us per layer on a 2-core Zen 3), the kernel
one copy per row.
"""

from __future__ import annotations

import torch

from .cpu_build import library


def unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the C kernel cannot take these inputs, or None when it can."""
    if library() is None:
        return "no CPU kernel library (SPECSERVE_CPU_ISA=torch or no C compiler)"
    if not all(t.device.type == "cpu" for t in (q, k_cache, v_cache)):
        return "the CPU kernel takes CPU tensors"
    if not (q.dtype == k_cache.dtype == v_cache.dtype
            and q.dtype in (torch.bfloat16, torch.float32)):
        return "the CPU kernel takes bf16 or fp32 queries and caches, all of one dtype"
    if q.shape[-1] != k_cache.shape[-1] or q.shape[-1] % 16:
        return f"head_dim {q.shape[-1]} must match the cache's and be a multiple of 16"
    if q.shape[1] % k_cache.shape[2] or k_cache.shape != v_cache.shape:
        return "query heads must be a multiple of the cache's KV heads, K and V alike"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "the CPU kernel needs contiguous K and V caches"
    return None


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return unsupported(q, k_cache, v_cache) is None


def kernel_metadata(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    context_lens: torch.Tensor, local_mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The attention metadata as the C kernel reads it: block tables, query starts and context
    lengths contiguous int32, the mask contiguous bool (1 byte each) or None."""
    return (block_tables.to(torch.int32).contiguous(), query_start_loc.to(torch.int32).contiguous(),
            context_lens.to(torch.int32).contiguous(),
            None if local_mask is None else local_mask.to(torch.bool).contiguous())


def paged_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D] bf16 or fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] q's dtype, contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] q's dtype, contiguous
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    local_mask: torch.Tensor | None,  # [T, max_query_len] bool, None = causal
    scale: float,
    max_query_len: int,
    *,
    checked: bool = False,  # the caller found unsupported(q, k_cache, v_cache) None already
    window: int | None = None,  # a query at position p sees keys at positions > p - window
    positions: torch.Tensor | None = None,  # [T] the rows' rotary positions, with a window
) -> torch.Tensor:  # [T, Hq, D] q's dtype
    """Runs once per layer per step: a few attribute checks (once: see `checked`), then one C
    call (no tensor ops beyond the output allocation; each costs microseconds on CPU)."""
    reason = None if checked else unsupported(q, k_cache, v_cache)
    if reason is None and window is not None and (positions is None or window < 1):
        reason = "a sliding window of at least 1, with the rows' positions"
    if reason is not None:
        raise ValueError(f"paged_attention_cpu: {reason}")
    lib = library()
    q = q.contiguous()
    if window is not None:
        positions = positions.to(torch.int64).contiguous()
    tables, starts, contexts, mask = kernel_metadata(block_tables, query_start_loc, context_lens,
                                                     local_mask)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    out = torch.empty_like(q)
    status = lib.paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(q.dtype == torch.float32),
        tables.data_ptr(), tables.shape[1], starts.data_ptr(), contexts.data_ptr(),
        None if mask is None else mask.data_ptr(), 0 if mask is None else mask.shape[1],
        contexts.shape[0], q.shape[1], num_kv_heads, head_dim, block_size, scale,
        None if window is None else positions.data_ptr(), window or 0, out.data_ptr(),
        torch.get_num_threads())
    if status != 0:
        raise MemoryError("paged_attention_cpu: could not allocate its scratch buffers")
    return out


def store_kv_unsupported(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> str | None:
    """Why the C store cannot take these inputs, or None when it can."""
    if library() is None:
        return "no CPU kernel library (SPECSERVE_CPU_ISA=torch or no C compiler)"
    tensors = (key, value, k_cache, v_cache)
    if not (key.dtype in (torch.bfloat16, torch.float32)
            and all(t.device.type == "cpu" and t.dtype == key.dtype for t in tensors)):
        return "the CPU store takes CPU tensors all bf16 or all fp32"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape == v_cache.shape and key.shape == value.shape
            and key.shape[1:] == k_cache.shape[2:]):
        return "K and V rows must match contiguous caches of the same shape"
    rows_ok = all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
                  for t in (key, value))
    if not rows_ok or key.stride(0) != value.stride(0):
        return "each K and V row must be contiguous, K and V rows equally far apart"
    return None


def store_kv_cpu(
    key: torch.Tensor,  # [T, Hkv, D] bf16 or fp32, rows contiguous
    value: torch.Tensor,  # [T, Hkv, D] key's dtype, rows as key's
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] key's dtype, contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] key's dtype, contiguous
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = padding (skipped)
    *,
    checked: bool = False,  # the caller found store_kv_unsupported(...) None already
) -> None:
    reason = None if checked else store_kv_unsupported(key, value, k_cache, v_cache)
    if reason is not None:
        raise ValueError(f"store_kv_cpu: {reason}")
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    row_len = k_cache.shape[2] * k_cache.shape[3]
    if library().store_kv_rows(key.data_ptr(), value.data_ptr(), key.stride(0),
                               k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                               len(slots), row_len, num_slots, key.element_size()) != 0:
        raise IndexError(f"store_kv_cpu: a slot is past the cache's {num_slots} slots")
