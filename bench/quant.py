"""Weight-only quantization: decode speed beside bf16 and llama.cpp, and what it costs in quality.

    python -m bench.quant                              # speed (widened pair) and quality (demo)
    python -m bench.quant --skip-quality --prompts 4 --rounds 2
    python -m bench.quant --skip-speed

Speed, batch 1, greedy, on the widened pair (bench/RESULTS.md: the demo target grown to a
0.5B-like shape, bandwidth-bound): specserve with the target (and draft) in bf16, int8 and int4,
each with speculation off and in the default mode, and llama.cpp's `llama-completion` on GGUFs of
the same target (q8_0, and q4_0 when a q4_0 file is given: the peer build has no llama-quantize).
Decode tok/s leaves the prompt out: specserve's rows time tokens after the first, llama.cpp's
come from its own printed eval timings. Rows run interleaved, each prompt at its best round.
Within each quantization, the default mode's tokens must equal speculation off's (checked
before timing); across quantizations they differ, which the quality section measures.

Quality, on the demo target (the widened one computes the same function): mean next-token NLL
(nats) over held-out text windows (the stdlib corpus's validation modules, never trained on),
and greedy agreement with bf16 over 32 tokens on 16 held-out chat prompts: the share of
identical tokens, position by position, and how many prompts match in full.
"""

from __future__ import annotations

import argparse
import json
import re
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
    add_common_args,
    chat_prompts,
    check_outputs,
    environment,
    held_out_questions,
    load_pair,
    log,
    setup,
    specserve_runner,
)
from specserve import LLM, SamplingParams
from specserve.llm import demo_pair
from specserve.model.loader import load_model, load_tokenizer
from specserve.model.runner import ModelRunner, Segment

QUANTIZATIONS = ("bf16", "int8", "int4")
PEER = Path("/work/shared/tools/llamacpp-peer")
EVAL_TIME = re.compile(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) runs")


def _quantization(name: str) -> str | None:
    return None if name == "bf16" else name


# ---- speed ----------------------------------------------------------------------------------
def llamacpp_runner(binary: Path, gguf: Path, tokenizer, max_tokens: int, threads: int):
    """Runs one prompt through llama-completion; a Sample with decode-only timing."""

    def run(prompt: list[int]) -> Sample:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(tokenizer.decode(prompt) + "\n")  # -f strips one trailing newline
            f.flush()
            done = subprocess.run(
                [str(binary), "-m", str(gguf), "-f", f.name, "-n", str(max_tokens),
                 "-t", str(threads), "-tb", str(threads), "--temp", "0", "--top-k", "1",
                 "-no-cnv", "--no-warmup", "-c", "1024"],
                capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL)
        found = EVAL_TIME.search(done.stderr)
        if found is None:
            raise RuntimeError(f"no eval timing in llama-completion's output:\n"
                               f"{done.stderr[-2000:]}")
        ms, runs = float(found[1]), int(found[2])
        # Sample's decode time is e2e - ttft over len(token_ids) - 1 tokens: runs + 1 ids.
        return Sample(list(range(runs + 1)), ms / 1e3, 0.0, runs + 1)

    return run


def measure_speed(args, prompts: list[list[int]], pair, ggufs: dict[str, Path]) -> list[Row]:
    runners, groups = {}, {}
    for q in QUANTIZATIONS:
        llm = LLM(pair.target, pair.draft, quantization=_quantization(q))
        for mode in ("off", None):
            name = f"specserve {q} {mode or 'default'}"
            runners[name] = specserve_runner(llm, mode, args.max_tokens, args.ignore_eos)
            groups.setdefault(q, []).append(name)
    if ggufs:
        binary = Path(subprocess.run([str(PEER), "bin"], capture_output=True, text=True,
                                     check=True).stdout.strip()) / "llama-completion"
        tokenizer = load_tokenizer(pair.target)
        for label, path in ggufs.items():
            runners[f"llama.cpp {label}"] = llamacpp_runner(binary, path, tokenizer,
                                                            args.max_tokens, args.threads)
    log(f"  warm-up and equality check: {len(runners)} rows x {len(prompts)} prompts")
    checked = {name: [run(list(p)).token_ids for p in prompts] for name, run in runners.items()}
    for names in groups.values():  # speculation changes nothing within one quantization
        check_outputs({n: checked[n] for n in names})
    names = list(runners)
    samples: dict[str, list[list[Sample]]] = {n: [] for n in names}
    for r in range(args.rounds):
        start = time.perf_counter()
        for n in names:
            samples[n].append([])
        for i, prompt in enumerate(prompts):
            shift = (r + i) % len(names)
            for n in names[shift:] + names[:shift]:
                samples[n][r].append(runners[n](list(prompt)))
        log(f"  round {r + 1}/{args.rounds}: {time.perf_counter() - start:.1f} s")
    return [Row(n, samples[n]) for n in names]


def format_speed(rows: list[Row]) -> str:
    by_name = {r.name: r for r in rows}
    bases = [("specserve bf16 off", "vs bf16 off"), ("llama.cpp q8_0", "vs llama.cpp q8_0")]
    bases = [(by_name[b], label) for b, label in bases if b in by_name]
    lines = ["| row | decode tok/s | ms/token | accept | " + " | ".join(lb for _, lb in bases)
             + " |", "|---" * (4 + len(bases)) + "|"]
    for r in rows:
        ratios = " | ".join(f"{b.ms_per_token / r.ms_per_token:.2f}x" for b, _ in bases)
        accept = f"{r.acceptance_length:.2f}" if r.name.startswith("specserve") else "-"
        lines.append(f"| {r.name} | {1e3 / r.ms_per_token:.1f} | {r.ms_per_token:.1f} | "
                     f"{accept} | {ratios} |")
    return "\n".join(lines)


# ---- quality --------------------------------------------------------------------------------
def held_out_windows(tokenizer, num_windows: int, length: int) -> list[list[int]]:
    """Consecutive windows of `length + 1` tokens of the held-out stdlib corpus."""
    from specserve.draft_models.data import build_corpus

    corpus = build_corpus()
    ids: list[int] = []
    for doc in corpus.val_code + corpus.val_chat:
        ids += tokenizer.encode(doc, add_special_tokens=False)
        if len(ids) >= num_windows * (length + 1):
            break
    windows = [ids[i * (length + 1):(i + 1) * (length + 1)] for i in range(num_windows)]
    if len(windows[-1]) != length + 1:
        raise ValueError("the held-out corpus is shorter than the windows asked for")
    return windows


def mean_nll(model, windows: list[list[int]], block_size: int = 16) -> float:
    length = len(windows[0]) - 1
    blocks = -(-length // block_size)
    runner = ModelRunner(model, num_blocks=blocks, block_size=block_size)
    total = 0.0
    for w in windows:
        seg = Segment(w[:-1], range(length), 0, list(range(blocks)), range(length))
        logits = runner.forward([seg])[0].float()  # [length, vocab]
        total += F.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum").item()
    return total / (len(windows) * length)


def measure_quality(args) -> dict:
    target, _ = demo_pair()
    tokenizer = load_tokenizer(target)
    windows = held_out_windows(tokenizer, args.nll_windows, args.nll_length)
    nll = {}
    for q in QUANTIZATIONS:
        nll[q] = mean_nll(load_model(target, quantization=_quantization(q)), windows)
        log(f"  NLL {q}: {nll[q]:.4f}")
    prompts = chat_prompts(tokenizer, held_out_questions(args.agreement_prompts))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {q: [o.token_ids for o in LLM(target, speculation="off",
                                         quantization=_quantization(q)).generate(prompts, params)]
            for q in QUANTIZATIONS}
    agreement = {}
    for q in QUANTIZATIONS[1:]:
        same = [sum(a == b for a, b in zip(x, y)) / len(y) for x, y in zip(outs[q], outs["bf16"])]
        full = sum(x == y for x, y in zip(outs[q], outs["bf16"]))
        agreement[q] = {"token_agreement": statistics.mean(same), "prompts_identical": full}
    return {"nll": nll, "windows": len(windows), "window_tokens": args.nll_length,
            "agreement": agreement, "agreement_prompts": len(prompts)}


def format_quality(quality: dict) -> str:
    nll = quality["nll"]
    lines = [f"Mean NLL over {quality['windows']} held-out windows of {quality['window_tokens']} "
             f"tokens; greedy agreement with bf16 over 32 tokens on "
             f"{quality['agreement_prompts']} prompts:", "",
             "| weights | mean NLL | vs bf16 | tokens as bf16 | prompts identical |",
             "|---|---|---|---|---|"]
    for q in QUANTIZATIONS:
        agree = quality["agreement"].get(q)
        cells = (f"{agree['token_agreement']:.1%} | {agree['prompts_identical']}/"
                 f"{quality['agreement_prompts']}" if agree else "- | -")
        lines.append(f"| {q} | {nll[q]:.4f} | {nll[q] / nll['bf16'] - 1:+.2%} | {cells} |")
    return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--gguf-q8-0", type=Path, help="llama.cpp q8_0 GGUF of the widened "
                        "target (default: converted with the peer tool when it is built)")
    parser.add_argument("--gguf-q4-0", type=Path, help="llama.cpp q4_0 GGUF of the widened target")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--nll-windows", type=int, default=32)
    parser.add_argument("--nll-length", type=int, default=256)
    parser.add_argument("--agreement-prompts", type=int, default=16)
    args = parser.parse_args(argv)
    setup(args)
    flags = sorted(set(re.findall(r"\b(avx\w*|fma|f16c)\b", Path("/proc/cpuinfo").read_text())))
    report: dict = {"environment": environment(args.threads), "cpu_flags": flags}
    print(f"torch {report['environment']['torch']}, {args.threads} threads, CPU flags "
          f"{' '.join(flags)}, load average {report['environment']['load_average'][0]:.2f}")
    if not args.skip_speed:
        pair = load_pair("widened")
        ggufs = {} if args.no_llamacpp else _ggufs(args, pair.target)
        prompts = chat_prompts(load_tokenizer(pair.target), held_out_questions(args.prompts))
        log("speed: widened pair")
        rows = measure_speed(args, prompts, pair, ggufs)
        report["speed"] = [r.summary() for r in rows]
        print(f"\nDecode tok/s, batch 1, greedy, widened pair, {len(prompts)} prompts x "
              f"{args.max_tokens} tokens, best of {args.rounds} rounds:\n")
        print(format_speed(rows))
    if not args.skip_quality:
        log("quality: demo target")
        report["quality"] = measure_quality(args)
        print("\n" + format_quality(report["quality"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _ggufs(args, target: Path) -> dict[str, Path]:
    """The llama.cpp GGUFs to time: given ones, else a q8_0 converted once by the peer tool."""
    ggufs = {"q8_0": args.gguf_q8_0, "q4_0": args.gguf_q4_0}
    if ggufs["q8_0"] is None and PEER.is_file():
        path = target.parent / f"{target.name}-q8_0.gguf"
        if not path.is_file():
            log(f"  converting {target} to {path}")
            subprocess.run([str(PEER), "convert", str(target), str(path), "q8_0"], check=True,
                           capture_output=True)
        ggufs["q8_0"] = path
    return {k: v for k, v in ggufs.items() if v is not None}


if __name__ == "__main__":
    raise SystemExit(main())
