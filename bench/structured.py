"""Structured output on CPU: grammar cost per token and acceptance, constrained vs free.

    python -m bench structured [--model demo|default] [--tokens N] [--modes off,default]

For each speculation mode (off and the engine's default unless --modes names others) it runs
the same chat prompts free and under a JSON schema whose keys and constants are long literals,
greedy, and prints tokens/s, acceptance length, and the time spent in grammar work (path
masks, applying them) per output token and as a share of the run. The grammar work is timed
by wrapping the engine's and RequestGrammar's entry points here; the engine is unchanged.
"""

from __future__ import annotations

import argparse
import time

from specserve import LLM, SamplingParams
from specserve.engine.core import EngineCore
from specserve.structured import StructuredOutput
from specserve.structured import matcher as grammar_matcher

SCHEMA = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 24},
    "preferred_contact_method": {"enum": ["electronic_mail_message", "telephone_call"]},
    "order_status": {"const": "awaiting_payment_confirmation"},
    "number_of_items_in_the_order": {"type": "integer", "minimum": 0, "maximum": 99},
    "is_gift_wrapping_requested": {"type": "boolean"}},
    "required": ["customer_full_name", "preferred_contact_method", "order_status",
                 "number_of_items_in_the_order", "is_gift_wrapping_requested"]}
PROMPTS = ["Write the order record for a customer as JSON.",
           "Give me a JSON object describing a gift order.",
           "Summarise this customer's order as JSON: two books, paid by card."]

grammar_time = [0.0]


def timed(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            grammar_time[0] += time.perf_counter() - start
    return wrapper


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", choices=["demo", "default"])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--modes", default="off,default",
                        help="comma-separated speculation spellings; 'default': the engine's")
    args = parser.parse_args(argv)
    # The outermost grammar calls only (they do not nest): the target's masks and their
    # application, the draft's masked logits, tree pruning, commits.
    EngineCore._mask_logits = timed(EngineCore._mask_logits)
    R = grammar_matcher.RequestGrammar
    for name in ("masked_draft_logits", "prune", "commit"):
        setattr(R, name, timed(getattr(R, name)))
    llm = LLM("demo" if args.model == "demo" else None)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    spec = StructuredOutput.json(SCHEMA)
    llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=8, structured=spec))  # warm
    print(f"model {args.model}, default mode {llm.engine.default_mode}, "
          f"{len(PROMPTS)} prompts x <= {args.tokens} tokens, greedy")
    print(f"{'mode':>10} {'output':>10} {'tok/s':>7} {'tau':>5} {'grammar us/tok':>15} "
          f"{'grammar share':>14}")
    modes = [None if m == "default" else m for m in args.modes.split(",")]
    for mode in modes:
        for label, structured in (("free", None), ("schema", spec)):
            params = SamplingParams(temperature=0, max_tokens=args.tokens,
                                    structured=structured)
            grammar_time[0] = 0.0
            start = time.perf_counter()
            outs = llm.chat(convs, params, speculation=mode)
            wall = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            forwards = sum(len(o.token_ids) / o.metrics["acceptance_length"] for o in outs)
            print(f"{str(mode or llm.engine.default_mode):>10} {label:>10} "
                  f"{tokens / wall:7.1f} {tokens / forwards:5.2f} "
                  f"{grammar_time[0] / tokens * 1e6:15.1f} {grammar_time[0] / wall:14.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
