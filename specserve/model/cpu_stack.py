"""The decoder's layers as one C call on CPU, where every op of a layer has its C kernel.

`run_layers` is DecoderLM.forward's fast path (decode, verify, short prompt chunks, and any
rows of a quantized model or of any model on avx2 and portable): it hands the whole stack of
layers to `kernels.cpu_decoder.DecoderStack`, which runs the same kernels the layers would, in
the same order, without the Python dispatch between them. It returns None, and the layers run
one by one, when the stack does not apply: CUDA, tensor parallelism (the row-parallel products
all-reduce between layers), more than cpu_decoder.MAX_ROWS rows where a projection is dense
bf16 and the path hands those to F.linear (amx, avx512), weights the kernels do not take (fp32
dense projections), no kernel library, or SPECSERVE_CPU_STACK=0. Every family's block runs in
it: Llama's, Qwen2's biases, Qwen3's q/k norms, Gemma 3's (q/k norms, norms around attention
and MLP, GeGLU, its attention scale, sliding-window layers with their own rotary tables); a
fused projection whose parts have different block formats runs one product per part.

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
               kv_cache: torch.Tensor, meta: AttentionMetadata, layers: range | None = None
               ) -> torch.Tensor | None:
    """x [T, H] -> the output [T, H] of `layers` (consecutive; default: all) through the C
    stack, or None."""
    if x.device.type != "cpu" or model.shard.is_split or not cpu_decoder.enabled():
        return None
    lib = cpu_decoder.library()
    if lib is None:
        return None
    layers = range(len(model.layers)) if layers is None else layers
    if not layers:
        return x
    stack = _stack(model, x.dtype, layers)
    if stack is None or x.shape[0] > stack.max_rows:
        return None
    return stack.run(lib, x, positions, kv_cache[layers.start:layers.stop], meta.slot_mapping,
                     meta.block_tables, meta.query_start_loc, meta.context_lens,
                     meta.local_mask, meta.max_query_len)


def forget(model: nn.Module) -> None:
    """Drop the model's stack (its weights moved)."""
    model.__dict__.pop("_cpu_stacks", None)


def _stack(model: nn.Module, dtype: torch.dtype, span: range) -> DecoderStack | None:
    stacks = model.__dict__.setdefault("_cpu_stacks", {})
    key = (dtype, span.start, span.stop)
    if key not in stacks:
        layers = [_layer_weights(model, model.layers[i]) for i in span]
        first = model.layers[span.start]
        attn = first.self_attn
        buildable = DecoderStack.unsupported(layers, dtype, attn.head_dim) is None
        stacks[key] = DecoderStack(
            layers, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, eps=first.input_layernorm.eps, dtype=dtype,
            scale=attn.attn.scale, activation=first.mlp.activation) if buildable else None
    return stacks[key]


def _layer_weights(model: nn.Module, layer: nn.Module) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    rotary = model.rotary_for(layer)
    return LayerWeights(_weight(layer.input_layernorm), _weight(layer.post_attention_layernorm),
                        _projection(attn.qkv_proj), _projection(attn.o_proj),
                        _projection(mlp.gate_up_proj), _projection(mlp.down_proj),
                        rotary.cos, rotary.sin, q_norm=_weight(attn.q_norm),
                        k_norm=_weight(attn.k_norm),
                        pre_ff_norm=_weight(layer.pre_feedforward_layernorm),
                        post_ff_norm=_weight(layer.post_feedforward_layernorm),
                        window=layer.window)


def _weight(norm: nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight.data


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
