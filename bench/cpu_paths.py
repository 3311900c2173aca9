"""specserve's CPU kernel paths beside llama.cpp on the widened pair, in one run.

    python -m bench peer                            # every path this CPU runs, llama.cpp if built
    python -m bench peer --isas avx2,torch --prompts 4 --max-tokens 64 --rounds 2

Rows, batch 1, greedy, the widened target (bf16) with the demo draft, `--threads` threads:

- ``<isa> <mode>``: specserve with ``SPECSERVE_CPU_ISA=<isa>`` (amx, avx512, avx2, portable: the
  C kernels built for that instruction set; torch: no C kernels), one ``LLM`` per path, for
  each of ``--modes`` (off, chain:2, chain:4 and the default, adaptive on CPU, unless told).
  Within a path every mode's token ids must equal the first mode's before anything is timed
  (greedy speculation is exact, and the C kernels are row-count invariant).
- ``--cpu-stack 1,0``: each of those rows twice, ``<isa> <mode> stack`` (a forward's decoder
  layers in one C call) and ``<isa> <mode> layers`` (one C call per op), which must give the
  same token ids.
- ``llama.cpp bf16``: ``llama-completion`` on a bf16 GGUF of the same target; ``llama.cpp bf16
  + draft``: ``llama-speculative`` with the draft's bf16 GGUF (its default of up to 3 draft
  tokens). Made once by ``llamacpp-peer convert`` (``--peer``, default
  ``../shared/tools/llamacpp-peer`` beside the repository) into ``--gguf-dir``.

Decode tok/s leaves the prompt out: tokens after the first over their time (llama.cpp: its own
printed eval timing). Rounds are interleaved (the order rotates per prompt and round) and each
prompt takes its best round, so slow spells of a shared machine hit every row alike; ratios are
against llama.cpp bf16 without a draft.

Three more tables, also interleaved:
- prompt-chunk products (``--gemm-rows`` rows, default 512) of the widened target's four
  projection shapes, GFLOP/s per path: the blocked GEMM (``cpu_gemm.c``, what prompt chunks
  take), the matrix-vector kernel (``cpu_gemv.c``, what they took before), and torch's fp32
  matmul on weights already converted to fp32 and torch's bf16 ``F.linear``, best of
  ``--repeats``.
- verify cost: one target forward over a 5-token chain against a 1-token decode forward at the
  same context (100 cached tokens), median of `--repeats`; llama.cpp: ``llama-bench`` pp5 / pp1.
- TTFT of a 512-token prompt: specserve ``generate(max_tokens=1)``, median of `--repeats`;
  llama.cpp: 512 tokens at its ``llama-bench`` pp512 rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.compare import (
    Row,
    Sample,
    chat_prompts,
    check_outputs,
    held_out_questions,
    load_pair,
    specserve_runner,
)
from bench.options import (
    DEFAULT_MODE,
    add_common_args,
    add_isas,
    add_modes,
    environment,
    log,
    setup,
    write_json,
)
from specserve import LLM, SamplingParams
from specserve.kernels import cpu_build, cpu_linear
from specserve.model.loader import load_tokenizer
from specserve.model.runner import ModelRunner, Segment

# The peer build script, beside the repository (override with --peer).
PEER = Path(__file__).resolve().parents[2] / "shared" / "tools" / "llamacpp-peer"
EVAL_TIME = re.compile(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) runs")
SPEC_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
PROMPT_EVAL_TIME = re.compile(r"prompt eval time =\s*([\d.]+) ms")
SPEC_ENCODED = re.compile(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds")
LLAMA_BF16, LLAMA_DRAFT = "llama.cpp bf16", "llama.cpp bf16 + draft"
STACK = {"1": "stack", "0": "layers"}  # --cpu-stack value -> its rows' name suffix


def use_isa(isa: str) -> None:
    """Switch the CPU kernel path of this process (each kernel call asks cpu_build)."""
    os.environ["SPECSERVE_CPU_ISA"] = isa
    cpu_build.selected_isa.cache_clear()


def on_isa(isa: str, run):
    def wrapped(prompt: list[int]) -> Sample:
        use_isa(isa)
        return run(prompt)

    return wrapped


def with_stack(run, stack: str):
    """`run` with SPECSERVE_CPU_STACK set to `stack` while it runs (1: a forward's decoder
    layers in one C call; 0: one by one), the caller's setting restored afterwards."""
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


# ---- llama.cpp ------------------------------------------------------------------------------
def peer_bin(peer: Path) -> Path | None:
    if not peer.is_file():
        return None
    out = subprocess.run([str(peer), "bin"], capture_output=True, text=True).stdout.strip()
    path = Path(out) if out else None
    return path if path is not None and (path / "llama-completion").is_file() else None


def ensure_gguf(peer: Path, folder: Path, out: Path) -> Path:
    if not out.is_file():
        log(f"  converting {folder} -> {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(peer), "convert", str(folder), str(out), "bf16"], check=True,
                       capture_output=True)
    return out


def llamacpp_prompt_text(tokenizer, prompt: list[int]) -> str:
    """The prompt as llama.cpp reads it: its text without a leading BOS, which llama.cpp adds
    itself when the file asks for one."""
    bos = tokenizer.bos_token_id
    return tokenizer.decode(prompt[1:] if bos is not None and prompt[:1] == [bos] else prompt)


def llamacpp_timing(log_text: str, speculative: bool) -> tuple[int, float, float]:
    """(tokens decoded, prompt seconds, decode seconds) from llama-completion's timing lines
    (`prompt eval time`, `eval time`) or llama-speculative's (`encoded`, `decoded`)."""
    if speculative:
        found, prompt = SPEC_DECODED.search(log_text), SPEC_ENCODED.search(log_text)
        if found is None or prompt is None:
            raise RuntimeError(f"no timing from llama-speculative:\n{log_text[-2000:]}")
        return int(found[1]), float(prompt[1]), float(found[2])
    found, prompt = EVAL_TIME.search(log_text), PROMPT_EVAL_TIME.search(log_text)
    if found is None or prompt is None:
        raise RuntimeError(f"no eval timing from llama-completion:\n{log_text[-2000:]}")
    return int(found[2]), float(prompt[1]) / 1e3, float(found[1]) / 1e3


def run_peer(command: list[str]) -> subprocess.CompletedProcess:
    """Run one llama.cpp binary and return its output; a crash is reported with what to try.

    Its repacking of quantized weights for the CPU's own layout dies with SIGSEGV on some
    Sapphire Rapids class Xeons (seen on two here); `LLAMA_ARG_REPACK=0` turns it off."""
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode == 0:
        return done
    name = Path(command[0]).name
    if done.returncode < 0:
        how = f"died with {signal.Signals(-done.returncode).name}"
        hint = ("" if os.environ.get("LLAMA_ARG_REPACK") == "0"
                else "; if its weight repacking crashes on this CPU, run with LLAMA_ARG_REPACK=0")
    else:
        how, hint = f"exited with status {done.returncode}", ""
    raise RuntimeError(f"llama.cpp's {name} {how}{hint}:\n{' '.join(command)}\n"
                       f"{(done.stderr or done.stdout)[-1500:]}")


def llamacpp_runner(bin_dir: Path, target: Path, draft: Path | None, tokenizer,
                    max_tokens: int, threads: int):
    """One prompt through llama-completion (no draft) or llama-speculative, timed by its own
    prompt and decode timing lines."""

    def run(prompt: list[int]) -> Sample:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(llamacpp_prompt_text(tokenizer, prompt) + "\n")  # -f strips one newline
            f.flush()
            common = ["-f", f.name, "-n", str(max_tokens), "-t", str(threads), "-tb",
                      str(threads), "--temp", "0", "--top-k", "1", "-c", "1024"]
            if draft is None:
                command = [str(bin_dir / "llama-completion"), "-m", str(target), *common,
                           "-no-cnv", "--no-warmup"]
            else:
                command = [str(bin_dir / "llama-speculative"), "-m", str(target), "-md",
                           str(draft), *common, "-td", str(threads), "-tbd", str(threads)]
            done = run_peer(command)
        tokens, prompt_s, seconds = llamacpp_timing(done.stderr + done.stdout, draft is not None)
        # The prompt's forward stands for the time to the first token, so the row's tok/s counts
        # the prompt as specserve's rows do, and its decode rate, (len(token_ids) - 1) /
        # (e2e - ttft), is llama.cpp's eval rate: tokens + 1 ids.
        return Sample(list(range(tokens + 1)), prompt_s + seconds, prompt_s, tokens + 1)

    return run


def llama_bench(bin_dir: Path, target: Path, threads: int, repeats: int) -> dict[int, float]:
    """Prompt-processing rates (tokens/s) for batches of 1, 5 and 512 tokens."""
    done = run_peer([str(bin_dir / "llama-bench"), "-m", str(target), "-p", "1,5,512", "-n", "0",
                     "-t", str(threads), "-r", str(repeats), "-o", "json"])
    return {int(r["n_prompt"]): float(r["avg_ts"]) for r in json.loads(done.stdout)}


# ---- specserve's forward costs --------------------------------------------------------------
def verify_costs(llms: dict[str, LLM], repeats: int) -> dict[str, tuple[float, float]]:
    """Per path: median seconds of a 1-token and a 5-token chain target forward."""
    context, blocks = 100, list(range(8))
    runners = {}
    for isa, llm in llms.items():
        use_isa(isa)
        runner = ModelRunner(llm.engine.target, num_blocks=8, block_size=16)
        runner.forward([Segment(list(range(3, 3 + context)), range(context), 0, blocks, [])])
        runners[isa] = runner
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for isa, runner in runners.items():
            use_isa(isa)
            for rows in (1, 5):
                segment = Segment(list(range(7, 7 + rows)), range(context, context + rows),
                                  context, blocks, list(range(rows)))
                start = time.perf_counter()
                runner.forward([segment])
                times.setdefault((isa, rows), []).append(time.perf_counter() - start)
    return {isa: (statistics.median(times[(isa, 1)]), statistics.median(times[(isa, 5)]))
            for isa in runners}


def ttfts(llms: dict[str, LLM], prompt: list[int], repeats: int) -> dict[str, float]:
    """Per path: median time to the first token of a `len(prompt)`-token prompt."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for isa, llm in llms.items():
            use_isa(isa)
            out = llm.generate([prompt], params, speculation="off")[0]
            times.setdefault(isa, []).append(out.metrics["ttft_s"])
    return {isa: statistics.median(v) for isa, v in times.items()}


# Widened target projections: (name, N, K).
PROJECTIONS = (("qkv", 1280, 1024), ("o", 1024, 1024), ("gate_up", 8192, 1024),
               ("down", 1024, 4096))


def product_runs(x: torch.Tensor, w: torch.Tensor, kernels: list[str]) -> dict:
    """Zero-argument runs of x [rows, K] @ w [N, K].T per product."""
    x32, w32 = x.float(), w.float()

    def kernel(isa: str, fn):
        def run():
            use_isa(isa)
            return fn(x, w)

        return run

    runs = {"torch fp32 mm": lambda: torch.mm(x32, w32.t()),
            "torch bf16 F.linear": lambda: F.linear(x, w)}
    for isa in kernels:
        runs[f"{isa} gemm"] = kernel(isa, cpu_linear.gemm_bf16)
        runs[f"{isa} gemv"] = kernel(isa, cpu_linear.gemv_bf16)
    return runs


def prefill_products(isas: list[str], rows: int, repeats: int) -> dict[str, dict[str, float]]:
    """GFLOP/s per product and shape at `rows` activation rows, best of `repeats`, the
    products interleaved so load on a shared machine hits them alike."""
    kernels = [isa for isa in isas if isa != "torch"]
    table: dict[str, dict[str, float]] = {}
    for name, n, k in PROJECTIONS:
        g = torch.Generator().manual_seed(n + k)
        runs = product_runs(torch.randn(rows, k, generator=g).to(torch.bfloat16),
                            torch.randn(n, k, generator=g).to(torch.bfloat16), kernels)
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(repeats + 1):  # the first round warms up
            for product, run in runs.items():
                start = time.perf_counter()
                run()
                best[product] = min(best[product], time.perf_counter() - start)
        for product, seconds in best.items():
            table.setdefault(product, {})[name] = 2 * rows * n * k / seconds / 1e9
    return table


def format_products(table: dict[str, dict[str, float]], rows: int) -> str:
    names = [name for name, _, _ in PROJECTIONS]
    lines = [f"prompt-chunk products, {rows} rows, GFLOP/s (best of repeats; all threads)",
             f"| product | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    for product, by_shape in table.items():
        lines.append(f"| {product} | {' | '.join(f'{by_shape[n]:.1f}' for n in names)} |")
    return "\n".join(lines)


# ---- decode rows ----------------------------------------------------------------------------
def measure_decode(runners: dict, groups: dict[str, list[str]], prompts, rounds: int
                   ) -> list[Row]:
    log(f"  warm-up and equality check: {len(runners)} rows x {len(prompts)} prompts")
    checked = {name: [run(list(p)).token_ids for p in prompts] for name, run in runners.items()}
    for names in groups.values():
        check_outputs({n: checked[n] for n in names}, names[0])
    names = list(runners)
    samples: dict[str, list[list[Sample]]] = {n: [] for n in names}
    for r in range(rounds):
        start = time.perf_counter()
        for n in names:
            samples[n].append([])
        for i, prompt in enumerate(prompts):
            shift = (r + i) % len(names)
            for n in names[shift:] + names[:shift]:
                samples[n][r].append(runners[n](list(prompt)))
        log(f"  round {r + 1}/{rounds}: {time.perf_counter() - start:.1f} s")
    return [Row(n, samples[n]) for n in names]


def decode_table(rows: list[Row], baselines: list[str]) -> list[str]:
    """Decode rates (tokens after the first, each prompt's best round: prompt processing left
    out, as llama.cpp's eval timing leaves it out), with a ratio column per baseline row."""
    by_name = {r.name: r for r in rows}
    base_rates = [1e3 / by_name[b].ms_per_token if b in by_name else None for b in baselines]
    lines = ["decode (tokens after the first), each prompt's best round",
             "| row | tok/s | ms/token | accept | " + " | ".join(f"vs {b}" for b in baselines)
             + " |", "|---|---|---|---|" + "---|" * len(baselines)]
    for r in rows:
        rate = 1e3 / r.ms_per_token
        accept = f"{r.acceptance_length:.2f}" if not r.name.startswith("llama") else "-"
        ratios = [f"{rate / b:.2f}x" if b else "-" for b in base_rates]
        lines.append(f"| {r.name} | {rate:.1f} | {r.ms_per_token:.1f} | {accept} | "
                     + " | ".join(ratios) + " |")
    return lines


def format_report(rows: list[Row], verify: dict, ttft: dict, bench: dict[int, float] | None,
                  prompt_tokens: int) -> str:
    lines = decode_table(rows, [LLAMA_BF16])
    lines += ["", "verify cost: target forward, 5-token chain vs 1-token decode (median)",
              "| path | 1 row ms | 5 rows ms | 5 / 1 |", "|---|---|---|---|"]
    for isa, (one, five) in verify.items():
        lines.append(f"| {isa} | {one * 1e3:.1f} | {five * 1e3:.1f} | {five / one:.2f} |")
    if bench:
        one, five = 1 / bench[1], 5 / bench[5]
        lines.append(f"| llama.cpp bf16 (llama-bench pp1, pp5) | {one * 1e3:.1f} | "
                     f"{five * 1e3:.1f} | {five / one:.2f} |")
    llama_ttft = prompt_tokens / bench[512] if bench else None
    lines += ["", f"TTFT, {prompt_tokens}-token prompt (median)",
              f"| row | ms | vs llama.cpp pp{prompt_tokens} |", "|---|---|---|"]
    for isa, seconds in ttft.items():
        ratio = f"{seconds / llama_ttft:.2f}x" if llama_ttft else "-"
        lines.append(f"| {isa} | {seconds * 1e3:.0f} | {ratio} |")
    if llama_ttft:
        lines.append(f"| llama.cpp bf16 pp{prompt_tokens} ({bench[512]:.0f} tok/s) | "
                     f"{llama_ttft * 1e3:.0f} | 1.00x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m bench peer") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_isas(parser, ",".join([*cpu_build.supported_isas(), "torch"]))
    add_modes(parser, f"off,chain:2,chain:4,{DEFAULT_MODE}")
    parser.add_argument("--cpu-stack",
                        help="comma list of SPECSERVE_CPU_STACK settings timed side by side: 1 "
                             "(the decoder layers in one C call, as shipped), 0 (one by one); "
                             "default: the environment's")
    parser.add_argument("--repeats", type=int, default=5, help="verify and TTFT repeats")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="TTFT prompt length")
    parser.add_argument("--gguf-dir", type=Path,
                        default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                        / "specserve" / "gguf")
    parser.add_argument("--peer", type=Path, default=PEER, help="llamacpp-peer script")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--gemm-rows", type=int, default=512, help="prompt-chunk product rows")
    add_common_args(parser)
    args = parser.parse_args(argv)
    stacks = args.cpu_stack.split(",") if args.cpu_stack else [None]
    if not set(stacks) <= {*STACK, None}:
        parser.error(f"--cpu-stack {args.cpu_stack!r}: expected a comma list of 1 and 0")
    setup(args)
    isas = args.isas.split(",")
    pair = load_pair("widened")
    tokenizer = load_tokenizer(pair.target)
    prompts = chat_prompts(tokenizer, held_out_questions(args.prompts))
    flags = sorted(f for f in cpu_build.cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    print(f"CPU flags: {' '.join(flags)}; {environment(args.threads)}")

    llms, runners, groups = {}, {}, {}
    for isa in isas:
        use_isa(isa)
        llms[isa] = LLM(pair.target, pair.draft)
        for mode in args.modes.split(","):
            run = on_isa(isa, specserve_runner(llms[isa], mode, args.max_tokens, args.ignore_eos))
            names = [f"{isa} {mode}" + (f" {STACK[s]}" if len(stacks) > 1 else "")
                     for s in stacks]
            runners.update({n: with_stack(run, s) if s else run for n, s in zip(names, stacks)})
            groups.setdefault(isa, []).extend(names)
    bin_dir = None if args.no_llamacpp else peer_bin(args.peer)
    if bin_dir is not None:
        target_gguf = ensure_gguf(args.peer, pair.target, args.gguf_dir / "widened-bf16.gguf")
        draft_gguf = ensure_gguf(args.peer, pair.draft, args.gguf_dir / "demo-draft-bf16.gguf")
        runners[LLAMA_BF16] = llamacpp_runner(bin_dir, target_gguf, None, tokenizer,
                                              args.max_tokens, args.threads)
        runners[LLAMA_DRAFT] = llamacpp_runner(bin_dir, target_gguf, draft_gguf, tokenizer,
                                               args.max_tokens, args.threads)
    elif not args.no_llamacpp:
        log(f"  llama.cpp is not built ({args.peer} build): its rows are left out")

    rows = measure_decode(runners, groups, prompts, args.rounds)
    log("  verify cost")
    verify = verify_costs(llms, args.repeats)
    log("  TTFT")
    long_prompt = [3 + (7 * i) % 4000 for i in range(args.prompt_tokens)]
    ttft = ttfts(llms, long_prompt, args.repeats)
    log("  prompt-chunk products")
    products = prefill_products(isas, args.gemm_rows, args.repeats)
    bench = llama_bench(bin_dir, target_gguf, args.threads, args.repeats) if bin_dir else None
    print(format_report(rows, verify, ttft, bench, args.prompt_tokens))
    print()
    print(format_products(products, args.gemm_rows))
    write_json(args, {
        "environment": environment(args.threads), "cpu_flags": flags,
        "rows": [r.summary() for r in rows],
        "verify_s": {k: list(v) for k, v in verify.items()}, "ttft_s": ttft,
        "llama_bench_tok_s": bench, "prefill_gflops": products})
    return 0
