"""Pre-training of the demo target, and the training loop that ``distill.py`` reuses.

``target_config`` fixes the demo target's shape (hidden 256, GQA 4:2 heads of 64, tied
embeddings). ``run_training`` is a plain AdamW + linear-warmup cosine loop over an iterator of
token windows with a caller-supplied loss, optional bf16 autocast, gradient clipping, a tqdm bar
and a CSV loss log. ``save_checkpoint`` writes a Hugging Face folder in bfloat16.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel

LossFn = Callable[[torch.Tensor], torch.Tensor]


def target_config(vocab_size: int, eos_token_id: int, pad_token_id: int, num_layers: int = 10,
                  intermediate_size: int = 1024) -> LlamaConfig:
    """The demo target: hidden 256 (a widening tool relies on exactly 256), 4 heads, 2 KV heads."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def init_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A freshly initialised fp32 model; the seed alone fixes its weights."""
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def lm_loss(model: PreTrainedModel) -> LossFn:
    """Next-token cross-entropy on a ``[batch, seq_len + 1]`` window batch."""

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    return loss_fn


def cosine_lr(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``min_ratio * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms or the tied embedding)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


class LossLog:
    """CSV loss log (one row per step, flushed so a running job can be watched); no-op on None."""

    def __init__(self, path: str | Path | None, resume_at: int = 0) -> None:
        """resume_at > 0: a resumed run goes on with an existing log from that step (the rows of
        later steps, which the run does again, are dropped); else a new log."""
        self._file = None
        self._writer = None
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_at > 0 and path.is_file():
                with path.open(newline="") as f:
                    kept = [row for row in csv.reader(f) if row][1:]
                kept = [row for row in kept if int(row[0]) < resume_at]
            self._file = path.open("w", newline="")  # noqa: SIM115 - closed by close()
            self._writer = csv.writer(self._file)
            self._writer.writerows([["step", "lr", "loss", "grad_norm", "tokens", "elapsed_s"],
                                    *kept])

    def write(self, step: int, lr: float, loss: float, grad_norm: float, tokens: int,
              elapsed_s: float) -> None:
        if self._writer is not None:
            self._writer.writerow([step, f"{lr:.3e}", f"{loss:.4f}", f"{grad_norm:.3f}", tokens,
                                   f"{elapsed_s:.1f}"])
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def run_training(model: torch.nn.Module, loss_fn: LossFn, batches: Iterator[torch.Tensor],
                 steps: int, lr: float, warmup: int, log_path: str | Path | None = None,
                 weight_decay: float = 0.1, grad_clip: float = 1.0, bf16: bool = True,
                 device: torch.device | str = "cpu", desc: str = "train") -> dict[str, float]:
    """Train ``model`` for exactly ``steps`` optimizer steps; returns a summary dict.

    A fixed step count (not a time budget) keeps the run reproducible on any machine.
    """
    device = torch.device(device)
    model.train()
    opt = make_optimizer(model, lr, weight_decay)
    start = time.time()
    tokens = 0
    ema = None
    with contextlib.closing(LossLog(log_path)) as loss_log:
        bar = tqdm(range(steps), desc=desc, mininterval=10.0)
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step, steps, lr, warmup)
            batch = next(batches).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(batch)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += batch[:, 1:].numel()
            value = loss.item()
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            bar.set_postfix(loss=f"{ema:.3f}")
            loss_log.write(step, opt.param_groups[0]["lr"], value, grad_norm.item(), tokens,
                           time.time() - start)
    model.eval()
    return {"steps": steps, "tokens": tokens, "final_loss_ema": float(ema or 0.0),
            "train_seconds": time.time() - start}


def save_checkpoint(model: PreTrainedModel, out_dir: str | Path, eos_token_id: int,
                    pad_token_id: int | None) -> None:
    """Write config.json, bfloat16 model.safetensors and generation_config.json to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id, do_sample=False,
    )
    # Copy to bf16 so the caller's fp32 model keeps training/evaluating at full precision.
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.config.dtype = torch.bfloat16
    bf16.save_pretrained(out)
