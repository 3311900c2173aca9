"""Memory-bandwidth roofline of batch-1 decoding: how close a decode step gets to the memory bus.

The roofline columns of `python -m bench latency`, `decode` and `quant` come from here.

At batch 1 every target forward reads every weight once and does little arithmetic per byte, so
the fastest possible step takes ``weight_bytes / bandwidth`` seconds. The roofline fraction of a
measured decode speed is

    fraction = (weight_bytes / seconds_per_token) / measured_read_bandwidth

with ``seconds_per_token`` measured at batch 1 without speculation (speculation commits more than
one token per weight read, so it can beat the no-speculation roofline; that is its point).

- ``measure_read_bandwidth``: best-of-N ``torch.sum`` over a float32 tensor much larger than the
  last-level cache, in this process with the current torch thread count, so the number is what
  the benchmark's own threads can pull from memory, not the machine's datasheet figure.
- ``weight_bytes``: bytes of weights one forward reads, from the safetensors headers (no tensor
  is loaded). The token embedding is a gather that reads one row; the LM head reads its whole
  matrix. With tied embeddings the one matrix is counted once, as the LM head, plus one row.
  KV-cache reads are not counted (small next to the weights at short contexts).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import torch

# Bytes per element of each safetensors dtype code.
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
             "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best read bandwidth (bytes/s) of ``torch.sum`` over an ``nbytes`` float32 tensor.

    Runs with torch's current thread count; the tensor is freed before returning.
    """
    x = torch.ones(nbytes // 4, dtype=torch.float32)  # touching it once also faults the pages in
    x.sum()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    size = x.numel() * x.element_size()
    del x
    return size / best


def measure_ceilings(isa: str | None = None, threads: int | None = None, repeats: int = 3
                     ) -> dict[str, float]:
    """This CPU's arithmetic ceilings on the isa path (default: the selected one), best of
    `repeats`, on `threads` threads (default: torch's): "fma", fp32 multiply-adds per second at
    the path's vector width, "madd16", int16 multiply-adds per second (the Q16 kernels'
    instruction), and "dot", bf16 multiply-adds per second through the bf16 kernels' dot step
    (VDPBF16PS on avx512); specserve/kernels/cpu_ceiling.c. Empty on the torch path."""
    import ctypes

    from specserve.kernels import cpu_build

    lib = cpu_build.library_for(isa or cpu_build.selected_isa())
    if lib is None:
        return {}
    threads = threads or torch.get_num_threads()
    out = {}
    for name, sink in (("fma", ctypes.c_float(0)), ("madd16", ctypes.c_int32(0)),
                       ("dot", ctypes.c_float(0))):
        probe = getattr(lib, f"ceiling_{name}")
        probe(100_000, ctypes.byref(sink), threads)  # wakes the threads and the clocks
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            ops = probe(20_000_000, ctypes.byref(sink), threads)
            best = max(best, ops / (time.perf_counter() - start))
        out[name] = best
    return out


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _tensor_shapes(model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype code, shape) over a single or sharded checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = [model_dir / "model.safetensors"]
    shapes = {}
    for path in files:
        for name, info in _safetensors_header(path).items():
            shapes[name] = (info["dtype"], info["shape"])
    return shapes


def weight_bytes(model_dir: str | Path, dtype: torch.dtype | None = None) -> int:
    """Bytes of weights read by one target forward of one token (see the module docstring).

    ``dtype``: the dtype the weights are run in (default: as stored in the checkpoint).
    """
    model_dir = Path(model_dir)
    shapes = _tensor_shapes(model_dir)
    has_lm_head = any(name.endswith("lm_head.weight") for name in shapes)
    total = 0
    for name, (code, shape) in shapes.items():
        itemsize = dtype.itemsize if dtype is not None else _ITEMSIZE[code]
        numel = 1
        for n in shape:
            numel *= n
        if name.endswith("embed_tokens.weight"):
            row = numel // shape[0] * itemsize  # the gather reads one row of [vocab, hidden]
            # Tied: the LM head reads the same matrix in full; count it here, once.
            total += row if has_lm_head else numel * itemsize + row
        else:
            total += numel * itemsize
    return total


def roofline_fraction(weight_bytes: float, seconds_per_token: float, bandwidth: float) -> float:
    """Achieved weight bandwidth over measured bandwidth; 1.0 is the memory-bound floor."""
    return weight_bytes / seconds_per_token / bandwidth

