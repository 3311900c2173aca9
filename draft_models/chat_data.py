"""Distillation data a chat target writes itself: its greedy replies to chat questions.

The target runs as a plain transformers model (float32, dense KV cache) built from a GGUF file
or a Hugging Face folder; prompts are rendered with the target's chat template and generated in
batches (left padding). Each record holds the question, the prompt ids and the reply ids
(ending with EOS when the reply finished). Records are saved after every batch so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch


def load_hf_target(path: str | Path) -> torch.nn.Module:
    """The target as a float32 transformers model; a `.gguf` file is dequantized."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix != ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     local_files_only=True)
    else:
        from specserve.model.gguf import read_gguf

        ckpt = read_gguf(path)
        model = AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32)
        state = {name: t.dequantize(torch.float32) for name, t in ckpt.tensors.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"{path}: tensors do not match the model: missing {missing}, "
                             f"unexpected {unexpected}")
        model.tie_weights()
    model.eval()
    model.requires_grad_(False)
    return model


def chat_ids(tokenizer, question: str) -> list[int]:
    """A one-turn chat prompt (the template's default system prompt included), ready to reply."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def generate_records(model: torch.nn.Module, tokenizer, questions: Sequence[str],
                     max_new_tokens: int, batch_size: int, eos_token_id: int,
                     out: Path | None = None, log=print) -> list[dict]:
    """Greedy replies; resumes from / appends to `out`."""
    records: list[dict] = torch.load(out) if out is not None and out.is_file() else []
    done = {r["question"] for r in records}
    # In the given order, so the records of an interrupted run are a prefix of `questions`.
    todo = [q for q in questions if q not in done]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_id
    start = time.time()
    for i in range(0, len(todo), batch_size):
        batch = todo[i:i + batch_size]
        prompts = [chat_ids(tokenizer, q) for q in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sequences = model.generate(input_ids=ids, attention_mask=mask,
                                   max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=eos_token_id, pad_token_id=pad)
        new = sequences[:, width:]  # [B, new]
        for b, (q, p) in enumerate(zip(batch, prompts)):
            reply = new[b].tolist()
            n = reply.index(eos_token_id) + 1 if eos_token_id in reply else len(reply)
            records.append({"question": q, "prompt_ids": p, "reply_ids": reply[:n]})
        if out is not None:
            torch.save(records, out)
        log(f"generated {len(records)}/{len(questions)} replies "
            f"({time.time() - start:.0f} s this run)")
    order = {q: i for i, q in enumerate(questions)}
    return sorted((r for r in records if r["question"] in order),
                  key=lambda r: order[r["question"]])


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


def vocabulary_coverage(token_ids: torch.Tensor, records: Sequence[dict]) -> float:
    """The share of the records' reply tokens the draft's head can propose: every other token
    is a certain rejection."""
    head = set(token_ids.tolist())
    replies = [t for r in records for t in r["reply_ids"]]
    return sum(t in head for t in replies) / max(1, len(replies))


def corpus_records(corpus: Path, held_out_share: float = 0.1) -> tuple[list[dict], int]:
    """The corpus shards (corpus.py, every family) as records, the held-out ones last, and how
    many those are: per family, the greedy replies of its last shards, about `held_out_share` of
    its greedy replies (agreement with the target is measured against greedy replies only; the
    sampled ones of those shards are left out rather than trained on). A family of one shard is
    trained on whole; the pool family needs two."""
    from .corpus import FAMILIES, POOL, next_shard, read_shard, shard_path

    def split(family: str) -> tuple[list, list]:
        shards = [read_shard(shard_path(corpus, k, family))[0]
                  for k in range(next_shard(corpus, family))]
        if family == POOL and len(shards) < 2:
            raise ValueError(f"{corpus}: {len(shards)} corpus shard(s); training needs at least "
                             f"2 (one is held out)")
        greedy = sum(r.temperature == 0.0 for shard in shards for r in shard)
        held_shards, held_greedy = 0, 0
        while held_greedy < held_out_share * greedy and held_shards < len(shards) - 1:
            held_shards += 1
            held_greedy += sum(r.temperature == 0.0 for r in shards[-held_shards])
        cut = len(shards) - held_shards
        return ([r for shard in shards[:cut] for r in shard],
                [r for shard in shards[cut:] for r in shard if r.temperature == 0.0])

    def record(r) -> dict:
        return {"question": None, "prompt_ids": r.prompt_ids, "reply_ids": r.reply_ids}

    splits = [split(family) for family in FAMILIES]
    train = [record(r) for family_train, _ in splits for r in family_train]
    held = [record(r) for _, family_held in splits for r in family_held]
    return train + held, len(held)

