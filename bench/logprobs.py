"""What log-probabilities cost: output tokens/s with and without them, side by side.

    python -m bench logprobs                                  # demo pair, default speculation
    python -m bench logprobs --batch 1 16 --max-tokens 64 --repeats 3
    python -m bench logprobs --speculation off --top 0 5 20
    python -m bench logprobs --target DIR [--draft DIR] [--json]

For each batch size N, the first N prompts of `bench.batching`'s demo-domain set run greedy
(`ignore_eos`, fixed output length) on one engine, once per variant: no logprobs, then
`logprobs=K` for each `--top` K. Variants alternate order across repeats; the table shows the
median output tokens/s and its ratio to the run without logprobs, and whether every variant
produced the same token ids (it must: logprobs only read the verify forward's logits).

A last table times prompt scoring, what `echo` + `max_tokens=0` asks for (evaluation
harnesses): the same prompts with `max_tokens=1`, with and without `prompt_logprobs=1`, as
prompt tokens/s. Prefix caching is off so every run computes its prompts.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.batching import demo_prompts
from bench.options import add_json, write_json


def _run(llm, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def main(argv: list[str] | None = None, prog: str = "python -m bench logprobs") -> None:
    from specserve import LLM, SamplingParams

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--speculation")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--top", type=int, nargs="+", default=[0, 5, 20],
                        help="logprobs=K variants (alternatives per position)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_json(parser)
    args = parser.parse_args(argv)

    llm = LLM(args.target, args.draft, speculation=args.speculation,
              enable_prefix_caching=False)
    if not args.json:
        print(f"speculation {llm.engine.default_mode}, {args.max_tokens} output tokens per "
              f"request, median of {args.repeats}", flush=True)
    tok = llm.tokenizer
    variants = [None, *args.top]
    rows, scoring = [], []
    for n in args.batch:
        prompts = [tok.encode(p, add_special_tokens=False) for p in demo_prompts(n)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        times = {v: [] for v in variants}
        ids = {}
        for rep in range(args.repeats):
            order = variants if rep % 2 == 0 else variants[::-1]
            for v in order:
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                        ignore_eos=True, logprobs=v)
                wall, out = _run(llm, prompts, params)
                times[v].append(wall)
                ids.setdefault(v, out)
        tokens = n * args.max_tokens
        base = tokens / statistics.median(times[None])
        for v in variants:
            tps = tokens / statistics.median(times[v])
            rows.append({"batch": n, "logprobs": v, "tok_s": round(tps, 1),
                         "ratio": round(tps / base, 3), "same_ids": ids[v] == ids[None]})
            if not args.json:
                print(_decode_row(rows[-1]), flush=True)
        # Prompt scoring: one output token each, with and without prompt logprobs.
        prompt_tokens = sum(len(p) for p in prompts)
        score = {False: [], True: []}
        for rep in range(args.repeats):
            for with_lp in ((False, True) if rep % 2 == 0 else (True, False)):
                params = SamplingParams(temperature=0, max_tokens=1,
                                        prompt_logprobs=1 if with_lp else None)
                score[with_lp].append(_run(llm, prompts, params)[0])
        plain = prompt_tokens / statistics.median(score[False])
        with_lp = prompt_tokens / statistics.median(score[True])
        scoring.append({"batch": n, "prompt_tokens": prompt_tokens,
                        "prompt_tok_s": round(plain, 1),
                        "prompt_tok_s_with_prompt_logprobs": round(with_lp, 1),
                        "ratio": round(with_lp / plain, 3)})
        if not args.json:
            print(_scoring_row(scoring[-1]), flush=True)

    if args.json:
        write_json(args, {"decode": rows, "scoring": scoring})
        return
    print(f"\n{'batch':>5} {'logprobs':>8} {'tok/s':>9} {'ratio':>6} {'same ids':>8}")
    for r in rows:
        print(_decode_row(r))
    print("\nprompt scoring (max_tokens=1), prompt tokens/s")
    print(f"{'batch':>5} {'tokens':>6} {'plain':>9} {'+prompt lp':>10} {'ratio':>6}")
    for r in scoring:
        print(_scoring_row(r))


def _decode_row(r: dict) -> str:
    v = "none" if r["logprobs"] is None else r["logprobs"]
    return (f"{r['batch']:>5} {v:>8} {r['tok_s']:>9.1f} {r['ratio']:>6.3f} "
            f"{'yes' if r['same_ids'] else 'NO':>8}")


def _scoring_row(r: dict) -> str:
    return (f"{r['batch']:>5} {r['prompt_tokens']:>6} {r['prompt_tok_s']:>9.1f} "
            f"{r['prompt_tok_s_with_prompt_logprobs']:>10.1f} {r['ratio']:>6.3f}")
