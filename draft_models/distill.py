"""Distil a small Llama draft toward a target's next-token distribution.

Works for the demo target and for any Hugging Face causal-LM folder (Llama, Qwen2, Mistral, ...):
the draft is a ``LlamaForCausalLM`` with the target's vocabulary size, special-token ids, RoPE
base and context length, and its folder gets a copy of the target's tokenizer files, so the
engine can pair the two. The loss is ``kl_weight * KL(p_target || p_draft)`` at a temperature,
plus ``(1 - kl_weight)`` next-token cross-entropy on the text.

CLI (a user's own target and text)::

    python -m specserve.draft_models.distill --target path/to/target --data my_texts/ \\
        --out path/to/draft --steps 2000

``recipe.py`` calls ``distill`` directly with the stdlib corpus for the demo pair.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PretrainedConfig

from .data import WindowSampler, concat_stream, read_text_files
from .tokenizer import copy_tokenizer_files
from .train import LossFn, count_parameters, init_model, run_training, save_checkpoint


def _rope_theta(config: PretrainedConfig) -> float:
    """RoPE base of a config in either the transformers 4 or 5 spelling."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def _first_id(value: int | Sequence[int] | None) -> int | None:
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def draft_config_for(target: PretrainedConfig, hidden_size: int = 128, num_layers: int = 2,
                     num_heads: int = 2, num_kv_heads: int = 1, head_dim: int = 64,
                     intermediate_size: int = 384) -> LlamaConfig:
    """A small Llama config that speaks the target's vocabulary and positions."""
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=_rope_theta(target),
        tie_word_embeddings=True,
        bos_token_id=_first_id(getattr(target, "bos_token_id", None)),
        eos_token_id=getattr(target, "eos_token_id", None),
        pad_token_id=_first_id(getattr(target, "pad_token_id", None)),
    )


def kd_loss(target: torch.nn.Module, draft: torch.nn.Module, kl_weight: float = 1.0,
            temperature: float = 1.0) -> LossFn:
    """Distillation loss on a ``[batch, seq_len + 1]`` window batch (the target is frozen)."""

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.no_grad():
            teacher = target(input_ids=inputs).logits.float()  # [B, T, V]
        student = draft(input_ids=inputs).logits.float()  # [B, T, V]
        vocab = student.shape[-1]
        teacher = teacher[..., :vocab]  # some checkpoints pad their vocabulary differently
        t_logp = F.log_softmax(teacher.flatten(0, 1) / temperature, dim=-1)
        s_logp = F.log_softmax(student.flatten(0, 1) / temperature, dim=-1)
        # KL(p_target || p_draft), mean over tokens; T^2 keeps gradients comparable across T.
        kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * temperature**2
        if kl_weight >= 1.0:
            return kl
        ce = F.cross_entropy(student.flatten(0, 1), labels.flatten())
        return kl_weight * kl + (1.0 - kl_weight) * ce

    return loss_fn


def load_target(target_dir: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> torch.nn.Module:
    """The frozen target model from a local Hugging Face folder."""
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype,
                                                 local_files_only=True).to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def distill(target: torch.nn.Module, draft_config: LlamaConfig, batches: Iterator[torch.Tensor],
            steps: int, lr: float = 2e-3, warmup: int = 50, kl_weight: float = 1.0,
            temperature: float = 1.0, seed: int = 0, log_path: str | Path | None = None,
            bf16: bool = True, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, dict]:
    """Initialise a draft from ``draft_config`` (fixed seed) and distil it for ``steps`` steps."""
    draft = init_model(draft_config, seed).to(device)
    summary = run_training(draft, kd_loss(target, draft, kl_weight, temperature), batches, steps,
                           lr, warmup, log_path=log_path, bf16=bf16, device=device, desc="distill")
    summary["parameters"] = count_parameters(draft)
    return draft, summary


def tokenize_texts(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """One token stream from raw texts, each followed by the tokenizer's EOS (if it has one)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    # verbose=False: documents longer than the context are expected; windows cut them later.
    ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    return concat_stream([t + eos for t in ids])


def chat_jsonl_texts(tokenizer, texts: Sequence[str]) -> list[str]:
    """Lines of ``{"messages": [...]}`` JSONL rendered with the target's chat template."""
    out = []
    for text in texts:
        for line in text.splitlines():
            if line.strip():
                out.append(tokenizer.apply_chat_template(json.loads(line)["messages"],
                                                         tokenize=False))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target checkpoint folder (HF format)")
    p.add_argument("--data", nargs="+", required=True,
                   help="text files or folders (.txt .md .py .rst .json); .jsonl files of "
                        '{"messages": [...]} are rendered with the chat template')
    p.add_argument("--out", required=True, help="output folder for the draft")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--kl-weight", type=float, default=1.0,
                   help="weight of the KL term; the rest goes to next-token cross-entropy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    jsonl = [p for p in args.data if str(p).endswith(".jsonl")]
    plain = [p for p in args.data if not str(p).endswith(".jsonl")]
    texts = read_text_files(plain) if plain else []
    texts += chat_jsonl_texts(tokenizer, read_text_files(jsonl)) if jsonl else []
    stream = tokenize_texts(tokenizer, texts)
    print(f"{len(texts)} documents, {stream.numel()} tokens")
    batches = WindowSampler([stream], [1.0], args.seq_len, args.batch_size, seed=args.seed)

    dtype = torch.bfloat16 if args.target_dtype == "bfloat16" else torch.float32
    target = load_target(args.target, dtype, args.device)
    config = draft_config_for(target.config, args.hidden_size, args.layers, args.heads,
                              args.kv_heads, args.head_dim, args.intermediate_size)
    out = Path(args.out)
    draft, summary = distill(target, config, batches, args.steps, args.lr, args.warmup,
                             args.kl_weight, args.temperature, args.seed,
                             log_path=out / "distill_loss.csv", bf16=not args.no_bf16,
                             device=args.device)
    save_checkpoint(draft, out, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    copy_tokenizer_files(args.target, out)
    # The target's own generation config (stop tokens, chat EOS) applies to the draft too.
    if (Path(args.target) / "generation_config.json").is_file():
        shutil.copyfile(Path(args.target) / "generation_config.json",
                        out / "generation_config.json")
    summary["target_parameters"] = count_parameters(target)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
