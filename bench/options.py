"""The options every benchmark shares, and the run facts every report prints beside its numbers.

One spelling per idea across `python -m bench SUBCOMMAND`: `--pairs`/`--pair` (demo, widened),
`--modes` (speculation spellings, the first is the baseline), `--isas` (C kernel paths and
`torch`), `--prompts`, `--max-tokens`, `--ignore-eos`, `--rounds`, `--threads`, `--dtype`,
`--json [PATH]`. Runners add only the options of their own concern.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_MODE = "default"  # a --modes entry: the engine's own choice for the loaded pair
STDOUT = "-"


def usable_cores() -> int:
    """Cores this process may run on (every core where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu() -> dict:
    """The CPU as /proc/cpuinfo names it: every figure is only meaningful beside its CPU kind
    (vendor, family/model and the vector flags the kernel paths choose by)."""
    info: dict = {"model_name": platform.processor() or platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("flags", "").split()
    return {"model_name": fields.get("model name", info["model_name"]),
            "family": fields.get("cpu family"), "model": fields.get("model"),
            "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))}


def environment(threads: int) -> dict:
    # transformers is imported here, not at the top: the server runners never need it.
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": threads,
            "cpus": os.cpu_count(), "cpu": cpu(), "load_average": os.getloadavg()}


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", nargs="?", const=STDOUT, metavar="PATH",
                        help="the results as JSON: written to PATH, or without PATH printed to "
                             "stdout")


def write_json(args: argparse.Namespace, obj: dict) -> None:
    if args.json == STDOUT:
        print(json.dumps(obj, indent=2))
    elif args.json is not None:
        Path(args.json).write_text(json.dumps(obj, indent=2))


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Options of every batch-1 decode runner (latency, peer, quant, default-model)."""
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts (1..24)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max-tokens")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up")
    add_threads(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    add_json(parser)


def add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=usable_cores(),
                        help="torch threads (default: every core this process may use)")


def add_modes(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--modes", default=default,
                        help="comma list of speculation spellings (off, chain:K, tree[:N], "
                             f"static:NAME, ngram:K, adaptive; {DEFAULT_MODE}: the engine's own "
                             "choice); the first is the baseline")


def add_isas(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--isas", default=default,
                        help="comma list of C kernel paths (amx, avx512, avx2, portable) and "
                             "torch (no C kernels)")


def setup(args: argparse.Namespace) -> None:
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def row_counts(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """A `--rows` comma list of row counts per step; it must hold 1, the step the others'
    costs are measured against (parser.error otherwise)."""
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        parser.error(f"--rows {text!r}: expected a comma list of integers")
    if 1 not in rows or min(rows) < 1:
        parser.error("--rows must include 1 (the other costs are against it) and no count below 1")
    return rows
