"""GGUF block types converted at load: what each costs in quality against the file itself.

    python -m bench gguf-types --source widened-bf16.gguf          # the types below
    python -m bench gguf-types --source model-f32.gguf --types Q5_K_M,Q2_K --windows 8

Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks run as stored; the other types a file may hold are
converted while it is read (specserve/model/gguf_convert.py): Q5_0 into Q8_0 and Q3_K into Q6_K
exactly, Q5_1, Q5_K and Q2_K re-quantized into Q8_0. For each llama.cpp file type in `--types`
(llama-quantize's names), the file is made once from `--source` (a BF16 or F32 GGUF) by the
llamacpp-peer tool and kept in `--work`; then it is loaded twice, as specserve serves it and as
the reference (every tensor dequantized from the file's own blocks,
`loader.load_gguf_dequantized`, float32), and both score the same held-out windows (bench
quant's: chat and code text from the stdlib corpus's validation modules, never trained on).

Prints per file type: the block types its projections hold, what the runtime runs them as, the
mean next-token NLL of both and their relative difference (the aim: within 0.5%), and the
share of positions where both put the same token first.
"""

from __future__ import annotations

import argparse
import subprocess
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.cpu_paths import PEER
from bench.options import STDOUT, environment, log, write_json
from bench.quant import held_out_windows, window_logits
from specserve.model.loader import load_gguf_dequantized, load_model, load_tokenizer

TYPES = ("Q5_0", "Q5_1", "Q5_K_M", "Q3_K_M", "Q2_K")
AIM = 0.005  # the runtime's NLL within 0.5% of the reference's


def block_types(path: Path) -> dict[str, int]:
    """The file's matrices (2-D tensors) per block type, e.g. {"Q5_K": 144, "Q6_K": 25}."""
    import gguf

    reader = gguf.GGUFReader(path)
    return dict(Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2))


def runtime_formats(model) -> dict[str, int]:
    """The runtime's layer projections per block format they run, e.g. {"Q8_0": 168}."""
    from specserve.model.quant import QuantizedLinear, QuantizedParts

    found: Counter = Counter()
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedParts)) and name.startswith("layers."):
            parts = module.parts if isinstance(module, QuantizedParts) else [module]
            found.update(p.qweight.fmt.name for p in parts)
    return dict(found)


def compare(model, reference, windows: list[list[int]]) -> dict:
    """Mean next-token NLL of both over `windows`, and how often their top tokens agree."""
    nll = {"runtime": 0.0, "reference": 0.0}
    same = positions = 0
    for w, got, want in zip(windows, window_logits(model, windows),
                            window_logits(reference, windows)):
        labels = torch.tensor(w[1:])
        nll["runtime"] += F.cross_entropy(got, labels, reduction="sum").item()
        nll["reference"] += F.cross_entropy(want, labels, reduction="sum").item()
        same += int((got.argmax(-1) == want.argmax(-1)).sum())
        positions += len(labels)
    result = {k: v / positions for k, v in nll.items()}
    result["relative"] = result["runtime"] / result["reference"] - 1
    result["top1_same"] = same / positions
    return result


def measure_file(path: Path, windows: list[list[int]]) -> dict:
    model = load_model(path)
    row = {"file": path.name, "blocks": block_types(path), "runs_as": runtime_formats(model)}
    row.update(compare(model, load_gguf_dequantized(path), windows))
    return row


def make_file(source: Path, file_type: str, work: Path) -> Path:
    """`source` quantized to `file_type` by llama-quantize (through the peer tool), made once."""
    out = work / f"{source.stem}-{file_type.lower()}.gguf"
    if not out.is_file():
        if not PEER.is_file():
            raise SystemExit(f"the llama.cpp peer tool ({PEER}) is needed to make {out.name}")
        log(f"  quantizing {source.name} to {file_type}")
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(PEER), "quantize", str(source), str(tmp), file_type], check=True,
                       capture_output=True)
        tmp.rename(out)
    return out


def format_rows(rows: list[dict], windows: int, length: int) -> str:
    def counts(c: dict) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(c.items(), key=lambda kv: -kv[1]))

    lines = [f"Mean next-token NLL over {windows} held-out windows of {length} tokens: specserve "
             f"(the file as it runs) against the reference dequantized from the file's own "
             f"blocks (aim: within {AIM:.1%}):", "",
             "| file type | file's matrices | runs as | NLL runtime | NLL reference | "
             "difference | top-1 same | within aim |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['file_type']} | {counts(r['blocks'])} | {counts(r['runs_as'])} | "
                     f"{r['runtime']:.4f} | {r['reference']:.4f} | {r['relative']:+.3%} | "
                     f"{r['top1_same']:.2%} | {'yes' if abs(r['relative']) <= AIM else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m bench gguf-types") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="a BF16 or F32 GGUF file")
    parser.add_argument("--types", default=",".join(TYPES),
                        help="comma list of llama-quantize file types")
    parser.add_argument("--work", type=Path, help="where the made files are kept (default: "
                        "beside --source)")
    parser.add_argument("--windows", type=int, default=16, help="per stream (chat, code)")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", nargs="?", const=STDOUT, metavar="PATH",
                        help="the results as JSON: written to PATH, or without PATH to stdout")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        parser.error(f"--source {args.source}: no such file")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(torch.get_num_threads())
    work = args.work or args.source.parent
    work.mkdir(parents=True, exist_ok=True)
    log(f"environment: {env}")
    windows = held_out_windows(load_tokenizer(args.source), args.windows, args.length)
    rows = []
    for file_type in types:
        path = make_file(args.source, file_type, work)
        log(f"  {file_type}: scoring {len(windows)} windows")
        rows.append({"file_type": file_type, **measure_file(path, windows)})
    print(format_rows(rows, len(windows), args.length))
    if args.json:
        write_json(args, {"environment": env, "rows": rows})
    return 0
