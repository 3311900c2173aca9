"""The target's forward with its weights in 2 MiB pages against 4 KiB pages, in one run.

    python -m bench.huge_pages                         # widened target, bf16
    python -m bench.huge_pages --quantization int8 --rows 1,5 --repeats 9

Two copies of the widened target (bf16, or quantized at load with ``--quantization``): one
loaded as specserve loads models (weights moved into huge pages, model/huge_pages.py), one with
``SPECSERVE_HUGE_PAGES=0`` (the weights where torch allocated them: 4 KiB pages unless the
system's transparent_hugepage setting is ``always``). Each forward is one target step over
``--rows`` new tokens (1: a decode step; 5: verifying a 4-token draft chain) after a
``--context``-token prompt, timed alternately on the two copies, best of ``--repeats`` (on a
shared machine other tenants only ever add time: the best is the least disturbed, and the
medians moved by 10% between runs here).
Prints the milliseconds, each row count's cost over one row's, and the huge-page speedup, with
the CPU's flags and how much of the process's memory the kernel actually backed by huge pages.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from bench.compare import ensure_widened_demo, environment, log, row_counts
from specserve.kernels import cpu_build
from specserve.model import huge_pages
from specserve.model.loader import load_model
from specserve.model.runner import ModelRunner, Segment

BLOCK_SIZE = 16


def anon_huge_kib() -> int:
    """AnonHugePages of this process (kB), or -1 where /proc does not say."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def load(target: Path, quantization: str | None, huge: bool):
    os.environ["SPECSERVE_HUGE_PAGES"] = "1" if huge else "0"
    try:
        return load_model(target, "auto", "cpu", quantization)
    finally:
        os.environ.pop("SPECSERVE_HUGE_PAGES")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.huge_pages", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", choices=("int8", "int4"), default=None)
    parser.add_argument("--rows", default="1,2,3,5,8", help="comma list of new tokens per step")
    parser.add_argument("--context", type=int, default=100, help="cached tokens before a step")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows_list = row_counts(parser, args.rows)
    flags = sorted(f for f in cpu_build.cpu_flags() if f.startswith(("avx", "fma", "f16c")))
    print(f"CPU flags: {' '.join(flags)}; {environment(args.threads)}; "
          f"kernels: {cpu_build.selected_isa()}")
    if not huge_pages.enabled():
        print("huge pages are off here (SPECSERVE_HUGE_PAGES=0 or not Linux): both copies alike")

    target = ensure_widened_demo()
    log("  loading both copies")
    models = {"2 MiB pages": load(target, args.quantization, True),
              "4 KiB pages": load(target, args.quantization, False)}
    print(f"AnonHugePages of this process: {anon_huge_kib() / 1024:.0f} MiB")
    max_rows = max(rows_list)
    blocks = list(range(-(-(args.context + max_rows) // BLOCK_SIZE)))
    runners = {}
    for name, model in models.items():
        runner = ModelRunner(model, num_blocks=len(blocks), block_size=BLOCK_SIZE)
        prompt = Segment(list(range(3, 3 + args.context)), range(args.context), 0, blocks, [])
        runner.forward([prompt])
        runners[name] = runner
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for rows in rows_list:
            for name, runner in runners.items():
                step = Segment(list(range(7, 7 + rows)), range(args.context, args.context + rows),
                               args.context, blocks, list(range(rows)))
                start = time.perf_counter()
                runner.forward([step])
                times.setdefault((name, rows), []).append(time.perf_counter() - start)
    ms = {key: 1e3 * min(v) for key, v in times.items()}

    weights = args.quantization or "bf16"
    print(f"\nwidened target ({weights}), one forward after {args.context} cached tokens, "
          f"best of {args.repeats}")
    print("| new tokens | " + " | ".join(f"{n} ms | x 1 token" for n in runners)
          + " | 2 MiB speedup |")
    print("|---|" + "---|---|" * len(runners) + "---|")
    for rows in rows_list:
        cells = [f"{ms[(n, rows)]:.2f} | {ms[(n, rows)] / ms[(n, 1)]:.2f}x" for n in runners]
        speedup = ms[("4 KiB pages", rows)] / ms[("2 MiB pages", rows)]
        print(f"| {rows} | " + " | ".join(cells) + f" | {speedup:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
