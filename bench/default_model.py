"""The default model (SmolLM2-135M-Instruct with its shipped draft): load time, and decode speed
and acceptance per speculation mode against no speculation, greedy at batch 1.

    python -m bench.default_model                      # 4 held-out chat prompts, 1 round
    python -m bench.default_model --prompts 8 --rounds 2 --modes off,default,chain:4
    python -m bench.default_model --turns 2            # second turns, first reply in context

The prompts are the draft recipe's held-out chat questions (`draft_models/chat_prompts.py`),
which the draft never saw. "default" is the engine's own choice for the loaded pair. Rows,
checks (identical outputs in every mode) and columns are those of `bench.compare`. Where the
llama.cpp peer is built (`../shared/tools/llamacpp-peer build`), a `llama.cpp` row runs the same
GGUF file through `llama-completion` (greedy, the same threads; timed by its own prompt and
eval lines, so its tok/s counts the prompt as specserve's do and its ms/tok is its decode alone),
interleaved with specserve's rows; `--no-llamacpp` leaves it out. Last, each specserve row's
time per generated token by engine stage (draft, target forward, ...), as `bench.compare`
prints it: with the acceptance, what a draft level and a verified row cost on this CPU.

`--target FILE.gguf [--draft DRAFT]` measures another model the same way instead (e.g. a
Q4_K_M file, such as the Gemma 3 270M one): llama.cpp runs the same target file, with
`llama-speculative` and the draft when the draft is a GGUF file too.

`--turns 2` measures second turns instead: each held-out question, the target's own greedy
reply, then a follow-up asking to restate or reuse it (where suffix drafting finds its text).
The suffix store is emptied before every prompt (as every bench runner does), so no mode drafts
from another mode's (or an earlier round's) reply to the same question.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.compare import (
    add_common_args,
    chat_prompts,
    environment,
    format_profile,
    format_rows,
    log,
    setup,
    specserve_runner,
)
from bench.cpu_paths import PEER, decode_table, llamacpp_runner, measure_decode, peer_bin
from specserve import LLM, SamplingParams
from specserve.draft_models.chat_prompts import HELD_OUT_PROMPTS

LLAMA = "llama.cpp"
# Second turns that reuse the first reply, as people ask them.
FOLLOW_UPS = (
    "Can you repeat that, but as a numbered list?",
    "Please rewrite your answer in a more formal tone.",
    "Summarize what you just said in two sentences.",
    "Say that again, but shorter.",
)


def second_turns(llm, questions: list[str], max_tokens: int) -> list[list[int]]:
    """Chat prompts of second turns: question, the target's greedy reply, a follow-up."""
    chats = [[{"role": "user", "content": q}] for q in questions]
    replies = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                       speculation="off")
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template(
        chat + [{"role": "assistant", "content": r.text},
                {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]}],
        tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for i, (chat, r) in enumerate(zip(chats, replies))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.default_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes",
                        default="off,default,chain:2,chain:4,tree:8,suffix,suffix+adaptive",
                        help="first one is the baseline; 'default' is the engine's choice")
    parser.add_argument("--turns", type=int, choices=(1, 2), default=1,
                        help="2: second turns with the first reply in context")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--target", type=Path, help="another model (default: the default model)")
    parser.add_argument("--draft", help="its draft (a folder or GGUF file; default: none)")
    parser.add_argument("--peer", type=Path, default=PEER, help="the llama.cpp peer script")
    add_common_args(parser)
    # The model as `LLM()` loads it (float32 activations for the GGUF), unless --dtype says.
    parser.set_defaults(rounds=1, dtype="auto")
    args = parser.parse_args(argv)
    setup(args)
    env = environment(args.threads)
    start = time.perf_counter()
    if args.draft is not None and args.target is None:
        parser.error("--draft needs --target (the default model comes with its own draft)")
    llm = LLM(args.target, args.draft, dtype=args.dtype, enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    log(f"loaded in {load_s:.1f} s; default mode {llm.engine.default_mode}")
    tok = llm.tokenizer
    questions = list(HELD_OUT_PROMPTS[:args.prompts])
    if not getattr(tok, "chat_template", None):  # e.g. a GGUF file without one in its metadata
        if args.turns == 2:
            parser.error("--turns 2 needs a chat template; this model's tokenizer has none")
        log("  the tokenizer has no chat template: the questions run as plain text")
        prompts = [tok.encode(q) for q in questions]
    else:
        prompts = (chat_prompts(tok, questions) if args.turns == 1
                   else second_turns(llm, questions, args.max_tokens))
    names = args.modes.split(",")
    runners = {name: specserve_runner(llm, None if name == "default" else name, args.max_tokens,
                                      args.ignore_eos)
               for name in names}
    bin_dir = None if args.no_llamacpp else peer_bin(args.peer)
    gguf, draft = llm.engine.config.target, llm.engine.config.draft
    if bin_dir is not None and gguf.suffix == ".gguf":
        runners[LLAMA] = llamacpp_runner(bin_dir, gguf, None, tok, args.max_tokens, args.threads)
        if args.target is not None and draft is not None and Path(draft).suffix == ".gguf":
            runners[LLAMA + " + draft"] = llamacpp_runner(bin_dir, gguf, Path(draft), tok,
                                                          args.max_tokens, args.threads)
    elif not args.no_llamacpp:
        log(f"  no llama.cpp row: the peer is not built ({args.peer} build) or the target is "
            "not a GGUF file")
    rows = measure_decode(runners, {"specserve": names}, prompts, args.rounds)
    print(f"{llm.engine.config.target.name} + {llm.engine.config.draft}: loaded in "
          f"{load_s:.1f} s; {len(prompts)} held-out chat prompts (turn {args.turns}), greedy, "
          f"batch 1, up to {args.max_tokens} tokens, {args.rounds} timed round(s); "
          f"{args.threads} threads, dtype {args.dtype}, load average {env['load_average'][0]:.2f}\n"
          f"outputs: all {len(names)} modes produced identical token ids\n")
    by_name = {row.name: row for row in rows}
    print(format_rows(rows, [(names[0], by_name[names[0]]), (LLAMA, by_name.get(LLAMA))]))
    print("\n" + "\n".join(decode_table(rows, [names[0], LLAMA])))
    # Where each mode's time goes (draft levels, target forwards): why a mode pays or not on
    # the CPU at hand.
    print("\n" + format_profile(rows))
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
