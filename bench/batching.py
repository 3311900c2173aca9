"""Continuous batching: N requests submitted together vs the same N run one after another.

    python -m bench throughput                      # demo target alone, speculation off
    python -m bench throughput --concurrency 1 4 16 32 --max-tokens 64 --repeats 1
    python -m bench throughput --speculation tree   # demo target + demo draft
    python -m bench throughput --target DIR [--draft DIR] [--json]
    python -m bench throughput --target MODEL.gguf --beside-llamacpp   # decode beside llama.cpp

For each N, the first N prompts of one fixed list run twice on one engine:

- concurrent: one `LLM.generate` call with all N prompts, so the scheduler batches them;
- sequential: N `LLM.generate` calls with one prompt each.

Prompts are token ids of demo-domain text of mixed lengths: ChatML questions about the Python
standard library (some with a system message) and raw stdlib source prefixes of several lengths.
Every request is greedy with a fixed output length (`ignore_eos`), so both runs produce exactly
N x max_tokens tokens and, greedy, the same ids; the table says whether they did. Aggregate
output tokens/s = N x max_tokens / wall time of the whole run; speedup = concurrent / sequential.
At N = 1 both runs do the same work, so that row's speedup shows the measurement's noise.

The scheduler's own cost comes from the engine's counters (`engine.stats`), differenced around
each run: `schedule_time_s / num_steps` in microseconds, and its share of step time (schedule +
draft + target forward + verify + commit). Prefix caching is off by default (`--prefix-caching`
turns it on), so whichever run goes second does not reuse the first run's prompt KV. Repeats
alternate which run goes first; the table shows the median.

`--beside-llamacpp` (a GGUF `--target`) measures instead what llama.cpp's `llama-batched-bench
-npp 64 -ntg 64 -npl N` does, on the same file in the same run: N sequences of 64 random prompt
tokens (fresh ids each time: no prefix hits), 64 new tokens each, greedy; aggregate decode
tokens/s = N x 64 / (time of 65 new tokens - time of 1, the prefill), beside its S_TG column
(decode tokens/s over all sequences), and both prefill rates. The two alternate, one N at a
time (ours, then llama.cpp's, `--repeats` times, each side's best kept), so a drift in the
machine's speed over the minutes a sweep takes lands on both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import inspect
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.options import add_json, add_threads, write_json

_NAMES = ("json.dumps", "textwrap.wrap", "os.path.join", "collections.Counter",
          "functools.lru_cache", "itertools.groupby", "re.sub", "pathlib.Path.glob",
          "subprocess.run", "datetime.timedelta", "heapq.heappush", "argparse.ArgumentParser",
          "shutil.copytree", "csv.DictReader", "logging.getLogger", "random.shuffle")
_QUESTIONS = ("What does `{}` do?", "What are the parameters of `{}`?",
              "Show me the source of `{}`.",
              "How do I use `{}` in a small script, and what does it return or raise when its "
              "input is empty? Please give a short example.")
_CODE_MODULES = ("textwrap", "json", "heapq", "shlex", "fnmatch", "bisect", "colorsys", "glob")


def demo_prompts(n: int) -> list[str]:
    """`n` demo-domain prompts of mixed lengths: every 4th a stdlib source prefix, the rest chat."""
    import importlib

    from specserve.draft_models.data import SYSTEM_PROMPT
    from specserve.draft_models.tokenizer import render_chat

    prompts = []
    for i in range(n):
        if i % 4 == 3:
            name = _CODE_MODULES[(i // 4) % len(_CODE_MODULES)]
            lines = inspect.getsource(importlib.import_module(name)).splitlines()
            prompts.append(f"# file: {name}.py\n" + "\n".join(lines[: 6 + 5 * (i % 7)]) + "\n")
            continue
        question = _QUESTIONS[i % len(_QUESTIONS)].format(_NAMES[i % len(_NAMES)])
        messages = [{"role": "user", "content": question}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        prompts.append(render_chat(messages, add_generation_prompt=True))
    return prompts


_FIELDS = ("num_steps", "schedule_time_s", "draft_time_s", "target_forward_time_s",
           "verify_time_s", "commit_time_s")


@dataclass
class RunStats:
    """One run (all N requests, one way): wall time, tokens and the engine's step counters."""

    wall_s: float
    output_tokens: int
    num_steps: int
    schedule_time_s: float
    draft_time_s: float
    target_forward_time_s: float
    verify_time_s: float
    commit_time_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def step_time_s(self) -> float:
        return (self.schedule_time_s + self.draft_time_s + self.target_forward_time_s
                + self.verify_time_s + self.commit_time_s)

    @property
    def schedule_us_per_step(self) -> float:
        return 1e6 * self.schedule_time_s / max(1, self.num_steps)

    @property
    def schedule_share(self) -> float:
        return self.schedule_time_s / self.step_time_s if self.step_time_s else 0.0

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.step_time_s / max(1, self.num_steps)


def _timed(llm, prompts: list[list[int]], params, one_by_one: bool
           ) -> tuple[RunStats, list[list[int]]]:
    stats = llm.engine.stats
    before = {f: getattr(stats, f) for f in _FIELDS}
    t0 = time.perf_counter()
    if one_by_one:
        outputs = [out for p in prompts for out in llm.generate([p], params)]
    else:
        outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    ids = [o.token_ids for o in outputs]
    return RunStats(wall, sum(map(len, ids)),
                    **{f: getattr(stats, f) - before[f] for f in _FIELDS}), ids


@dataclass
class Row:
    concurrency: int
    sequential: RunStats  # median-wall repeat
    concurrent: RunStats
    outputs_equal: bool  # every request's ids equal between the two ways, in every repeat
    # (request index, first differing token) for each request whose ids differ (first repeat)
    differences: list[tuple[int, int]]

    @property
    def speedup(self) -> float:
        return self.concurrent.tokens_per_s / self.sequential.tokens_per_s


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _median_run(runs: list[RunStats]) -> RunStats:
    return sorted(runs, key=lambda r: r.wall_s)[(len(runs) - 1) // 2]


def run_batching(llm, concurrency: tuple[int, ...] = (1, 4, 16, 32), max_tokens: int = 64,
                 repeats: int = 1, prompts: list[str] | None = None) -> list[Row]:
    """One row per N in `concurrency`; see the module docstring."""
    from specserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    texts = prompts if prompts is not None else demo_prompts(max(concurrency))
    ids = [llm.tokenizer.encode(t) for t in texts]
    llm.generate(ids[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    rows = []
    for n in concurrency:
        batch = ids[:n]
        seq_runs, conc_runs, equal, differences = [], [], True, None
        for r in range(repeats):
            order = (True, False) if r % 2 == 0 else (False, True)
            results = {one_by_one: _timed(llm, batch, params, one_by_one) for one_by_one in order}
            (seq, seq_ids), (conc, conc_ids) = results[True], results[False]
            seq_runs.append(seq)
            conc_runs.append(conc)
            diff = [(i, _first_difference(a, b))
                    for i, (a, b) in enumerate(zip(seq_ids, conc_ids)) if a != b]
            equal &= not diff
            differences = diff if differences is None else differences
        rows.append(Row(n, _median_run(seq_runs), _median_run(conc_runs), equal, differences))
    return rows


def prompt_lengths(llm, prompts: list[str]) -> list[int]:
    return [len(llm.tokenizer.encode(p)) for p in prompts]


def format_rows(rows: list[Row]) -> str:
    head = (f"{'N':>3} {'tokens':>7} | {'sequential':^34} | {'concurrent':^34} | "
            f"{'speedup':>7} {'ids':>5}\n"
            f"{'':>3} {'':>7} | {'tok/s':>8} {'steps':>6} {'ms/step':>8} {'sched':>10} | "
            f"{'tok/s':>8} {'steps':>6} {'ms/step':>8} {'sched':>10} | {'':>7} {'equal':>5}")
    lines = [head]
    for row in rows:
        cells = []
        for run in (row.sequential, row.concurrent):
            cells.append(f"{run.tokens_per_s:8.1f} {run.num_steps:6d} {run.ms_per_step:8.2f} "
                         f"{run.schedule_us_per_step:3.0f}us {100 * run.schedule_share:4.1f}%")
        eq = "yes" if row.outputs_equal else f"{len(row.differences)}/{row.concurrency} differ"
        lines.append(f"{row.concurrency:3d} {row.concurrent.output_tokens:7d} | {cells[0]} | "
                     f"{cells[1]} | {row.speedup:6.2f}x {eq:>5}")
    lines.append("tok/s: aggregate output tokens per wall second; ms/step: engine step time "
                 "(schedule + draft + target forward + verify + commit) per step; sched: "
                 "scheduler time per step and its share of step time")
    breakdown = []
    for row in rows:
        c = row.concurrent
        steps = max(1, c.num_steps)
        breakdown.append(f"  N={row.concurrency:<3d} schedule {1e3 * c.schedule_time_s / steps:.3f}"
                         f"  draft {1e3 * c.draft_time_s / steps:.3f}"
                         f"  forward {1e3 * c.target_forward_time_s / steps:.3f}"
                         f"  verify {1e3 * c.verify_time_s / steps:.3f}"
                         f"  commit {1e3 * c.commit_time_s / steps:.3f} ms/step;"
                         f"  outside steps {100 * (1 - c.step_time_s / c.wall_s):.1f}% of wall")
    for row in rows:
        if row.differences:
            lines.append(f"N={row.concurrency}: ids differ between the two runs for (request, "
                         f"first differing output token) {row.differences}")
    return "\n".join(lines + ["concurrent runs, where the step time goes:"] + breakdown)


def decode_rates(llm, concurrency: tuple[int, ...], repeats: int, prompt_len: int = 64,
                 new_tokens: int = 64) -> dict[int, dict[str, float]]:
    """Per N: aggregate prefill and decode tokens/s of N sequences of `prompt_len` random ids
    (as llama-batched-bench times them; see the module docstring)."""
    from specserve import SamplingParams

    gen = torch.Generator().manual_seed(0)
    vocab = llm.tokenizer.vocab_size
    out = {}
    for n in concurrency:
        best: dict[int, float] = {}
        for _ in range(repeats):
            prompts = [torch.randint(100, vocab, (prompt_len,), generator=gen).tolist()
                       for _ in range(n)]
            for new in (1, new_tokens + 1):
                params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
                start = time.perf_counter()
                llm.generate(prompts, [params] * n)
                best[new] = min(best.get(new, float("inf")), time.perf_counter() - start)
        decode_s = best[new_tokens + 1] - best[1]
        out[n] = {"prefill_tok_s": n * prompt_len / best[1],
                  "decode_tok_s": n * new_tokens / decode_s}
    return out


def llamacpp_batched(gguf: Path, concurrency: tuple[int, ...], threads: int,
                     prompt_len: int = 64, new_tokens: int = 64) -> dict[int, dict[str, float]]:
    """llama-batched-bench's S_PP and S_TG per N on gguf (the peer build; {} without it)."""
    from bench.cpu_paths import PEER, peer_bin, run_peer

    bin_dir = peer_bin(PEER)
    if bin_dir is None:
        return {}
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", "16384",
           "-npp", str(prompt_len), "-ntg", str(new_tokens),
           "-npl", ",".join(map(str, concurrency)), "-t", str(threads), "-tb", str(threads)]
    text = run_peer(cmd).stdout
    out = {}
    for line in text.splitlines():  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[2]):
            out[int(cells[2])] = {"prefill_tok_s": float(cells[5]),
                                  "decode_tok_s": float(cells[7])}
    return out


def rates_beside_llamacpp(llm, gguf: Path, concurrency: tuple[int, ...], repeats: int,
                          threads: int) -> tuple[dict, dict]:
    """(ours, llama.cpp's) per N as decode_rates and llamacpp_batched give them, measured in
    turns: for each N, `repeats` rounds of ours then theirs; per side the round with the higher
    decode rate. llama.cpp's side is empty without the peer build."""
    ours: dict[int, dict[str, float]] = {}
    theirs: dict[int, dict[str, float]] = {}
    for n in concurrency:
        for _ in range(repeats):
            for side, rates in ((ours, decode_rates(llm, (n,), 1)),
                                (theirs, llamacpp_batched(gguf, (n,), threads))):
                if n in rates and rates[n]["decode_tok_s"] > side.get(n, {}).get(
                        "decode_tok_s", -1.0):
                    side[n] = rates[n]
    return ours, theirs


def format_beside(ours: dict, theirs: dict) -> str:
    lines = ["| N | specserve decode tok/s | llama.cpp decode tok/s | ratio | specserve prefill "
             "tok/s | llama.cpp prefill tok/s |", "|---|---|---|---|---|---|"]
    for n, mine in ours.items():
        peer = theirs.get(n)
        ratio = f"{mine['decode_tok_s'] / peer['decode_tok_s']:.2f}x" if peer else "-"
        lines.append(f"| {n} | {mine['decode_tok_s']:.1f} | "
                     f"{peer['decode_tok_s'] if peer else '-'} | {ratio} | "
                     f"{mine['prefill_tok_s']:.0f} | {peer['prefill_tok_s'] if peer else '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m bench throughput") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, help="target model folder (default: demo target)")
    parser.add_argument("--draft", type=Path,
                        help="draft model folder (default: the demo draft when --speculation "
                             "needs one and the target is the demo target)")
    parser.add_argument("--speculation", default="off")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    add_threads(parser)
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--beside-llamacpp", action="store_true",
                        help="decode tokens/s beside llama-batched-bench on the same GGUF")
    add_json(parser)
    args = parser.parse_args(argv)
    if args.beside_llamacpp and (args.target is None or args.target.suffix != ".gguf"):
        parser.error("--beside-llamacpp needs a GGUF --target (llama.cpp runs the same file)")

    from specserve import LLM
    from specserve.llm import demo_pair
    from specserve.speculation.modes import parse_speculation

    torch.set_num_threads(args.threads)
    target, draft = args.target, args.draft
    if target is None:
        target, demo_draft = demo_pair()
        if draft is None and parse_speculation(args.speculation, True).needs_draft_model:
            draft = demo_draft
    llm = LLM(target, draft, speculation=args.speculation, dtype=args.dtype,
              max_num_seqs=max(args.concurrency), enable_prefix_caching=args.prefix_caching)
    if args.beside_llamacpp:
        ours, theirs = rates_beside_llamacpp(llm, args.target, tuple(args.concurrency),
                                             args.repeats, torch.get_num_threads())
        if args.json:
            write_json(args, {"specserve": ours, "llama.cpp": theirs})
            return
        print(f"{args.target.name}, speculation {args.speculation}, 64-token prompts, 64 new "
              f"tokens, greedy, {torch.get_num_threads()} threads, best of {args.repeats}")
        print(format_beside(ours, theirs))
        return
    prompts = demo_prompts(max(args.concurrency))
    rows = run_batching(llm, tuple(args.concurrency), args.max_tokens, args.repeats, prompts)
    lengths = prompt_lengths(llm, prompts)
    dtype = llm.engine.target.dtype
    setup = dict(target=str(target), draft=str(draft) if draft else None,  # noqa: C408
                 speculation=args.speculation, dtype=str(dtype).removeprefix("torch."),
                 max_tokens=args.max_tokens, threads=torch.get_num_threads(),
                 prefix_caching=args.prefix_caching, repeats=args.repeats, prompt_lengths=lengths)
    if args.json:
        write_json(args, {"setup": setup, "rows": [
            {**asdict(r), "speedup": r.speedup,
             "sequential_tok_s": r.sequential.tokens_per_s,
             "concurrent_tok_s": r.concurrent.tokens_per_s} for r in rows]})
        return
    print(f"target {target} ({setup['dtype']}), draft {draft}, speculation {args.speculation}, "
          f"{args.max_tokens} output tokens per request (ignore_eos, greedy), "
          f"{setup['threads']} threads, prefix caching {'on' if args.prefix_caching else 'off'}, "
          f"median of {args.repeats}")
    print(f"prompt lengths {min(lengths)}-{max(lengths)} tokens "
          f"(mean {statistics.mean(lengths):.0f}); N requests = the first N of {len(lengths)}")
    print(format_rows(rows))
