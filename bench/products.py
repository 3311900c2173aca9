"""The few-row bf16 products alone, this tree's kernels against another revision's, in one run.

    python -m bench kernels                                   # this tree, the selected path
    python -m bench kernels --against HEAD~3 --isas avx2,avx512 --rows 1,3,5,8
    python -m bench kernels --pages 2m,4k --rows 1,5              # what the huge pages buy

What a decode or verify step spends most of its time in, without the rest of the forward: the
widened target's 96 layer products (its real weights, in 2 MiB pages as specserve loads them)
through `gemv_bf16`, for each ``--rows`` count, timed from memory (all 96 in turn, as a forward
reads them) and from L2 (one 1024 x 1024 product 100 times over: the kernel's arithmetic
without the weight stream). Each source tree is built into its own library with the flags
`cpu_build` would use on this machine (`--against REV`: that revision's
``specserve/kernels`` from git), and the trees, paths and row counts are timed in turn within
each of ``--repeats`` rounds, best of them: on a shared machine other tenants only ever add
time. Before timing, every tree's outputs must equal the first's bit for bit on the three
product shapes (kernel changes meant to be speed-only), or the script says which differ.

Prints, per path and tree: milliseconds from memory and each row count's cost over one row's,
and GFLOP/s from L2.

``--pages 2m,4k`` also loads a copy of the weights with ``SPECSERVE_HUGE_PAGES=0`` (where torch
allocated them: 4 KiB pages unless the system's transparent_hugepage setting is ``always``) and
times both copies in the same rounds: a decode step reads every weight once, and in 4 KiB pages
that is a TLB miss per 4 KiB (specserve/model/huge_pages.py).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.options import environment, log, row_counts
from specserve.draft_models.widen import ensure_widened_demo
from specserve.kernels import cpu_build
from specserve.model.loader import load_model

REPO = Path(__file__).resolve().parent.parent
KERNELS_DIR = "specserve/kernels"
L2_CALLS = 100
PAGES = {"2m": "1", "4k": "0"}  # --pages -> SPECSERVE_HUGE_PAGES while the copy loads


def build_tree(sources: Path, isa: str, out_dir: Path, name: str) -> ctypes.CDLL:
    """Compile every cpu_*.c under `sources` for isa with this machine's flags and load it."""
    compiler = cpu_build.c_compiler()
    if compiler is None:
        raise SystemExit("no C compiler")
    output = out_dir / f"{name}-{isa}.so"
    files = sorted(sources.glob("cpu_*.c"))  # a revision's own list, whatever KERNELS says now
    subprocess.run(cpu_build.compile_command(compiler, isa, output, files), check=True)
    lib = ctypes.CDLL(str(output))
    argtypes, restype = cpu_build.KERNELS["cpu_gemv.c"]["gemv_bf16"]
    lib.gemv_bf16.argtypes, lib.gemv_bf16.restype = argtypes, restype
    return lib


def checkout_kernels(rev: str, into: Path) -> Path:
    """`rev`'s kernel sources (git archive) under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, KERNELS_DIR],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / KERNELS_DIR


def layer_weights(model) -> list[torch.Tensor]:
    """The decoder layers' 2-D weights in forward order: [N, K] bf16 each."""
    return [p for name, p in model.named_parameters()
            if name.startswith("layers.") and p.dim() == 2]


def load_weights(pages: str) -> list[torch.Tensor]:
    """The widened target's layer weights, loaded with huge pages on (2m) or off (4k)."""
    os.environ["SPECSERVE_HUGE_PAGES"] = PAGES[pages]
    try:
        return layer_weights(load_model(ensure_widened_demo(), "auto", "cpu", None))
    finally:
        os.environ.pop("SPECSERVE_HUGE_PAGES")


def product(lib, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    """y[:M, :N] = x[:M, :K] w^T, bf16 out (x [M, >=K] row stride K as the kernel reads it)."""
    rows = x.shape[0]
    n, k = w.shape
    status = lib.gemv_bf16(x.data_ptr(), w.data_ptr(), None, None, y.data_ptr(), rows, n, k,
                           threads)
    if status:
        raise MemoryError("gemv_bf16 could not allocate its activation buffer")


def main(argv: list[str] | None = None, prog: str = "python -m bench kernels") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", metavar="REV", help="also time this git revision's kernels")
    parser.add_argument("--isas", help="comma list of C paths (default: the selected one)")
    parser.add_argument("--rows", default="1,5", help="comma list of activation rows")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pages", default="2m",
                        help="comma list of weight page sizes: 2m (as specserve loads them), 4k")
    args = parser.parse_args(argv)
    pages_list = args.pages.split(",")
    if not set(pages_list) <= set(PAGES):
        parser.error(f"--pages {args.pages!r}: not a page size ({', '.join(PAGES)})")
    torch.set_num_threads(args.threads)
    rows_list = row_counts(parser, args.rows)
    isas = args.isas.split(",") if args.isas else [cpu_build.selected_isa()]
    for isa in isas:
        if isa not in cpu_build.ISA_FLAGS:
            parser.error(f"--isas: {isa!r} is not a C path ({', '.join(cpu_build.ISA_FLAGS)})")
        lacks = cpu_build.missing(isa)
        if lacks:
            parser.error(f"--isas: this machine cannot run {isa}: it lacks {', '.join(lacks)}")
    flags = sorted(f for f in cpu_build.cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    print(f"CPU flags: {' '.join(flags)}; vendor {cpu_build.cpu_vendor() or '?'}; "
          f"{environment(args.threads)}")

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        trees = {"this tree": REPO / KERNELS_DIR}
        if args.against:
            trees[args.against] = checkout_kernels(args.against, tmp_path)
        log("  building")
        libs = {(tree, isa): build_tree(src, isa, tmp_path, f"tree{i}")
                for i, (tree, src) in enumerate(trees.items()) for isa in isas}
        log("  loading the widened target")
        copies = {pages: load_weights(pages) for pages in pages_list}
        weights = copies[pages_list[0]]
        widest_k = max(w.shape[1] for w in weights)
        widest_n = max(w.shape[0] for w in weights)
        xs = {m: torch.randn(m, widest_k).to(torch.bfloat16) for m in rows_list}
        y = torch.empty(max(rows_list), widest_n, dtype=torch.bfloat16)
        square = next(w for w in weights if w.shape[0] == w.shape[1])  # an o_proj: [H, H]

        shapes = {tuple(w.shape): w for w in weights}.values()
        for isa in isas:
            for m in rows_list:
                outputs = {}
                for tree in trees:
                    parts = []
                    for w in shapes:
                        product(libs[tree, isa], xs[m], w, y, args.threads)
                        parts.append(y.flatten()[:m * w.shape[0]].clone())  # [m, N] row-major
                    outputs[tree] = torch.cat(parts)
                first = next(iter(outputs.values()))
                differ = [t for t, o in outputs.items() if not torch.equal(o, first)]
                if differ:
                    print(f"{isa}, {m} rows: outputs differ from this tree's: {', '.join(differ)}")

        from_memory: dict[tuple, list[float]] = {}
        from_l2: dict[tuple, list[float]] = {}
        for _ in range(args.repeats):
            for (tree, isa), lib in libs.items():
                for m in rows_list:
                    for pages, copy in copies.items():
                        start = time.perf_counter()
                        for w in copy:
                            product(lib, xs[m], w, y, args.threads)
                        from_memory.setdefault((tree, isa, pages, m), []).append(
                            time.perf_counter() - start)
                    start = time.perf_counter()
                    for _ in range(L2_CALLS):
                        product(lib, xs[m], square, y, args.threads)
                    from_l2.setdefault((tree, isa, m), []).append(time.perf_counter() - start)

    print(f"\nthe widened target's {len(weights)} layer products, best of {args.repeats}: from "
          f"memory (ms, x 1 row) and from L2 (a {square.shape[0]} x {square.shape[1]} product "
          f"{L2_CALLS} times, GFLOP/s)")
    print("| path | tree | pages | " + " | ".join(f"{m} rows ms | x 1 row | L2 GFLOP/s"
                                                  for m in rows_list) + " |")
    print("|---|---|---|" + "---|---|---|" * len(rows_list))
    for isa in isas:
        for tree in trees:
            for pages in pages_list:
                one = min(from_memory[tree, isa, pages, 1])
                cells = []
                for m in rows_list:
                    memory = min(from_memory[tree, isa, pages, m])
                    flops = 2 * m * square.numel() * L2_CALLS / min(from_l2[tree, isa, m])
                    cells.append(f"{1e3 * memory:.2f} | {memory / one:.2f}x | {flops / 1e9:.0f}")
                print(f"| {isa} | {tree} | {pages} | " + " | ".join(cells) + " |")
    return 0
