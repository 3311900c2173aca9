"""Pipeline parallelism: pp=1 against pp=N on one machine, batch-1 decode and a 16-chat load,
with micro-batches in flight (the batch queue) and without, and what crosses a stage boundary.

    python -m bench pp                                  # widened pair, pp 1 vs 2
    python -m bench pp --pair demo --chats 16 --max-tokens 16

Two engines, one after the other (one process holds one process group): pp=1, then pp=N, in
which one micro-batch at a time (`PipelinedEngine.depth = 1`) and up to N in flight alternate
round by round; each row is its best of `--rounds`. Greedy token ids of every row are compared
with pp=1's.

Per target forward (rank 0): *stage 0* is rank 0's own layers (`ModelRunner.submit`), *wait* is
the time rank 0 then waits for the last stage's results (`collect`): the other stages' compute,
the transfers, and under the batch queue nothing at all when the results are already there.
*transfer* is the model of the wire cost: the measured one-way time of the bytes each forward
sends down a boundary (header, payload, hidden states) and back (logits [R, vocab] float32),
from a two-process gloo ping-pong of those sizes (`p2p_latency`), so *other stages* is
wait - transfer. Bytes per step per boundary are rank 0's link counters
(`specserve.distributed.collective_stats`) over the forwards.

`--threads` sets the pp=1 engine's torch threads (default: every core). On a machine shared with
other work a 2-thread run waits at every parallel region for a descheduled thread, so there
`--threads 1` (one core, as each stage of pp=2 gets) is the fair baseline; the load average is
printed beside the figures.

What two shared cores hide: the stages share the machine's cores (`cores // pp` torch threads
each), so pp=2 runs each stage on one core instead of the model on two: at batch 1 pp=2 is
slower than pp=1 here, and the batch queue can only give back the idle core (it overlaps stage
0's next micro-batch with stage 1's current one). Transfers are loopback copies of a few KiB, so
the wire cost is nearly nothing here. On separate machines each stage has its machine's cores:
batch-1 latency is about pp=1's plus one hidden-state transfer per boundary and the logits back
(a forward's layers run one stage after another, so pp does not cut batch-1 latency), while
under load the batch queue keeps every stage busy and throughput scales toward pp x. Against
tensor parallelism across machines: TP all-reduces [T, H] twice per layer (49 per forward on
the widened target, each paying the network's latency), PP sends [T, H] once per boundary per
forward; the bench prints both byte counts per decode token.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from bench.compare import chat_prompts, held_out_questions, load_pair
from bench.options import add_threads, cpu, usable_cores
from specserve import LLM, SamplingParams
from specserve.distributed import CollectiveStats, collective_stats


@dataclasses.dataclass
class ForwardTimes:
    """Rank 0's seconds in `submit` (stage 0's layers) and `collect` (waiting) and forwards."""

    stage0_s: float = 0.0
    wait_s: float = 0.0
    forwards: int = 0


def _time_runner(runner, times: ForwardTimes) -> None:
    """Wrap the runner's submit/collect (on this instance, until `_untime_runner`) to
    accumulate their wall time."""
    submit, collect = runner.submit, runner.collect

    def timed_submit(segments):
        start = time.perf_counter()
        try:
            return submit(segments)
        finally:
            times.stage0_s += time.perf_counter() - start
            times.forwards += 1

    def timed_collect(pending, hidden_out=None):
        start = time.perf_counter()
        try:
            return collect(pending, hidden_out)
        finally:
            times.wait_s += time.perf_counter() - start

    runner.submit, runner.collect = timed_submit, timed_collect


def _untime_runner(runner) -> None:
    del runner.submit, runner.collect  # the class's methods again


def _stats_delta(before: CollectiveStats) -> dict:
    now = collective_stats()
    return {f.name: getattr(now, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(CollectiveStats)}


def _measure(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One timed generate of `prompts` together."""
    times = ForwardTimes()
    _time_runner(llm.engine.runner, times)
    stats0 = dataclasses.replace(collective_stats())
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, speculation="off")
    finally:
        _untime_runner(llm.engine.runner)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"ids": [o.token_ids for o in outs], "tok_s": tokens / wall, "wall_s": wall,
            "times": times, "link": _stats_delta(stats0)}


def run_engine(pair, pp: int, depths: list[int], work: dict, rounds: int) -> dict:
    """One engine at `pp`; per depth (micro-batches in flight at most) and work kind, the
    best of `rounds` timed runs, the depths interleaved round by round (the machine's speed
    drifts). `work`: kind -> (prompts, params)."""
    llm = LLM(pair.target, pp=pp)
    try:
        for prompts, params in work.values():  # warm-up: every shape once
            llm.generate(prompts, params, speculation="off")
        best: dict = {depth: {} for depth in depths}
        for _ in range(rounds):
            for depth in depths:
                if pp > 1:
                    llm.engine.depth = depth
                    llm.engine.max_in_flight = 0
                for kind, (prompts, params) in work.items():
                    run = _measure(llm, prompts, params)
                    if pp > 1:
                        run["max_in_flight"] = llm.engine.max_in_flight
                    if kind not in best[depth] or run["tok_s"] > best[depth][kind]["tok_s"]:
                        best[depth][kind] = run
        spec = llm.engine.target.spec
        for result in best.values():
            result.update(hidden=spec.hidden_size, vocab=spec.vocab_size,
                          dtype=llm.engine.target.dtype)
        return best
    finally:
        llm.shutdown()


def _p2p_loop(rank: int, port: int, sizes: list[int], iters: int, results) -> None:
    import torch.distributed as dist

    from specserve.model.tp_worker import threads_per_rank

    torch.set_num_threads(threads_per_rank(2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    medians = []
    for size in sizes:
        x = torch.zeros(max(1, size), dtype=torch.uint8)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            times.append(time.perf_counter() - start)
        medians.append(sorted(times)[len(times) // 2] / 2)  # one way
    if rank == 0:
        results.put(medians)
    dist.destroy_process_group()


def p2p_latency(sizes: list[int], iters: int = 200) -> list[float]:
    """Median one-way seconds of a gloo send of each byte size between two local processes
    (a ping-pong, nothing else running)."""
    import torch.multiprocessing as mp

    from specserve.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_p2p_loop, args=(r, port, sizes, iters, results))
             for r in range(2)]
    for p in procs:
        p.start()
    medians = results.get(timeout=600)
    for p in procs:
        p.join()
    return medians


def _row(name: str, one: dict, run: dict, probe: dict[int, float], pp: int) -> str:
    times, link = run["times"], run["link"]
    forwards = max(1, times.forwards)
    down = link["send_bytes"] / forwards  # rank 0 -> stage 1, per forward
    back = link["recv_bytes"] / forwards  # last stage -> rank 0
    transfer = (probe[round(down)] + probe[round(back)]) if pp > 1 else 0.0
    wait = times.wait_s / forwards
    same = "same" if run["ids"] == one["ids"] else "DIFFER"
    return (f"| {name} | {run['tok_s']:.1f} | {run['tok_s'] / one['tok_s']:.2f}x | {same} | "
            f"{forwards} | {1e3 * times.stage0_s / forwards:.1f} | {1e3 * wait:.1f} | "
            f"{1e3 * transfer:.2f} | {1e3 * max(0.0, wait - transfer):.1f} | "
            f"{down:.0f} | {back:.0f} |")


def pair_layers(pair) -> int:
    from specserve.model.loader import load_hf_config

    return load_hf_config(pair.target).num_hidden_layers


def main(argv: list[str] | None = None, prog: str = "python -m bench pp") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--pair", default="widened", help="demo | widened (only its target runs)")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--chats", type=int, default=16, help="the load: chats generated together")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--load-max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="timed runs per row (best kept)")
    add_threads(p)  # the pp=1 engine's; each rank of pp=N gets cores // N
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_pair(args.pair)
    from specserve.model.loader import load_tokenizer
    tokenizer = load_tokenizer(pair.target)
    questions = held_out_questions(min(args.chats, 12))
    load = chat_prompts(tokenizer, [questions[i % len(questions)] + " " * (i // len(questions))
                                    for i in range(args.chats)])
    batch1 = load[:1]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    load_params = SamplingParams(temperature=0.0, max_tokens=args.load_max_tokens,
                                 ignore_eos=True)
    configs = {"pp=1": (1, 1), f"pp={args.pp}, 1 in flight": (args.pp, 1),
               f"pp={args.pp}, up to {args.pp} in flight": (args.pp, args.pp)}
    work = {"batch1": (batch1, params), "load": (load, load_params)}
    single = run_engine(pair, 1, [1], work, args.rounds)
    split = run_engine(pair, args.pp, [1, args.pp], work, args.rounds)
    results = {"pp=1": single[1], f"pp={args.pp}, 1 in flight": split[1],
               f"pp={args.pp}, up to {args.pp} in flight": split[args.pp]}
    one = results["pp=1"]
    sizes = sorted({round(r[kind]["link"][f"{way}_bytes"] / max(1, r[kind]["times"].forwards))
                    for r in results.values() for kind in ("batch1", "load")
                    for way in ("send", "recv")})
    probe = dict(zip(sizes, p2p_latency(sizes)))
    info = cpu()
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} (other processes "
          f"share the cores: read the ratios)")
    print(f"pp=1 runs {args.threads} torch threads, each rank of pp={args.pp} "
          f"{max(1, usable_cores() // args.pp)}")
    print(f"pair {pair.name} target ({one['hidden']} hidden, vocab {one['vocab']}, "
          f"{one['dtype']}), {usable_cores()} cores ({info.get('model_name')}, family "
          f"{info.get('family')} model {info.get('model')}, {' '.join(info.get('flags', []))})")
    for kind, label in (("batch1", f"batch-1 decode, 1 chat x {args.max_tokens} tokens"),
                        ("load", f"{args.chats} chats together x {args.load_max_tokens} tokens")):
        print(f"\n{label}, greedy, speculation off (ms per target forward; bytes per forward "
              f"per boundary)")
        print("| config | tok/s | vs pp=1 | ids as pp=1 | forwards | stage 0 ms | wait ms | "
              "transfer ms | other stages ms | bytes down | bytes back |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, run in results.items():
            pp = configs[name][0]
            print(_row(name, one[kind], run[kind], probe, pp))
        for name, run in results.items():
            if "max_in_flight" in run[kind]:
                print(f"{name}: at most {run[kind]['max_in_flight']} micro-batches were in "
                      f"flight")
    H, layers = one["hidden"], pair_layers(pair)
    item = torch.empty(0, dtype=one["dtype"]).element_size()
    print(f"\nper decode token and boundary across machines: PP sends one hidden row, {H} x "
          f"{item} B = {H * item} B, once per boundary (plus {one['vocab']} x 4 B of logits "
          f"back from the last stage); TP sends {2 * layers + 1} all-reduces of {H * item} B "
          f"per forward ({(2 * layers + 1) * H * item} B, each paying the link's latency)")
    return 0
