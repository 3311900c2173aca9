"""Evaluate a target/draft pair: validation loss, greedy chain acceptance length, sample replies.

Acceptance length is measured exactly as greedy chain speculative decoding would commit tokens:
the target's greedy continuation of the prompt is the output (greedy speculation reproduces it);
at each step the draft greedily proposes ``k`` tokens from the committed prefix, the accepted
tokens are the longest prefix of the proposal that matches the target's continuation, and the
step commits ``accepted + 1`` tokens (the last being the target's bonus or correction token).
Acceptance length = committed tokens / target steps. Plain transformers models are used here,
independent of the specserve engine.

CLI::

    python -m specserve.draft_models.evaluate --target DIR --draft DIR [--prompts FILE]
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

# Prompts for the model card's sample replies: two about training-split modules, one held out.
SAMPLE_QUESTIONS = (
    "What does `json.dumps` do?",
    "What are the parameters of `textwrap.wrap`?",
)


@dataclass
class AcceptanceResult:
    """Greedy chain speculation statistics for one chain length ``k`` over a prompt set."""

    k: int
    acceptance_length: float  # committed tokens / target steps, over all prompts
    committed_tokens: int
    target_steps: int
    # P(proposal i accepted | proposals 1..i-1 accepted), i = 1..k
    per_position_acceptance: list[float]
    per_prompt: list[float]


def load_model(folder: str | Path) -> torch.nn.Module:
    """A checkpoint upcast to fp32 for evaluation (bf16 -> fp32 is exact)."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 local_files_only=True)
    return model.eval()


@torch.inference_mode()
def validation_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over ``[n, seq_len + 1]`` windows."""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i:i + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits.float()  # [B, T, V]
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


def _cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument: transformers 5.2x renamed ``past_key_values`` to ``cache``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out: object) -> object:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.inference_mode()
def greedy_generate(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | None) -> list[int]:
    """Greedy continuation with a KV cache; stops after EOS (included) or ``max_new_tokens``."""
    cache_kw = _cache_kwarg(model)
    out = model(input_ids=torch.tensor([list(prompt_ids)]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        if nxt == eos_token_id or len(tokens) == max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[nxt]]), use_cache=True,
                    **{cache_kw: _returned_cache(out)})
    return tokens


def acceptance_length(target_outputs: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
                      draft: torch.nn.Module, k: int) -> AcceptanceResult:
    """Replay greedy chain speculation of depth ``k`` against precomputed target outputs."""
    committed_total, steps_total = 0, 0
    accepted_at = [0] * k  # times proposal position i was accepted
    offered_at = [0] * k  # times position i was proposed while output tokens remained there
    per_prompt = []
    for prompt, output in zip(prompts, target_outputs):
        pos, steps = 0, 0
        while pos < len(output):
            # The draft proposes from the committed prefix; it never sees the target's future.
            proposal = greedy_generate(draft, list(prompt) + list(output[:pos]), k, None)
            accepted = 0
            for i, tok in enumerate(proposal):
                if pos + i >= len(output):
                    break
                offered_at[i] += 1
                if tok != output[pos + i]:
                    break
                accepted_at[i] += 1
                accepted += 1
            # Commit the accepted tokens plus the target's own next token (bonus or correction).
            pos = min(len(output), pos + accepted + 1)
            steps += 1
        committed_total += len(output)
        steps_total += steps
        per_prompt.append(len(output) / max(1, steps))
    return AcceptanceResult(
        k=k,
        acceptance_length=committed_total / max(1, steps_total),
        committed_tokens=committed_total,
        target_steps=steps_total,
        per_position_acceptance=[a / o if o else 0.0 for a, o in zip(accepted_at, offered_at)],
        per_prompt=per_prompt,
    )


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of a one-turn chat prompt, ending with the assistant generation prompt."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def evaluate_pair(target_dir: str | Path, draft_dir: str | Path, questions: Sequence[str],
                  sample_questions: Sequence[str],
                  val_sets: Mapping[str, torch.Tensor] | None = None,
                  ks: Sequence[int] = (2, 4, 6), max_new_tokens: int = 64,
                  reply_tokens: int = 128) -> dict:
    """All metrics for the model card, as a JSON-ready dict."""
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    target, draft = load_model(target_dir), load_model(draft_dir)
    eos = target.generation_config.eos_token_id
    result: dict = {"num_prompts": len(questions), "max_new_tokens": max_new_tokens}
    result["val_loss"] = {
        name: {"target": validation_loss(target, windows), "draft": validation_loss(draft, windows),
               "windows": list(windows.shape)}
        for name, windows in (val_sets or {}).items()
    }
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    outputs = [greedy_generate(target, p, max_new_tokens, eos) for p in prompts]
    result["acceptance"] = [asdict(acceptance_length(outputs, prompts, draft, k)) for k in ks]
    result["samples"] = []
    for q in sample_questions:
        reply = greedy_generate(target, chat_prompt_ids(tokenizer, q), reply_tokens, eos)
        result["samples"].append({
            "question": q,
            "reply": tokenizer.decode(reply, skip_special_tokens=True),
            "finish_reason": "stop" if reply and reply[-1] == eos else "length",
            "tokens": len(reply),
        })
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Evaluate a target/draft pair.")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", help="file with one user question per line "
                                     "(default: held-out stdlib questions)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompts:
        questions = [q for q in Path(args.prompts).read_text().splitlines() if q.strip()]
        samples = questions[:3]
    else:
        from .data import build_corpus, pick_questions

        held_out = build_corpus().val_questions
        questions = pick_questions(held_out, args.num_prompts)
        samples = [*SAMPLE_QUESTIONS, questions[0]]
    result = evaluate_pair(args.target, args.draft, questions, samples, ks=args.ks,
                           max_new_tokens=args.max_new_tokens)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
