"""Distillation data a chat target writes itself: its greedy replies and top-k next-token
log-probabilities for each reply token.

The target runs as a plain transformers model (float32, dense KV cache) built from a GGUF file
or a Hugging Face folder; prompts are rendered with the target's chat template and generated in
batches (left padding). Each record holds the prompt ids, the reply ids
(ending with EOS when the reply finished) and, for every reply position, the target's `top_k`
most likely tokens with their log-probabilities: the soft labels of the distillation loss.
Records are saved after every batch so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import time
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


class _TopKRecorder:
    """A logits processor that keeps each step's top-k log-probabilities (the full [B, vocab]
    scores of every step would not fit in memory) and leaves the scores unchanged."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.logp: list[torch.Tensor] = []  # per step: [B, k]
        self.ids: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp, ids = torch.log_softmax(scores.float(), dim=-1).topk(self.k, dim=-1)
        self.logp.append(logp)
        self.ids.append(ids)
        return scores


@torch.inference_mode()
def generate_records(model: torch.nn.Module, tokenizer, questions: Sequence[str],
                     max_new_tokens: int, batch_size: int, top_k: int, eos_token_id: int,
                     out: Path | None = None, log=print) -> list[dict]:
    """Greedy replies with top-k log-probabilities; resumes from / appends to `out`."""
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
        recorder = _TopKRecorder(top_k)
        sequences = model.generate(input_ids=ids, attention_mask=mask,
                                   max_new_tokens=max_new_tokens, do_sample=False,
                                   logits_processor=[recorder], eos_token_id=eos_token_id,
                                   pad_token_id=pad)
        top_logp = torch.stack(recorder.logp, dim=1)  # [B, new, k]
        top_ids = torch.stack(recorder.ids, dim=1)  # [B, new, k]
        new = sequences[:, width:]  # [B, new]
        for b, (q, p) in enumerate(zip(batch, prompts)):
            reply = new[b].tolist()
            n = reply.index(eos_token_id) + 1 if eos_token_id in reply else len(reply)
            records.append({"question": q, "prompt_ids": p, "reply_ids": reply[:n],
                            "top_ids": top_ids[b, :n].to(torch.int32).clone(),
                            "top_logp": top_logp[b, :n].to(torch.float16).clone()})
        if out is not None:
            torch.save(records, out)
        log(f"generated {len(records)}/{len(questions)} replies "
            f"({time.time() - start:.0f} s this run)")
    order = {q: i for i, q in enumerate(questions)}
    return sorted((r for r in records if r["question"] in order),
                  key=lambda r: order[r["question"]])
