"""The decoder's layers in one C call against the same layers one by one, side by side.

    python -m bench.cpu_stack                                  # default model, widened bf16/int8
    python -m bench.cpu_stack --models default --modes off,chain:2 --rounds 2

Each model loads once; every mode runs twice per prompt, with `SPECSERVE_CPU_STACK=1` (one
`decoder_layers` call per forward of at most 32 rows) and `=0` (the layers from Python, each op
its own C kernel call), interleaved, after a check that both give the same token ids. Rows are
decode rates (tokens after the first, each prompt's best round), as `bench.cpu_paths` prints
them. Models: `default` (SmolLM2-135M-Instruct with its draft, float32), `widened` (the
widened demo target with the demo draft, bf16) and `widened-int8` (the same, quantized at load).
"""

from __future__ import annotations

import argparse
import os
import time

from bench.compare import (
    add_common_args,
    chat_prompts,
    ensure_widened_demo,
    environment,
    log,
    setup,
    specserve_runner,
)
from bench.cpu_paths import decode_table, measure_decode
from specserve import LLM
from specserve.draft_models.chat_prompts import HELD_OUT_PROMPTS
from specserve.named_models import demo_pair

MODELS = ("default", "widened", "widened-int8")


def load(name: str) -> LLM:
    if name == "default":
        return LLM(enable_prefix_caching=False)
    _, draft = demo_pair()
    quantization = "int8" if name == "widened-int8" else None
    return LLM(ensure_widened_demo(), draft, dtype="bfloat16", quantization=quantization,
               enable_prefix_caching=False)


def with_stack(run, stack: str):
    """`run` with SPECSERVE_CPU_STACK set to `stack` while it runs."""
    def timed(prompt):
        before = os.environ.get("SPECSERVE_CPU_STACK")
        os.environ["SPECSERVE_CPU_STACK"] = stack
        try:
            return run(prompt)
        finally:
            if before is None:
                del os.environ["SPECSERVE_CPU_STACK"]
            else:
                os.environ["SPECSERVE_CPU_STACK"] = before
    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    parser.add_argument("--modes", default="off,chain:2")
    add_common_args(parser)
    parser.set_defaults(rounds=1, max_tokens=32, prompts=2)
    args = parser.parse_args(argv)
    setup(args)
    env = environment(args.threads)
    print(f"{args.threads} threads, load average {env['load_average'][0]:.2f}; "
          f"{args.prompts} held-out chat prompts x {args.max_tokens} tokens, greedy, batch 1")
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
        log(f"{name}: loading")
        llm = load(name)
        prompts = chat_prompts(llm.tokenizer, HELD_OUT_PROMPTS[:args.prompts])
        runners, groups = {}, {}
        for mode in args.modes.split(","):
            run = specserve_runner(llm, mode, args.max_tokens, args.ignore_eos)
            pair = [f"{mode} stack", f"{mode} layers"]
            runners.update({pair[0]: with_stack(run, "1"), pair[1]: with_stack(run, "0")})
            groups[mode] = pair
        start = time.perf_counter()
        rows = measure_decode(runners, groups, prompts, args.rounds)
        log(f"{name}: {time.perf_counter() - start:.0f} s")
        print(f"\n{name}: both paths produced identical token ids")
        print("\n".join(decode_table(rows, [f"{args.modes.split(',')[0]} layers"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
