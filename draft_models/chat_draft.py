"""A draft built from its target's own parts and distilled on the target's replies.

The draft (`ReducedVocabDraft`) is a short Llama stack that reads the target's token embeddings
(frozen, not shipped: specserve hands the target's tensor to the draft at load), starts from
copies of some of the target's decoder layers and its final norm, and predicts only the
`head_vocab_size` most frequent reply tokens (FR-Spec, Zhao et al. 2025). A smaller head is the
point: the target's tied 49k x 576 head costs as much as a fifth of the target per draft step.
The reduced head is lossless for speculative decoding: the target still verifies every token,
and the draft's logits are scattered back to the full vocabulary with -inf elsewhere.

Training minimises the cross-entropy between the target's top-k next-token distribution
(renormalised over the draft's tokens) and the draft's, at the reply positions of the records of
`chat_data.py`. The saved folder is a Hugging Face-style Llama checkpoint with three extra
config keys (`draft_vocab_size`, `shares_target_embeddings`, `target_layers`) and an extra
tensor `lm_head.token_ids`.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn


def frequent_tokens(records: Sequence[dict], size: int, always: Sequence[int]) -> torch.Tensor:
    """The draft's vocabulary: `always` (special tokens), then reply tokens by count, then the
    lowest ids not yet taken (byte-level BPE ids grow with merge order, roughly rarer)."""
    counts = Counter(t for r in records for t in r["reply_ids"])
    chosen = list(dict.fromkeys(always))
    chosen += [t for t, _ in counts.most_common() if t not in set(chosen)][: size - len(chosen)]
    taken = set(chosen)
    next_id = 0
    while len(chosen) < size:
        if next_id not in taken:
            chosen.append(next_id)
        next_id += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


class ReducedVocabDraft(nn.Module):
    """embeddings (target's, frozen) -> layers -> norm -> head over `token_ids` (training twin
    of specserve's DecoderLM with a reduced head)."""

    def __init__(self, target: nn.Module, layers: Sequence[int], token_ids: torch.Tensor) -> None:
        from transformers import LlamaConfig, LlamaModel

        super().__init__()
        cfg = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": len(layers)})
        cfg.architectures = ["LlamaForCausalLM"]
        self.config = cfg
        self.target_layers = list(layers)
        embed = target.model.embed_tokens
        self.model = LlamaModel(cfg)
        self.model.embed_tokens = embed  # shared, frozen
        for mine, src in zip(self.model.layers, layers):
            mine.load_state_dict(target.model.layers[src].state_dict())
        self.model.norm.load_state_dict(target.model.norm.state_dict())
        self.register_buffer("token_ids", token_ids.clone())
        head = target.lm_head.weight if target.lm_head is not None else embed.weight
        self.head = nn.Linear(cfg.hidden_size, len(token_ids), bias=False)
        with torch.no_grad():
            self.head.weight.copy_(head[token_ids])
        embed.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                where: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask [B, T] -> logits over the draft's tokens [B, T, K], or
        [P, K] at the (row, column) positions `where` [P, 2] only (the head is the costly part)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if where is not None:
            hidden = hidden[where[:, 0], where[:, 1]]  # [P, H]
        return self.head(hidden)

    def trainable(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("model.embed_tokens")]

    def save(self, out: Path, extra_config: dict) -> None:
        """bf16 safetensors without the embeddings, and config.json naming the reduced head."""
        out.mkdir(parents=True, exist_ok=True)
        state = {f"model.{k}": v for k, v in self.model.state_dict().items()
                 if not k.startswith("embed_tokens") and "rotary_emb" not in k}
        state["lm_head.weight"] = self.head.weight
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
        state["lm_head.token_ids"] = self.token_ids.clone()
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        cfg = self.config.to_dict()
        cfg.update(tie_word_embeddings=False, dtype="bfloat16",
                   draft_vocab_size=len(self.token_ids), shares_target_embeddings=True,
                   target_layers=self.target_layers, **extra_config)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def reply_batches(records: Sequence[dict], token_ids: torch.Tensor, batch_size: int,
                  seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless shuffled batches: (input_ids, attention_mask [B, T], positions [P, 2] of reply
    predictions (row, column), soft labels [P, K]) with the target's top-k probabilities
    renormalised over the draft's tokens."""
    index = torch.full((int(token_ids.max()) + 1,), -1, dtype=torch.long)
    index[token_ids] = torch.arange(len(token_ids))
    rng = random.Random(seed)
    order = list(range(len(records)))
    while True:
        rng.shuffle(order)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            batch = [records[j] for j in order[i:i + batch_size]]
            seqs = [r["prompt_ids"] + r["reply_ids"] for r in batch]
            width = max(map(len, seqs)) - 1
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            where, labels = [], []
            for b, (r, seq) in enumerate(zip(batch, seqs)):
                ids[b, :len(seq) - 1] = torch.tensor(seq[:-1])
                mask[b, :len(seq) - 1] = 1
                first = len(r["prompt_ids"]) - 1  # predicts the first reply token
                top = r["top_ids"].long()  # [n, k]
                probs = r["top_logp"].float().exp()  # [n, k]
                ok = top < len(index)
                slot = torch.where(ok, index[top.clamp(max=len(index) - 1)], -1)  # [n, k]
                probs = probs * (slot >= 0)
                keep = probs.sum(-1) > 0
                soft = torch.zeros(len(top), len(token_ids))
                soft.scatter_add_(1, slot.clamp(min=0), probs)
                soft = soft[keep] / soft[keep].sum(-1, keepdim=True)
                cols = torch.arange(first, first + len(top))[keep]
                where.append(torch.stack([torch.full_like(cols, b), cols], dim=1))
                labels.append(soft)
            yield ids, mask, torch.cat(where), torch.cat(labels)


def distill_loss(draft: ReducedVocabDraft, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    ids, mask, where, soft = batch
    logits = draft(ids, mask, where).float()  # [P, K]
    return -(soft * F.log_softmax(logits, dim=-1)).sum(-1).mean()


@torch.inference_mode()
def top1_agreement(draft: ReducedVocabDraft, records: Sequence[dict]) -> float:
    """Share of reply positions where the draft's argmax is the target's greedy token."""
    hits = total = 0
    for r in records:
        seq = r["prompt_ids"] + r["reply_ids"]
        ids = torch.tensor([seq[:-1]])
        logits = draft(ids, torch.ones_like(ids))[0, len(r["prompt_ids"]) - 1:]  # [n, K]
        pred = draft.token_ids[logits.argmax(-1)]
        hits += int((pred == torch.tensor(r["reply_ids"])).sum())
        total += len(r["reply_ids"])
    return hits / max(1, total)
