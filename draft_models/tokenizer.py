"""Byte-level BPE tokenizer and ChatML chat template shared by the demo target and draft.

``train_bpe`` fits a byte-level BPE with the ``tokenizers`` library; ``save_tokenizer_files``
writes the Hugging Face folder files. The ``tokenizer_config.json`` names the generic
``TokenizersBackend`` class on purpose: transformers 5 otherwise picks the tokenizer class from the
config's ``model_type`` (``llama``), and the Llama class rebuilds its own normalizer and
pre-tokenizer instead of using the byte-level ones in ``tokenizer.json``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML: <|im_start|>{role}\n{content}<|im_end|>\n per message; the generation prompt opens an
# assistant turn, and the model ends its turn with <|im_end|> (the EOS of generation).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Every file a Hugging Face checkpoint may use for its tokenizer; the draft copies the target's.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """Python mirror of ``CHAT_TEMPLATE`` (used to build training text without jinja)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def new_bpe_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE pipeline (no normalizer, GPT-2 style pre-tokenization)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets of leading spaces; no BOS/EOS is added on encode.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Train the BPE on ``texts``; special tokens get ids 0, 1, 2 in ``SPECIAL_TOKENS`` order.

    Special-token strings are removed from the training text so no merge ever spans one.
    """
    tok = new_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def scrubbed() -> Iterable[str]:
        for text in texts:
            for special in SPECIAL_TOKENS:
                text = text.replace(special, "\n")
            yield text

    tok.train_from_iterator(scrubbed(), trainer=trainer)
    return tok


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the three special tokens, by name."""
    ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
    missing = [s for s, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return ids


def save_tokenizer_files(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 2048) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and the token map."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = special_token_ids(tok)
    config = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for s in SPECIAL_TOKENS
        },
        "extra_special_tokens": [IM_START],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    token_map = {"eos_token": IM_END, "pad_token": ENDOFTEXT,
                 "additional_special_tokens": [IM_START]}
    (out / "special_tokens_map.json").write_text(json.dumps(token_map, indent=2) + "\n")


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy whichever tokenizer files ``src_dir`` has into ``dst_dir``; returns their names."""
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied
