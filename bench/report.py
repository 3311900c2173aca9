"""Plots of the current results, for those who would rather look than read.

    python -m bench report                      # bench/results/current.json -> bench/plots/
    python -m bench report --results FILE.json --out DIR

Reads the machine-readable results file (numbers copied from bench/HISTORY.md, each set with
its date, CPU, flags and command; RESULTS.md holds the same numbers) and writes:

- ``decode.png``: batch-1 decode tokens/s per speculation mode and kernel path, beside
  llama.cpp, one panel per CPU kind;
- ``few_rows.png``: the few-row cost curve, milliseconds of the target's products against the
  rows per step (1: a decode step; 5: verifying a 4-token draft chain), and the same as a
  multiple of one row's cost, one line per CPU kind and path.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "current.json"
PLOTS = HERE / "plots"
# One colour per kind of row, so a reader compares like with like across panels.
COLOURS = {"llama.cpp": "#8c8c8c", "off": "#4c72b0", "speculation": "#dd8452"}


def _kind(row: str) -> str:
    if row.startswith("llama.cpp"):
        return "llama.cpp"
    return "off" if row.endswith(" off") else "speculation"


def _title(entry: dict) -> str:
    return f"{entry['cpu']}\nflags {entry['flags']}, {entry['date']}"


def plot_decode(entries: list[dict], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(entries), figsize=(6.4 * len(entries), 4.8), squeeze=False)
    for ax, entry in zip(axes[0], entries):
        names = list(entry["rows"])[::-1]  # barh draws bottom-up; keep the file's order top-down
        values = [entry["rows"][n] for n in names]
        bars = ax.barh(names, values, color=[COLOURS[_kind(n)] for n in names])
        ax.bar_label(bars, fmt="%.1f", padding=2, fontsize=8)
        ax.set_xlabel("decode tokens/s (higher is better)")
        ax.set_title(_title(entry), fontsize=9)
        ax.set_xlim(0, max(values) * 1.15)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, ["llama.cpp", "specserve, speculation off", "specserve, speculation"],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"Batch-1 greedy decode, {entries[0]['what'].split(',')[0]}, 2 threads",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = out / "decode.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_few_rows(entries: list[dict], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, (ms_ax, rel_ax) = plt.subplots(1, 2, figsize=(11, 4.4))
    for entry in entries:
        cpu = entry["cpu"].split(",")[0] + (" (SPR)" if "Sapphire" in entry["cpu"] else " (AVX2)")
        for path, points in entry["series"].items():
            rows = [int(r) for r in points]
            ms = list(points.values())
            label = f"{cpu} {path}, {entry['date']}"
            ms_ax.plot(rows, ms, marker="o", label=label)
            rel_ax.plot(rows, [m / points["1"] for m in ms], marker="o", label=label)
    ms_ax.set_ylabel("ms per step's products (lower is better)")
    rel_ax.set_ylabel("cost over one row's")
    rel_ax.axhline(1.0, color="#8c8c8c", linewidth=0.8, linestyle="--")
    for ax in (ms_ax, rel_ax):
        ax.set_xlabel("rows per step (1 = decode, 5 = verify a 4-token chain)")
        ax.set_xticks(sorted({int(r) for e in entries for s in e["series"].values() for r in s}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    rel_ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Few-row cost: the widened target's 96 bf16 products, weights from memory, "
                 "2 threads", fontsize=11)
    fig.tight_layout()
    path = out / "few_rows.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None, prog: str = "python -m bench report") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results JSON file")
    parser.add_argument("--out", type=Path, default=PLOTS, help="folder for the PNG files")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    results = json.loads(args.results.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for path in (plot_decode(results["decode"], args.out),
                 plot_few_rows(results["few_rows"], args.out)):
        print(path)
    return 0
