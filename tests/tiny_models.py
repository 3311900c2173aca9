"""Tiny random-init Hugging Face checkpoints for tests, saved to a folder once per session.

All models share one vocabulary and one byte-level tokenizer built offline with `tokenizers`, so
any of them can serve as target or draft of another.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(folder: Path) -> None:
    """A byte-level BPE with a few merges, trained on a fixed text; saved as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
            "héllo wörld ✓ 你好 🙂"] * 50
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(folder)


# Per family: what its tiny model sets beyond the common shape. Gemma 3 gets a short window and
# a 2 local : 1 global pattern, so tests cross both, and an attention scale of its own.
ARCH_DEFAULTS = {
    "qwen3": {"head_dim": 32, "architectures": ["Qwen3ForCausalLM"]},
    "gemma3": {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
               "num_hidden_layers": 3, "architectures": ["Gemma3ForCausalLM"],
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
}
# Families whose norms get random weights (q/k norms included): a norm left at its initial
# value would hide a weight applied wrongly (Gemma's multiplier is 1 + w, w initially 0).
RANDOM_NORMS = {"qwen3": (0.5, 1.5), "gemma3": (-0.5, 0.5)}


def make_config(arch: str, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # noqa: C408
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=None, pad_token_id=0,
                  tie_word_embeddings=False)
    common.update(ARCH_DEFAULTS.get(arch, {}))
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
           "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig}[arch]
    if arch == "mistral":
        common.setdefault("sliding_window", None)
    return cls(**common)


def save_model(folder: Path, arch: str, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Random-init `arch` model with the shared tokenizer, saved as safetensors."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = make_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    # Larger-than-default init spreads the logits so greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif "norm" in name and arch in RANDOM_NORMS:
                p.uniform_(*RANDOM_NORMS[arch])
    model.to(dtype).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def k_quant_tensors(path, types: dict[str, str]) -> dict:
    """The linear weights of the checkpoint in folder `path` as GGUF tensors (what
    `use_file_blocks` reads), each projection (q_proj, v_proj, down_proj, ...) in the block type
    `types` names, Q4_K by default."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType
    from safetensors.torch import load_file

    from specserve.kernels.quant_reference import quantize

    tensors = {}
    for name, w in load_file(str(path / "model.safetensors")).items():
        if name.endswith("proj.weight"):
            fmt = types.get(name.split(".")[-2], "Q4_K")
            tensors[name] = SimpleNamespace(ggml_type=GGMLQuantizationType[fmt],
                                            shape=tuple(w.shape),
                                            raw=quantize(w, fmt).blocks.numpy())
    return tensors
