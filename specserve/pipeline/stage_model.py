"""One pipeline stage of a decoder: its contiguous range of layers, and the embedding (first
stage) or the final norm and LM head (last stage).

`StageLM` is a `DecoderLM` built with only what its stage holds, so the decoder's own forward
runs it (the C layer stack included): on the first stage the forward's first argument is the
token ids; on the others it is the previous stage's output [T, H], which `StageInput` passes
through in place of the embedding. A stage's `spec` counts its own layers (`num_layers`), so
its runner's KV cache holds only those layers' blocks. The layer outputs are the residual
stream itself (each block adds to its input), so one tensor crosses a stage boundary.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..distributed import WHOLE, PipelineStage, TPShard
from ..model.architectures import ArchSpec, DecoderLayer, DecoderLM
from ..model.layers import RMSNorm, RotaryEmbedding
from ..model.parallel import VocabParallelEmbedding, check_split


class StageInput(nn.Module):
    """A later stage's stand-in for the embedding: the previous stage's hidden states [T, H]
    are its input."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class StageLM(DecoderLM):
    """Layers `layer_range` (global indices) of the model `full_spec` describes.

    The checkpoint's layer i is this stage's layer i - layer_range.start (the loader routes it).
    With a tied LM head the last stage holds the embedding matrix as its `lm_head`.
    """

    def __init__(self, full_spec: ArchSpec, dtype: torch.dtype, stage: PipelineStage,
                 shard: TPShard = WHOLE) -> None:
        nn.Module.__init__(self)
        if full_spec.reads_target_hidden or full_spec.head_vocab_size or \
                full_spec.shared_embeddings:
            raise ValueError("a draft model is not split into pipeline stages; it runs on "
                             "rank 0")
        check_split(full_spec.num_heads, full_spec.num_kv_heads, full_spec.head_dim,
                    full_spec.intermediate_size, shard)
        self.stage = stage
        self.layer_range = stage.layers(full_spec.num_layers)
        windows = full_spec.layer_windows or (None,) * full_spec.num_layers
        local_windows = tuple(windows[i] for i in self.layer_range)
        self.spec = replace(full_spec, num_layers=len(self.layer_range),
                            layer_windows=local_windows if full_spec.layer_windows else (),
                            embed_scale=full_spec.embed_scale if stage.is_first else None)
        self.shard = shard
        self._dtype = dtype
        H = full_spec.hidden_size
        self.embed_tokens = (VocabParallelEmbedding(full_spec.vocab_size, H, dtype, shard)
                             if stage.is_first else StageInput())
        self.fc = None
        self.layers = nn.ModuleList(DecoderLayer(full_spec, dtype, shard, w)
                                    for w in local_windows)
        self.norm = RMSNorm(H, full_spec.rms_norm_eps) if stage.is_last else nn.Identity()
        # The last stage's head; a tied head is the embedding matrix, read into it.
        self.lm_head = (VocabParallelEmbedding(full_spec.vocab_size, H, dtype, shard)
                        if stage.is_last else None)
        self.register_buffer("head_token_ids", None)
        self.rotary = RotaryEmbedding(full_spec.head_dim, full_spec.max_position_embeddings,
                                      torch.tensor(full_spec.inv_freq),
                                      full_spec.rope_attention_scaling)
        self.rotary_local = (None if full_spec.local_inv_freq is None
                             else RotaryEmbedding(full_spec.head_dim,
                                                  full_spec.max_position_embeddings,
                                                  torch.tensor(full_spec.local_inv_freq)))
        for norm in self._norms():
            norm.weight.data = norm.weight.data.to(dtype)
            norm.weight.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        """The layers' dtype: activations, KV cache, the hidden states between stages."""
        return self._dtype

    def compute_logits(self, hidden: torch.Tensor, head_rows: bool = False
                       ) -> torch.Tensor | None:
        if not self.stage.is_last:
            raise RuntimeError(f"pipeline stage {self.stage.index} has no LM head (the last "
                               f"stage, {self.stage.num_stages - 1}, has)")
        return super().compute_logits(hidden, head_rows)
