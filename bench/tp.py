"""Tensor parallelism: tp=1 against tp=N on one machine, batch 1, greedy, and the cost of the
collectives per target forward.

    python -m bench tp                                  # widened pair, tp 1 vs 2, off and chain:4
    python -m bench tp --pair demo --tp 2 --modes off --prompts 2 --max-tokens 32

For each tp (one engine at a time: one process holds one process group) every prompt runs once
per mode to warm up, then `--rounds` times; tok/s is generated tokens over wall time, each prompt's
best round, summed over prompts. Token ids of every tp are compared with tp=1 first.

Collectives (rank 0, from `specserve.distributed.collective_stats`): all-reduces (two per layer
and one for the embedding per forward of a split model), logit gathers and control broadcasts,
each counted and timed per target forward (`EngineStats.num_steps`). On one CPU machine a
collective's time includes waiting for the slower rank, not only the copy. The cores are split
between the ranks (`cores // tp` torch threads each), so on a machine with few cores expect no
speedup: tp is for models that do not fit one device.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from bench.compare import chat_prompts, held_out_questions, load_pair
from bench.options import add_modes, usable_cores
from specserve import LLM, SamplingParams
from specserve.distributed import CollectiveStats, collective_stats


def run_tp(pair, tp: int, modes: list[str], prompts: list[list[int]], max_tokens: int,
           rounds: int, draft_tp: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm = LLM(pair.target, pair.draft, tp=tp, draft_tp=draft_tp if tp > 1 else 1)
    try:
        result = {}
        for mode in modes:
            ids = [out.token_ids for out in llm.generate(prompts, params, speculation=mode)]
            steps0 = llm.engine.stats.num_steps
            stats0 = dataclasses.replace(collective_stats())
            best = [float("inf")] * len(prompts)
            tokens = [0] * len(prompts)
            for _ in range(rounds):
                for i, prompt in enumerate(prompts):
                    start = time.perf_counter()
                    out = llm.generate([prompt], params, speculation=mode)[0]
                    best[i] = min(best[i], time.perf_counter() - start)
                    tokens[i] = len(out.token_ids)
            steps = llm.engine.stats.num_steps - steps0
            now = collective_stats()
            delta = {f.name: getattr(now, f.name) - getattr(stats0, f.name)
                     for f in dataclasses.fields(CollectiveStats)}
            result[mode] = {"ids": ids, "tok_s": sum(tokens) / sum(best), "steps": steps,
                            "collectives": delta}
        return result
    finally:
        llm.shutdown()


def _all_reduce_loop(rank: int, world: int, port: int, shape: tuple[int, int], iters: int,
                     results) -> None:
    import torch

    from specserve.distributed import init_group
    from specserve.model.tp_worker import threads_per_rank

    torch.set_num_threads(threads_per_rank(world))
    init_group(rank, world, "cpu", "127.0.0.1", port)
    x = torch.ones(shape, dtype=torch.bfloat16)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        torch.distributed.all_reduce(x)
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put(sorted(times)[len(times) // 2])
    torch.distributed.destroy_process_group()


def all_reduce_latency(world: int, shape: tuple[int, int], iters: int = 500) -> float:
    """Median seconds of one gloo all-reduce of a bfloat16 `shape` tensor over `world` local
    processes (nothing else running: the collective's own cost)."""
    import torch.multiprocessing as mp

    from specserve.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_all_reduce_loop, args=(r, world, port, shape, iters, results))
             for r in range(world)]
    for p in procs:
        p.start()
    median = results.get(timeout=600)
    for p in procs:
        p.join()
    return median


def _agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """"same", or where the first prompt that differs parts (bfloat16 partial sums are rounded
    per rank before the all-reduce, so a near-tie can flip against tp=1)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return f"prompt {i} parts at token {pos}"
    return "same"


def main(argv: list[str] | None = None, prog: str = "python -m bench tp") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--pair", default="widened", help="demo | widened")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--draft-tp", type=int, default=1)
    add_modes(p, "off,chain:4")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024,
                   help="row width of the all-reduce latency probe (the widened target's)")
    args = p.parse_args(argv)
    for rows in (1, 5):
        latency = all_reduce_latency(args.tp, (rows, args.hidden))
        print(f"gloo all-reduce alone, {args.tp} processes, [{rows}, {args.hidden}] bf16: "
              f"{latency * 1e6:.0f} us median")
    pair = load_pair(args.pair)
    from specserve.model.loader import load_tokenizer
    prompts = chat_prompts(load_tokenizer(pair.target), held_out_questions(args.prompts))
    modes = args.modes.split(",")
    results = {tp: run_tp(pair, tp, modes, prompts, args.max_tokens, args.rounds, args.draft_tp)
               for tp in (1, args.tp)}
    print(f"pair {pair.name}, {usable_cores()} cores, tp {args.tp} (draft_tp {args.draft_tp}), "
          f"{args.prompts} prompts x {args.max_tokens} tokens, best of {args.rounds}")
    print(f"| mode | tp=1 tok/s | tp={args.tp} tok/s | ratio | ids as tp=1 | ids as {modes[0]} at "
          f"tp={args.tp} | all-reduces / fwd | ms all-reduce / fwd | us / all-reduce | "
          "ms gather+control / fwd |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        one, many = results[1][mode], results[args.tp][mode]
        c, steps = many["collectives"], max(1, many["steps"])
        print(f"| {mode} | {one['tok_s']:.1f} | {many['tok_s']:.1f} | "
              f"{many['tok_s'] / one['tok_s']:.2f}x | {_agreement(one['ids'], many['ids'])} | "
              f"{_agreement(results[args.tp][modes[0]]['ids'], many['ids'])} | "
              f"{c['all_reduce_count'] / steps:.1f} | {1e3 * c['all_reduce_s'] / steps:.2f} | "
              f"{1e6 * c['all_reduce_s'] / max(1, c['all_reduce_count']):.0f} | "
              f"{1e3 * (c['gather_s'] + c['control_s']) / steps:.2f} |")
    return 0
