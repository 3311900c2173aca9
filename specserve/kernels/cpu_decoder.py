"""A stack of decoder layers in one C call (cpu_decoder.c), and the gated activations (SwiGLU,
GeGLU) alone.

`DecoderStack` holds what `decoder_layers` reads: every layer's norms and projections (bf16
weights or GGUF blocks, a fused projection in one part per block format), the attention shape,
scale and each layer's window, and each layer's rotary tables. It is built once per model
from its weights (see specserve/model/cpu_stack.py) and then runs whole forwards of a few rows:
decode, verify, short prompt chunks. Each layer step runs the kernel the layer-by-layer path
calls for it, so the two give the same bits; the stack removes the Python dispatch between
them (0.3-0.5 ms per layer on a 2-core CPU).

`SPECSERVE_CPU_STACK=0` keeps the layer-by-layer path (tests and benchmarks compare the two).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import torch

from . import cpu_attention, cpu_build, cpu_linear, cpu_norm_rope, quant_cpu
from .quant_reference import QuantizedWeight

# Rows every stack takes on every C path (cpu_linear.INVARIANT_ROWS). Past them a stack with bf16
# projections goes layer by layer where the layers hand bf16 products to F.linear (amx and
# avx512: cpu_linear.MAX_ROWS); where the C kernels take every bf16 product (avx2, portable),
# and for a stack whose projections are all quantized (the quantized kernel is the layers' own
# at every row count), the stack takes any number of rows, so a prompt chunk or a batch of 64
# decoding chats runs in one call too (DecoderStack.max_rows). The same tokens either way; on a
# 2-core Zen 3 (avx2, the widened bf16 target) the step at 40 or 64 chats is the products',
# so the stack's saving there (the layers' Python dispatch) is within the machine's swings.
MAX_ROWS = cpu_linear.INVARIANT_ROWS

_LINEAR_BF16, _LINEAR_QUANT = 0, 1
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's, numbered as cpu_decoder.c's GATE_*
MAX_PARTS = 3  # products per projection (cpu_decoder.c's MAX_PARTS)
_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [("kind", _i32), ("fmt", _i32), ("group", _i32), ("weight", _p), ("bias", _p),
                ("n", _i64)]


class _Linear(ctypes.Structure):
    _fields_ = [("parts", _Part * MAX_PARTS), ("num_parts", _i32), ("n", _i64), ("k", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("pre_ff_norm", _p), ("post_ff_norm", _p),
                ("q_norm", _p), ("k_norm", _p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("cos", _p), ("sin", _p),
                ("window", _i64)]


class _Decoder(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(_Layer)), ("num_layers", _i64), ("hidden", _i64),
                ("intermediate", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("eps", _f32), ("scale", _f32), ("max_positions", _i64),
                ("f32", _i32), ("gemm_min_rows", _i32), ("outer_min_rows", _i32),
                ("activation", _i32)]


class _Step(ctypes.Structure):
    _fields_ = [("positions", _p), ("slot_mapping", _p), ("block_tables", _p),
                ("query_start_loc", _p), ("context_lens", _p), ("local_mask", _p),
                ("T", _i64), ("num_requests", _i64), ("max_blocks", _i64),
                ("max_query_len", _i64), ("kv_cache", _p), ("num_blocks", _i64),
                ("block_size", _i64), ("act_bits", _i32)]


Weight = torch.Tensor | QuantizedWeight


@dataclass
class Part:
    weight: Weight  # bf16 [n, K] or GGUF blocks
    bias: torch.Tensor | None  # [n]


@dataclass
class Projection:
    """y [T, the parts' n summed] = each part's product in its own columns, in order: one part,
    or one per block format of a fused projection whose parts differ (QuantizedParts)."""

    parts: list[Part]

    @property
    def in_features(self) -> int:
        return self.parts[0].weight.shape[1]


@dataclass
class LayerWeights:
    """One layer's weights as the model holds them (norm weights in the activations' dtype,
    Gemma's 1 + w already added) and its attention's rotary tables and window."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H] before the MLP; Gemma 3: on the attention output
    qkv: Projection  # rows: q heads, k heads, v heads
    o: Projection
    gate_up: Projection  # rows: gate, then up
    down: Projection
    cos: torch.Tensor  # [max_positions, D / 2] fp32: this layer's rotary tables
    sin: torch.Tensor  # [max_positions, D / 2] fp32
    q_norm: torch.Tensor | None = None  # [D] each q head's RMSNorm (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [D] each k head's
    pre_ff_norm: torch.Tensor | None = None  # [H] Gemma 3's norm before the MLP
    post_ff_norm: torch.Tensor | None = None  # [H] Gemma 3's norm on the MLP output
    window: int | None = None  # a sliding layer's window; None: global attention

    def norms(self) -> list[torch.Tensor]:
        return [n for n in (self.input_norm, self.post_norm, self.q_norm, self.k_norm,
                            self.pre_ff_norm, self.post_ff_norm) if n is not None]


def enabled() -> bool:
    """False when SPECSERVE_CPU_STACK=0 (checked: 0 or 1)."""
    value = os.environ.get("SPECSERVE_CPU_STACK", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"SPECSERVE_CPU_STACK={value!r}: expected 0 or 1")
    return value == "1"


def library():
    """The kernel library when the layer-by-layer path would run every op in C (switching one
    kernel off, as tests do, switches the stack off too), else None."""
    if cpu_linear._library() is None or cpu_norm_rope.library() is None:
        return None
    return cpu_build.library()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [T, 2I] bf16 or fp32 on CPU -> silu(gate) * up [T, I] (as torch computes it, the
    exponential aside), or None when the kernel does not apply."""
    return _gated(gate_up, "silu_mul_rows")


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [T, 2I] -> F.gelu(gate, approximate="tanh") * up [T, I] (Gemma's GeGLU; gelu
    within a few fp32 ulp of torch's where torch's 1 + tanh keeps its bits), or None when the
    kernel does not apply."""
    return _gated(gate_up, "gelu_tanh_mul_rows")


def _gated(gate_up: torch.Tensor, kernel: str) -> torch.Tensor | None:
    lib = library()
    if (lib is None or gate_up.device.type != "cpu" or gate_up.dim() != 2
            or gate_up.dtype not in cpu_norm_rope.DTYPES or gate_up.shape[1] % 2):
        return None
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    getattr(lib, kernel)(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1],
                         gate_up.dtype == torch.float32, torch.get_num_threads())
    return out


class DecoderStack:
    """Every layer of one model for `decoder_layers`; `unsupported` says why it cannot be
    built for these weights (None when it can)."""

    def __init__(self, layers: list[LayerWeights], *, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, dtype: torch.dtype, scale: float | None = None,
                 activation: str = "silu") -> None:
        """scale: the attention's softmax scale (None: head_dim ** -0.5); activation: the gated
        MLP's, one of ACTIVATIONS."""
        reason = self.unsupported(layers, dtype, head_dim)
        if reason is None and activation not in ACTIVATIONS:
            reason = f"activation {activation!r}: expected one of {', '.join(ACTIVATIONS)}"
        if reason is not None:
            raise ValueError(f"DecoderStack: {reason}")
        self.dtype = dtype
        dense = any(not isinstance(part.weight, QuantizedWeight) for w in layers
                    for proj in (w.qkv, w.o, w.gate_up, w.down) for part in proj.parts)
        # rows `run` takes (see MAX_ROWS)
        self.max_rows = (cpu_linear.MAX_ROWS.get(cpu_build.selected_isa(), sys.maxsize) if dense
                         else sys.maxsize)
        self._keep: list[torch.Tensor] = []  # every tensor the C side points into
        self._layers = (_Layer * len(layers))(*(self._layer(w) for w in layers))
        first = layers[0]
        self._desc = _Decoder(
            ctypes.cast(self._layers, ctypes.POINTER(_Layer)), len(layers),
            first.input_norm.shape[0], first.down.in_features, num_heads, num_kv_heads,
            head_dim, eps, head_dim ** -0.5 if scale is None else scale, first.cos.shape[0],
            dtype == torch.float32, cpu_linear.GEMM_MIN_ROWS,
            min(cpu_linear.outer_min_rows(), 2**31 - 1), ACTIVATIONS.index(activation))

    @staticmethod
    def unsupported(layers: list[LayerWeights], dtype: torch.dtype, head_dim: int) -> str | None:
        if not layers:
            return "no layers"
        if dtype not in cpu_norm_rope.DTYPES:
            return f"activations must be bf16 or fp32, not {dtype}"
        if head_dim % 16:
            return f"head_dim {head_dim} must be a multiple of 16 (the attention kernel's)"
        tables = layers[0].cos.shape
        for w in layers:
            for norm in w.norms():
                if norm.dtype != dtype or not norm.is_contiguous() or norm.device.type != "cpu":
                    return "the norms' weights must be contiguous CPU tensors of the dtype"
            if (w.q_norm is None) != (w.k_norm is None) or (
                    (w.pre_ff_norm is None) != (w.post_ff_norm is None)):
                return "q and k norms go together, and so do the MLP's input and output norms"
            for table in (w.cos, w.sin):
                if (table.dtype != torch.float32 or not table.is_contiguous()
                        or table.shape != tables or tables[1] * 2 != head_dim):
                    return "rotary tables must be contiguous fp32 [max_positions, head_dim / 2]"
            if w.window is not None and w.window < 1:
                return f"a sliding window of {w.window} positions"
            for proj in (w.qkv, w.o, w.gate_up, w.down):
                if not 1 <= len(proj.parts) <= MAX_PARTS:
                    return f"a projection of {len(proj.parts)} parts (1 to {MAX_PARTS} run)"
                if any(part.weight.shape[1] != proj.in_features for part in proj.parts):
                    return "a projection's parts must share their input features"
            for weight in (p.weight for proj in (w.qkv, w.o, w.gate_up, w.down)
                           for p in proj.parts):
                if isinstance(weight, QuantizedWeight):
                    if weight.blocks.device.type != "cpu":
                        return "quantized weights must be on the CPU"
                elif not (weight.dtype == dtype == torch.bfloat16 and weight.is_contiguous()
                          and weight.device.type == "cpu"):
                    return ("dense weights run in C only as contiguous bf16 with bf16 "
                            f"activations, not {weight.dtype} with {dtype}")
        return None

    def _layer(self, w: LayerWeights) -> _Layer:
        self._keep += [*w.norms(), w.cos, w.sin]
        norms = [None if n is None else n.data_ptr() for n in (
            w.input_norm, w.post_norm, w.pre_ff_norm, w.post_ff_norm, w.q_norm, w.k_norm)]
        return _Layer(*norms, *(self._linear(p) for p in (w.qkv, w.o, w.gate_up, w.down)),
                      w.cos.data_ptr(), w.sin.data_ptr(), w.window or 0)

    def _linear(self, proj: Projection) -> _Linear:
        parts = [self._part(part) for part in proj.parts]
        return _Linear((_Part * MAX_PARTS)(*parts), len(parts), sum(p.n for p in parts),
                       proj.in_features)

    def _part(self, part: Part) -> _Part:
        bias = None if part.bias is None else part.bias.to(self.dtype).contiguous()
        weight = part.weight
        quantized = isinstance(weight, QuantizedWeight)
        data = weight.blocks.contiguous() if quantized else weight
        self._keep += [data] + ([] if bias is None else [bias])
        return _Part(_LINEAR_QUANT if quantized else _LINEAR_BF16,
                     weight.fmt.code if quantized else 0, weight.row_group if quantized else 1,
                     data.data_ptr(), None if bias is None else bias.data_ptr(),
                     weight.shape[0])

    def run(self, lib, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor,
            query_start_loc: torch.Tensor, context_lens: torch.Tensor,
            local_mask: torch.Tensor | None, max_query_len: int) -> torch.Tensor:
        """x [T, H] (the embeddings) -> the last layer's output [T, H] (x itself, updated in
        place); kv_cache [L, 2, num_blocks, block_size, Hkv, D] contiguous, x's dtype; the
        rest as AttentionMetadata holds it."""
        if (x.dtype != self.dtype or kv_cache.dtype != self.dtype or not kv_cache.is_contiguous()
                or kv_cache.shape[0] != self._desc.num_layers):
            raise ValueError("DecoderStack.run: x and a contiguous KV cache of every layer, in "
                             f"the stack's dtype {self.dtype}")
        x = x.contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables, starts, contexts, mask = cpu_attention.kernel_metadata(
            block_tables, query_start_loc, context_lens, local_mask)
        act = quant_cpu.activation_format()
        step = _Step(positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), starts.data_ptr(),
                     contexts.data_ptr(), None if mask is None else mask.data_ptr(), x.shape[0],
                     contexts.shape[0], tables.shape[1], max_query_len, kv_cache.data_ptr(),
                     kv_cache.shape[2], kv_cache.shape[3], quant_cpu.activation_bits(act))
        status = lib.decoder_layers(ctypes.byref(self._desc), ctypes.byref(step), x.data_ptr(),
                                    torch.get_num_threads())
        if status == -2:
            raise IndexError(f"rotary positions must lie in [0, {self._desc.max_positions})")
        if status == -3:
            raise IndexError("a KV slot is past the cache")
        if status:
            raise MemoryError("decoder_layers: could not allocate its buffers")
        return x
