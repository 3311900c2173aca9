"""One parameterised decoder for the Llama, Qwen2, Mistral, Qwen3 and Gemma 3 families.

They differ only in data, which `ArchSpec.from_hf_config` reads once: Qwen2 adds q/k/v biases;
any of them may tie the LM head to the embedding; Qwen3 normalises each query and key head
(RMSNorm over head_dim) before the rotary embedding; Gemma 3 does too and adds: a GeGLU MLP
(gelu, tanh approximation), norms before and after each block, RMSNorm weights stored as
w for a multiplier of 1 + w (the loader adds the 1 once), embeddings scaled by sqrt(hidden),
its own attention scale (query_pre_attn_scalar), sliding-window layers (`layer_types`) with their
own rotary base, and optional tanh soft-capping of the final logits (a config's
attn_logit_softcapping is ignored, as transformers' and llama.cpp's Gemma 3 ignore it). Mistral's
`sliding_window`, when set, applies to every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..distributed import WHOLE, TPShard
from . import cpu_stack
from .attention import AttentionMetadata, PagedAttention
from .layers import GatedMLP, RMSNorm, RotaryEmbedding
from .parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    RowRange,
    VocabParallelEmbedding,
    check_split,
    even_range,
    kv_head_range,
)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ArchSpec:
    """Everything the decoder needs from a checkpoint's config.json, resolved once."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    inv_freq: tuple[float, ...]
    rope_attention_scaling: float
    sliding_window: int | None
    # A draft made for one target (see draft_models/chat_recipe.py): its LM head covers only the
    # `head_vocab_size` most frequent tokens (FR-Spec; the target still verifies every token), and
    # with `shared_embeddings` its input embeddings are the target's own, given at load.
    head_vocab_size: int | None = None
    shared_embeddings: bool = False
    # An EAGLE-style draft (draft_models/eagle_draft.py) reads, beside each token, the target's
    # final hidden state at the position before it: `fc` fuses [embedding, hidden] into its
    # first layer's input. Its hidden size is the target's.
    reads_target_hidden: bool = False
    # ... and, with `target_feature_layers` (EAGLE-3's low / mid / high fusion), the outputs of
    # these target layers beside that final state, fused into one hidden-size row by `fuse`
    # (`fuse_target_features`) before `fc` reads it.
    target_feature_layers: tuple[int, ...] = ()
    # Qwen3 / Gemma 3 (module docstring): per-head q/k RMSNorm; Gemma's block norms.
    qk_norm: bool = False
    sandwich_norms: bool = False  # post-attention and pre/post-feedforward norms
    norm_weight_offset: float = 0.0  # a checkpoint norm weight w multiplies by offset + w
    mlp_activation: str = "silu"  # "silu" | "gelu_tanh"
    embed_scale: float | None = None  # token embeddings multiplied by it
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # Per layer: its sliding window (a query at position p sees keys at positions > p - window)
    # or None for global attention; () when every layer is global.
    layer_windows: tuple[int | None, ...] = ()
    # The rotary inv_freq of the sliding layers when it differs from `inv_freq` (Gemma 3).
    local_inv_freq: tuple[float, ...] | None = None

    @classmethod
    def from_hf_config(cls, config) -> ArchSpec:
        archs = getattr(config, "architectures", None) or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or config.model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        per_type = _per_layer_type_rope(config)
        inv_freq, scaling = rope_inv_freq(config, head_dim,
                                          "full_attention" if per_type else None)
        window = getattr(config, "sliding_window", None) if arch == "MistralForCausalLM" else None
        gemma = arch == "Gemma3ForCausalLM"
        local_inv_freq = None
        if per_type:
            local, local_scaling = rope_inv_freq(config, head_dim, "sliding_attention")
            if local_scaling != 1.0:
                raise ValueError("a scaled rotary embedding on sliding layers is not supported")
            local_inv_freq = tuple(local.tolist())
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act",
                                                                           "silu")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}; supported: "
                             f"{', '.join(_ACTIVATIONS)}")
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            qkv_bias=(arch == "Qwen2ForCausalLM") or bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(scaling),
            sliding_window=window,
            head_vocab_size=getattr(config, "draft_vocab_size", None),
            shared_embeddings=bool(getattr(config, "shares_target_embeddings", False)),
            reads_target_hidden=bool(getattr(config, "reads_target_hidden", False)),
            target_feature_layers=tuple(getattr(config, "target_feature_layers", None) or ()),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            sandwich_norms=gemma,
            norm_weight_offset=1.0 if gemma else 0.0,
            mlp_activation=_ACTIVATIONS[activation],
            embed_scale=config.hidden_size ** 0.5 if gemma else None,
            attn_scale=config.query_pre_attn_scalar ** -0.5 if gemma else None,
            final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
            layer_windows=_layer_windows(config, arch),
            local_inv_freq=local_inv_freq,
        )


def _per_layer_type_rope(config) -> bool:
    """True when the config holds one rope setting per layer type (Gemma 3's global / local)."""
    params = getattr(config, "rope_parameters", None) or {}
    return isinstance(params.get("full_attention"), dict)


def _layer_windows(config, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window: from `layer_types` (Qwen3, Gemma 3), Mistral's one window
    for all; () for all global."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if arch == "MistralForCausalLM" and window:
        return (window,) * config.num_hidden_layers
    if arch not in ("Qwen3ForCausalLM", "Gemma3ForCausalLM") or not types or not window:
        return ()
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)}; supported: "
                         f"sliding_attention, full_attention")
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"{len(types)} layer_types for {config.num_hidden_layers} layers")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def rope_inv_freq(config, head_dim: int, layer_type: str | None = None
                  ) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim / 2] and the attention scaling for the config's rope type (of
    `layer_type`'s layers, for a config with one rope setting per layer type).

    The scaled variants (llama3, linear, yarn, longrope) come from transformers' own rope
    functions so we follow the checkpoint's semantics exactly; dynamic NTK depends on the running
    sequence length and is rejected.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return (1.0 / theta ** exponent).float(), 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_scaling type 'dynamic' is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


class DecoderAttention(nn.Module):
    """q/k/v projection (q/k heads RMS-normalised for Qwen3 / Gemma 3), rotary embedding,
    paged attention (over `window` positions on a sliding layer), output projection."""

    def __init__(self, spec: ArchSpec, dtype: torch.dtype, shard: TPShard = WHOLE,
                 window: int | None = None) -> None:
        super().__init__()
        D = spec.head_dim
        q_rows = even_range(spec.num_heads * D, shard, "attention heads x head_dim")
        first_kv, self.num_kv_heads = kv_head_range(spec.num_kv_heads, shard)
        kv_rows = RowRange(spec.num_kv_heads * D, first_kv * D, self.num_kv_heads * D)
        self.num_heads = q_rows.size // D
        self.head_dim = D
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, [q_rows, kv_rows, kv_rows],
                                             bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(q_rows.full, spec.hidden_size, dtype, shard)
        self.q_norm = RMSNorm(D, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(D, spec.rms_norm_eps) if spec.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, spec.head_dim,
                                   scale=spec.attn_scale, window=window)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, H]; kv [2, num_blocks, block_size, Hkv, D] -> [T, H]."""
        T = x.shape[0]
        q_len = self.num_heads * self.head_dim
        kv_len = self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)  # [T, q_len + 2 kv_len]
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv, q_len, kv_len)
        rotated = rotary.rotate_qk_(positions, qkv, self.num_heads, self.num_kv_heads)
        q, k, v = qkv.split([q_len, kv_len, kv_len], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = rotary(positions, q, k)
        out = self.attn(q, k, v, kv[0], kv[1], meta, positions)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, q_len))

    def _norm_heads(self, qkv: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
        """qkv [T, q_len + 2 kv_len] -> a contiguous copy with every q and k head normalised
        (the rotary kernel then rotates it in place)."""
        T, D = qkv.shape[0], self.head_dim
        q = self.q_norm(qkv[:, :q_len].reshape(-1, D)).view(T, q_len)  # [T Hq, D] -> [T, q_len]
        k = self.k_norm(qkv[:, q_len:q_len + kv_len].reshape(-1, D)).view(T, kv_len)
        return torch.cat([q, k, qkv[:, q_len + kv_len:]], dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, dtype: torch.dtype, shard: TPShard = WHOLE,
                 window: int | None = None) -> None:
        super().__init__()
        H, eps = spec.hidden_size, spec.rms_norm_eps
        self.window = window
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = DecoderAttention(spec, dtype, shard, window)
        # Llama's post_attention_layernorm is the norm before the MLP; Gemma's (same name in its
        # checkpoints) normalises the attention output, and pre_feedforward_layernorm is the
        # norm before the MLP.
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps) if spec.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(H, eps) if spec.sandwich_norms else None
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, dtype, shard,
                            spec.mlp_activation)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), positions, rotary, kv, meta)
        if self.pre_feedforward_layernorm is None:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def bad_feature_layers(layers: Sequence[int], num_layers: int) -> bool:
    """Whether `layers` are not distinct ascending indices of a model's `num_layers` layers
    (what a draft's `target_feature_layers` must be of its target's)."""
    return list(layers) != sorted(set(layers)) or any(not 0 <= i < num_layers for i in layers)


def scale_taps(rows: torch.Tensor, hidden_size: int, eps: float) -> torch.Tensor:
    """[..., (1 + k) H]: the first H columns as they are, each further H RMS-scaled (no
    weight), in float32 and back."""
    final, taps = rows[..., :hidden_size], rows[..., hidden_size:].float()
    taps = taps.unflatten(-1, (-1, hidden_size))  # [..., k, H]
    taps = taps * torch.rsqrt(taps.pow(2).mean(-1, keepdim=True) + eps)
    return torch.cat([final, taps.flatten(-2).to(rows.dtype)], dim=-1)


class DecoderLM(nn.Module):
    """Embedding -> N decoder layers -> final norm; `compute_logits` applies the LM head.

    `shard`: which tensor-parallel slice of every layer this process holds (the whole model by
    default).
    """

    def __init__(self, spec: ArchSpec, dtype: torch.dtype, shard: TPShard = WHOLE) -> None:
        super().__init__()
        check_split(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size,
                    shard)
        self.spec = spec
        self.shard = shard
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype, shard)
        if spec.reads_target_hidden and shard.is_split:
            raise ValueError("a draft that reads the target's hidden states runs whole on rank 0 "
                             "(draft_tp=1)")
        H = spec.hidden_size
        self.fc = (ColumnParallelLinear(2 * H, [RowRange(H, 0, H)], bias=True, dtype=dtype)
                   if spec.reads_target_hidden else None)
        taps = len(spec.target_feature_layers)
        self.fuse = (ColumnParallelLinear((1 + taps) * H, [RowRange(H, 0, H)], bias=False,
                                          dtype=dtype) if spec.reads_target_hidden and taps
                     else None)
        windows = spec.layer_windows or (None,) * spec.num_layers
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype, shard, windows[i])
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        head_rows = spec.head_vocab_size or spec.vocab_size
        self.lm_head = (None if spec.tie_word_embeddings
                        else VocabParallelEmbedding(head_rows, spec.hidden_size, dtype,
                                                    shard))
        # Reduced head: row i scores token head_token_ids[i]; filled by the loader.
        self.register_buffer("head_token_ids", torch.zeros(head_rows, dtype=torch.long)
                             if spec.head_vocab_size else None)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                      torch.tensor(spec.inv_freq), spec.rope_attention_scaling)
        # Gemma 3's sliding layers rotate with their own base.
        self.rotary_local = (None if spec.local_inv_freq is None
                             else RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                                  torch.tensor(spec.local_inv_freq)))
        for norm in self._norms():
            norm.weight.data = norm.weight.data.to(dtype)
            norm.weight.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        """The layers' dtype: activations, KV cache (a shared embedding may differ)."""
        return self.norm.weight.dtype

    def _norms(self):
        return [m for m in self.modules() if isinstance(m, RMSNorm)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, target_hidden: torch.Tensor | None = None,
                taps: Sequence[int] = ()) -> torch.Tensor:
        """input_ids, positions [T]; kv_cache [L, 2, num_blocks, block_size, Hkv, D] -> [T, H],
        the final (normed) hidden states; with `taps` (layer indices, ascending)
        [T, (1 + len(taps)) H]: those, then the output of each tapped layer (the residual
        stream after it), what a draft with `target_feature_layers` reads.

        target_hidden [T, H]: for a draft that reads them (`spec.reads_target_hidden`), the
        target's final hidden state at each token's previous position, fused with its tapped
        layers' (`fuse_target_features`), or the draft's own output standing in for it."""
        # A draft's shared embeddings keep the target's dtype: cast the looked-up rows.
        x = self.embed_tokens(input_ids).to(self.dtype)  # [T, H]
        if self.spec.embed_scale is not None:  # rounded to the layers' dtype, as Gemma does
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        if self.fc is not None:
            if target_hidden is None:
                raise ValueError("this draft reads the target's hidden states; none were given")
            x = self.fc(torch.cat([x, target_hidden.to(x.dtype)], dim=-1))  # [T, 2H] -> [T, H]
        tapped, first = [], 0
        for end in [t + 1 for t in taps] + [len(self.layers)]:
            x = self._run_layers(x, positions, kv_cache, meta, range(first, end))
            if len(tapped) < len(taps):
                tapped.append(x.clone())  # the C stack goes on updating x in place
            first = end
        return torch.cat([self.norm(x), *tapped], dim=-1) if taps else self.norm(x)

    def _run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, layers: range) -> torch.Tensor:
        """x [T, H] through `layers` -> [T, H]: one C call on CPU where it applies."""
        stacked = cpu_stack.run_layers(self, x, positions, kv_cache, meta, layers)
        if stacked is not None:
            return stacked
        if self.spec.layer_windows and meta.max_position is None:
            # Sliding layers attend with the plain kernels while no query is past the window.
            meta = replace(meta, max_position=int(positions.max()) if len(positions) else 0)
        for i in layers:
            layer = self.layers[i]
            x = layer(x, positions, self.rotary_for(layer), kv_cache[i], meta)
        return x

    def fuse_target_features(self, rows: torch.Tensor) -> torch.Tensor:
        """A target's rows from `forward(taps=spec.target_feature_layers)`, [n, (1 + k) H] ->
        [n, H], what this draft reads as target_hidden: each tapped layer's output RMS-scaled
        (the residual stream grows through the layers; the final state is already normed),
        then `fuse`. Without feature layers the rows are the final states, read as they are."""
        if self.fuse is None:
            return rows
        return self.fuse(scale_taps(rows.to(self.dtype), self.spec.hidden_size,
                                    self.spec.rms_norm_eps))

    def rotary_for(self, layer: nn.Module) -> RotaryEmbedding:
        """The rotary tables `layer` rotates with: Gemma's sliding layers have their own."""
        if layer.window is not None and self.rotary_local is not None:
            return self.rotary_local
        return self.rotary

    def _apply(self, fn, recurse: bool = True):
        cpu_stack.forget(self)  # it points into the weights, which may move
        return super()._apply(fn, recurse)

    def compute_logits(self, hidden: torch.Tensor, head_rows: bool = False
                       ) -> torch.Tensor | None:
        """hidden [N, H] -> logits [N, vocab] in float32 (-inf outside a reduced head's tokens);
        on rank 0, None on the others. `head_rows`: [N, head rows] instead, the head's own
        rows, which `head_token_ids` names the tokens of (the whole vocabulary when None)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.logits(hidden)  # [N, head rows]
        cap = self.spec.final_softcap
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if logits is None or head_rows:
            return logits
        return self.vocab_logits(logits)

    def vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, head rows] -> [N, vocab]: each row at its token, -inf at the tokens a reduced
        head leaves out (the same tensor when the head covers the vocabulary)."""
        if self.head_token_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.spec.vocab_size), float("-inf"))
        return full.index_copy_(1, self.head_token_ids, logits)  # [N, vocab]
