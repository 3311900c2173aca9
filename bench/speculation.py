"""What speculation buys on one pair: tokens/s and acceptance per mode, against no speculation.

    python -m bench.speculation                   # demo pair, 4 held-out prompts, 2 rounds
    python -m bench.speculation --pair widened --prompts 4 --rounds 3 --json out.json
    python -m bench.speculation --modes off,chain:4,tree:8,tree:24,tree:48

One ``LLM`` (one set of weights) runs every mode through ``generate(speculation=...)``: no
speculation, chains of 2, 4 and 6 draft tokens, and dynamic trees of 12 and 24 nodes, greedy at
batch 1 on the same prompts. Outputs are checked equal across modes before timing; rounds are
interleaved; columns and the per-stage profile are those of ``bench.compare`` (which holds the
shared code), with ratios to the ``off`` row. For the demo pair the model card's acceptance
(``draft_models/evaluate.py``) is printed beside the measured one: the card speculates from the
prompt on, while the engine's prefill forward commits one token before the first draft, and
acceptance here leaves that forward out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench.compare import (
    add_common_args,
    chat_prompts,
    environment,
    format_profile,
    format_rows,
    held_out_questions,
    load_pair,
    log,
    run_specserve,
    setup,
)
from specserve import LLM
from specserve.llm import demo_pair

MODES = ("off", "chain:2", "chain:4", "chain:6", "tree:12", "tree:24")


def model_card_acceptance() -> dict[str, float]:
    """The demo model card's greedy chain acceptance, by mode ("chain:K")."""
    results = json.loads((demo_pair()[0].parent / "results.json").read_text())
    return {f"chain:{a['k']}": a["acceptance_length"]
            for a in results["evaluation"]["acceptance"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speculation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="demo", choices=("demo", "widened"))
    parser.add_argument("--modes", default=",".join(MODES), help="first one is the baseline")
    add_common_args(parser)
    args = parser.parse_args(argv)
    setup(args)
    env = environment(args.threads)
    pair = load_pair(args.pair)
    llm = LLM(pair.target, pair.draft, dtype=args.dtype, enable_prefix_caching=False)
    questions = held_out_questions(args.prompts)
    prompts = chat_prompts(llm.tokenizer, questions)
    modes = args.modes.split(",")
    start = time.perf_counter()
    rows = run_specserve(llm, modes, prompts, args.max_tokens, args.rounds, args.ignore_eos,
                         log=log)
    wall = time.perf_counter() - start
    stop = "ignoring EOS" if args.ignore_eos else "stopping at EOS"
    print(f"pair {pair.name}: target {pair.target}, draft {pair.draft}\n"
          f"{len(prompts)} held-out prompts, greedy, batch 1, up to {args.max_tokens} tokens "
          f"({stop}), {args.rounds} timed rounds; {args.threads} threads, dtype {args.dtype}, "
          f"load average {env['load_average'][0]:.2f}\n"
          f"outputs: all {len(rows)} modes produced identical token ids "
          f"({rows[0].num_tokens} tokens)\n")
    print(format_rows(rows, [(modes[0], rows[0])]))
    print()
    print(format_profile(rows))
    card = model_card_acceptance() if pair.name == "demo" else {}
    if card:
        measured = {r.name: r.acceptance_length for r in rows}
        print("\nacceptance, measured here vs the model card (24 prompts, fp32, first step "
              "speculated): " + ", ".join(f"{m} {measured[m]:.2f} vs {a:.2f}"
                                          for m, a in card.items() if m in measured))
    print(f"\nwall time {wall:.0f} s, load average at the end {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "settings": {k: str(v) if k == "json" else v for k, v in vars(args).items()},
            "environment": env, "questions": questions, "model_card_acceptance": card,
            "rows": [r.summary() for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
