"""`python -m bench SUBCOMMAND [options]`: every benchmark behind one entry point.

Each subcommand is one runner module of this package; `python -m bench SUBCOMMAND --help`
prints its options (the shared ones come from `bench/options.py`). Current figures, with the
command behind each, are in bench/RESULTS.md; how they came about, in bench/HISTORY.md.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

PROG = "python -m bench"


@dataclass(frozen=True)
class Subcommand:
    module: str  # bench.<module>
    summary: str
    entry: str = "main"  # called as entry(argv, prog=...)


SUBCOMMANDS = {
    "latency": Subcommand("compare", "batch 1: every speculation mode beside transformers "
                                     "greedy and assisted"),
    "decode": Subcommand("decode", "batch-1 decode of a random Qwen2.5-0.5B-shaped model "
                                   "beside transformers"),
    "throughput": Subcommand("batching", "continuous batching: N requests together against "
                                         "one after another"),
    "logprobs": Subcommand("logprobs", "what log-probabilities cost in output tokens/s"),
    "serve": Subcommand("serve", "load-test a running server (TTFT, TPOT, goodput, sweeps)",
                        entry="run"),
    "server-overhead": Subcommand("ws_latency", "what the WebSocket layer adds per request and "
                                                "per streamed event"),
    "soak": Subcommand("soak", "mixed load with disconnects; the server must end where it began"),
    "hardening": Subcommand("hardening", "bad input and abusive clients against a real server"),
    "lm-eval": Subcommand("lm_eval_stdlib", "lm-evaluation-harness against a running server"),
    "peer": Subcommand("cpu_paths", "CPU kernel paths' decode, verify cost and TTFT beside "
                                    "llama.cpp"),
    "quant": Subcommand("quant", "int8/int4 weights: speed beside bf16 and llama.cpp, quality"),
    "agreement": Subcommand("agreement", "greedy continuations beside llama.cpp's on the same "
                                         "GGUF, per activation format"),
    "gguf-types": Subcommand("gguf_types", "GGUF block types converted at load: NLL against "
                                           "the file's own blocks, per llama.cpp file type"),
    "default-model": Subcommand("default_model", "the default model and its draft per mode, "
                                                 "beside llama.cpp on its GGUF"),
    "kernels": Subcommand("products", "the few-row bf16 products alone: paths, row counts, "
                                      "revisions, page sizes"),
    "gpu-kernels": Subcommand("kernels", "CUDA paged attention and tree verify against SDPA"),
    "tp": Subcommand("tp", "tensor parallelism: tp=1 against tp=N, and the collectives' cost"),
    "pp": Subcommand("pp", "pipeline parallelism: pp=1 against pp=N, micro-batches in flight "
                           "or not, compute and transfer per forward"),
    "disagg": Subcommand("disagg", "prefill/decode split: KV transfer cost per token and "
                                   "block, running chats' gaps while a long prompt arrives"),
    "scale": Subcommand("scale", "Ray Serve replicas: prefix-aware routing against round "
                                 "robin, the gateway's cost, memory per replica"),
    "structured": Subcommand("structured", "structured output: grammar cost per token and "
                                           "acceptance, constrained against free"),
    "report": Subcommand("report", "plots of bench/results/current.json into bench/plots/"),
}
ALIASES = {"batching": "throughput"}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"usage: {PROG} SUBCOMMAND [options]   ({PROG} SUBCOMMAND --help for its options)",
             "", __doc__.split("\n\n", 1)[1].strip(), "", "subcommands:"]
    lines += [f"  {name:<{width}}  {sub.summary}" for name, sub in SUBCOMMANDS.items()]
    lines += [f"  {alias:<{width}}  = {name}" for alias, name in ALIASES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name = ALIASES.get(argv[0], argv[0])
    if name not in SUBCOMMANDS:
        print(f"{PROG}: unknown subcommand {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sub = SUBCOMMANDS[name]
    # Imported on demand: the runners pull in torch, transformers or httpx, and a subcommand
    # should not pay for the others' imports.
    entry = getattr(importlib.import_module(f"bench.{sub.module}"), sub.entry)
    if name == "default-model":
        # bench/default_model.py is edited elsewhere (issue of the default model); its main
        # takes argv only and names itself `python -m bench.default_model` in --help.
        return entry(argv[1:]) or 0
    return entry(argv[1:], prog=f"{PROG} {name}") or 0


if __name__ == "__main__":
    raise SystemExit(main())
