"""A CPU model's weights moved into transparent huge pages (Linux, 2 MiB pages).

A decode or verify step reads every weight once. In 4 KiB pages that is a TLB miss every 4 KiB
of weights (in a virtual machine a two-level page walk), which the matrix kernels pay on top of
their arithmetic. On a 2-core Zen 3 VM, best of 21, the widened model's 24 layers of products:
1 row 25.7 -> 24.5 ms, 5 rows 37.7 -> 34.3 ms; its whole forward 1.04x (1 row) and 1.05x
(5 rows) faster (`python -m bench kernels --pages 4k,2m`).

`move_to_huge_pages` copies every parameter and buffer of a CPU model into one anonymous
mapping advised MADV_HUGEPAGE (what `/sys/kernel/mm/transparent_hugepage/enabled` = madvise, the
common default, asks for) and points the module's tensors at it, through `Module._apply`, so the
modules that keep views of their tensors (the C decoder stack, quantized weights) refresh them.
Tensors a module shares stay shared; tensors already in such a mapping (a draft's embeddings
shared with its target) stay where they are. The kernel may still hand out 4 KiB pages (no free
2 MiB ones): the values are the same either way, only the speed differs.

`SPECSERVE_HUGE_PAGES=0` keeps the weights where the loader put them.
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref
from functools import cache

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line

# (start, end) addresses of the live mappings made here: their tensors are not moved again.
_arenas: list[tuple[int, int]] = []


def enabled() -> bool:
    """False when SPECSERVE_HUGE_PAGES=0 (checked: 0 or 1) or where madvise has no huge pages."""
    value = os.environ.get("SPECSERVE_HUGE_PAGES", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"SPECSERVE_HUGE_PAGES={value!r}: expected 0 or 1")
    return value == "1" and _can_advise()


@cache
def _can_advise() -> bool:
    """Linux with transparent huge pages built in (madvise refuses MADV_HUGEPAGE otherwise)."""
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    probe = mmap.mmap(-1, HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        probe.madvise(mmap.MADV_HUGEPAGE)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def in_huge_pages(t: torch.Tensor) -> bool:
    """Whether t's memory lies in a mapping made by move_to_huge_pages."""
    start = t.data_ptr()
    return any(lo <= start < hi for lo, hi in _arenas)


def move_to_huge_pages(model: nn.Module) -> int:
    """Move the CPU model's parameters and buffers into one huge-page mapping; returns the
    bytes moved (0 when disabled, or when nothing is on the CPU or left to move)."""
    if not enabled():
        return 0
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())
               if t.device.type == "cpu" and t.numel() > 0 and not in_huge_pages(t)}
    offsets, total = {}, 0
    for ptr, t in tensors.items():
        offsets[ptr] = total
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if total == 0:
        return 0
    arena = _huge_page_buffer(total)
    moved: dict[int, torch.Tensor] = {}

    def place(t: torch.Tensor) -> torch.Tensor:
        ptr = t.data_ptr()
        if ptr not in offsets:  # moved already (shared by two modules), or left where it is
            return moved.get(ptr, t)
        if ptr not in moved:
            nbytes = t.numel() * t.element_size()
            view = arena[offsets[ptr]:offsets[ptr] + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t.detach())
            moved[ptr] = view
        return moved[ptr]

    with torch.no_grad():
        model._apply(place)
    return total


def _huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor [nbytes] starting on a 2 MiB boundary inside a fresh anonymous private
    mapping advised MADV_HUGEPAGE; the mapping lives as long as a tensor viewing it."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # views of it hold the mapping
    span = (whole.data_ptr(), whole.data_ptr() + len(whole))
    _arenas.append(span)
    weakref.finalize(mapping, _arenas.remove, span)  # unmapped: the addresses may be reused
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]
