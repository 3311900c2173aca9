"""The decoder's layers as one C call on CPU, where every op of a layer has its C kernel.

`run_layers` is DecoderLM.forward's fast path for a few rows (decode, verify, short prompt
chunks): it hands the whole stack of layers to `kernels.cpu_decoder.DecoderStack`, which runs
the same kernels the layers would, in the same order, without the Python dispatch between
them. It returns None, and the layers run one by one, when the stack does not apply: CUDA,
tensor parallelism (the row-parallel products all-reduce between layers), more than
cpu_decoder.MAX_ROWS rows, weights the kernels do not take (fp32 dense projections), a block
the C layer does not have (Qwen3's and Gemma 3's q/k norms, Gemma's block norms, GeGLU, sliding
windows, another attention scale: `stack_runs`), no kernel library, or
SPECSERVE_CPU_STACK=0.

The stack is built at the first forward that can use it and points into the model's weights:
moving the model (`.to()`, which goes through `_apply`) drops it, and the weights are not
replaced after loading.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_decoder
from ..kernels.cpu_decoder import DecoderStack, LayerWeights, Part, Projection
from .attention import AttentionMetadata
from .quant import QuantizedLinear, QuantizedParts


def run_layers(model: nn.Module, x: torch.Tensor, positions: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
    """x [T, H] -> the last layer's output [T, H] through the C stack, or None."""
    if (x.device.type != "cpu" or x.shape[0] > cpu_decoder.MAX_ROWS or model.shard.is_split
            or not cpu_decoder.enabled() or not stack_runs(model.spec)):
        return None
    lib = cpu_decoder.library()
    if lib is None:
        return None
    stack = _stack(model, x.dtype)
    if stack is None:
        return None
    return stack.run(lib, x, positions, kv_cache, meta.slot_mapping, meta.block_tables,
                     meta.query_start_loc, meta.context_lens, meta.local_mask,
                     meta.max_query_len)


def stack_runs(spec) -> bool:
    """Whether the C layer (cpu_decoder.c: RMSNorm, fused q/k/v with rotary, paged attention at
    head_dim ** -0.5, SwiGLU) computes this architecture's blocks."""
    return not (spec.qk_norm or spec.sandwich_norms or spec.mlp_activation != "silu"
                or bool(spec.layer_windows) or spec.attn_scale is not None)


def forget(model: nn.Module) -> None:
    """Drop the model's stack (its weights moved)."""
    model.__dict__.pop("_cpu_stacks", None)


def _stack(model: nn.Module, dtype: torch.dtype) -> DecoderStack | None:
    stacks = model.__dict__.setdefault("_cpu_stacks", {})
    if dtype not in stacks:
        layers = [_layer_weights(layer) for layer in model.layers]
        attn = model.layers[0].self_attn
        buildable = DecoderStack.unsupported(layers, dtype, attn.head_dim) is None
        stacks[dtype] = DecoderStack(
            layers, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, eps=model.layers[0].input_layernorm.eps,
            cos=model.rotary.cos, sin=model.rotary.sin, dtype=dtype) if buildable else None
    return stacks[dtype]


def _layer_weights(layer: nn.Module) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(layer.input_layernorm.weight.data,
                        layer.post_attention_layernorm.weight.data,
                        _projection(attn.qkv_proj), _projection(attn.o_proj),
                        _projection(mlp.gate_up_proj), _projection(mlp.down_proj))


def _projection(module: nn.Module) -> Projection:
    if isinstance(module, QuantizedParts):  # one product per block format
        return Projection([_part(part) for part in module.parts])
    return Projection([_part(module)])


def _part(module: nn.Module) -> Part:
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.data
    if isinstance(module, QuantizedLinear):
        return Part(module.qweight, bias)
    return Part(module.weight.data, bias)
