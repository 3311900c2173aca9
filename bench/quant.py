"""Weight-only quantization: decode speed beside bf16 and llama.cpp, and what it costs in quality.

    python -m bench quant                              # speed (widened pair) and quality (demo)
    python -m bench quant --skip-quality --prompts 4 --rounds 2
    python -m bench quant --skip-speed

Speed, batch 1, greedy, on the widened pair (bench/RESULTS.md: the demo target grown to a
0.5B-like shape, bandwidth-bound): specserve with the target (and draft) in bf16, int8 and int4,
each with speculation off and in the default mode, and llama.cpp's `llama-completion` on GGUFs of
the same target: q8_0 from llama.cpp's converter, and q4_0 made from it here (the peer build has
no llama-quantize): every Q8_0 projection (attn_*, ffn_*) re-quantized to Q4_0 by the gguf
package, the token embedding (tied LM head) left Q8_0.
Decode tok/s leaves the prompt out: specserve's rows time tokens after the first, llama.cpp's
come from its own printed eval timings. Rows run interleaved, each prompt at its best round.
Within each quantization, the default mode's tokens must equal speculation off's (checked
before timing); across quantizations they differ, which the quality section measures.

Kernels (`--skip-kernels` to leave out): the CPU's arithmetic ceilings, then two tables. Ceilings
(specserve/kernels/cpu_ceiling.c): fp32 FMAs, int16 multiply-adds and bf16 dot-step multiply-adds
per second on every thread, measured before and after the row-scaling table and the higher of
the two kept (a machine whose speed drifts would otherwise put a kernel above its ceiling).
Row scaling: one decoder layer's projections of the widened shape (qkv 1280x1024, o 1024x1024,
gate/up 8192x1024, down 1024x4096), 24 copies so the weights come from memory, timed for
`--kernel-rows` activation rows (1, 5, 8, 16, 32): Q8_0, Q4_0, Q4_1, Q4_K and Q6_K (the
k-quants from quant_reference's own quantizer: the kernel's speed does not depend on the values)
on the C kernel of the selected ISA with Q16, Q8 and fp32 activations (SPECSERVE_QUANT_ACT,
specserve/kernels/quant_cpu.py), the blocks in the row order a model on the CPU keeps them
(tiled for integer activations), Q16 also in the grouped order and Q8_0 / Q16 row by row (GGUF's
order, "by row"), bf16 on `kernels.linear`; ms per pass over all 24 layers, the cost of M rows
relative to one row, the weight bytes read per second, GFLOP/s (2 per multiply-add), and the
multiply-adds per second as a share of the ceiling of the instruction the kernel is built on.
Shapes: each projection of the
widened target and of SmolLM2-135M alone, M = 1 and 5, weights cycled from memory: time per
product, weight bytes read per second and that as a share of torch.sum's read bandwidth (the
memory bound), for Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K with each activation format (the k-quants
where K is whole super-blocks of 256; the blocks in the row order a model keeps, as above), fp32
torch and bf16.

Quality, on the demo target (the widened one computes the same function): mean next-token NLL
(nats) over the model card's held-out windows (32 chat + 32 code windows of 256 tokens from the
stdlib corpus's validation modules, never trained on),
and greedy agreement with bf16 over 32 tokens on 16 held-out chat prompts: the share of
identical tokens, position by position, and how many prompts match in full.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.compare import (
    Row,
    chat_prompts,
    held_out_questions,
    load_pair,
    specserve_runner,
)
from bench.cpu_paths import PEER, llamacpp_runner, measure_decode, peer_bin
from bench.options import (
    DEFAULT_MODE,
    add_common_args,
    add_modes,
    cpu,
    environment,
    log,
    setup,
    write_json,
)
from bench.roofline import measure_ceilings, measure_read_bandwidth
from specserve import LLM, SamplingParams
from specserve.llm import demo_pair
from specserve.model.loader import load_model, load_tokenizer
from specserve.model.runner import ModelRunner, Segment

QUANTIZATIONS = ("bf16", "int8", "int4")


def _quantization(name: str) -> str | None:
    return None if name == "bf16" else name


# ---- speed ----------------------------------------------------------------------------------
def measure_speed(args, prompts: list[list[int]], pair, ggufs: dict[str, Path]) -> list[Row]:
    runners, groups = {}, {}
    for q in QUANTIZATIONS:
        llm = LLM(pair.target, pair.draft, quantization=_quantization(q))
        for mode in args.modes.split(","):
            name = f"specserve {q} {mode}"
            runners[name] = specserve_runner(llm, mode, args.max_tokens, args.ignore_eos)
            groups.setdefault(q, []).append(name)
    if ggufs:
        bin_dir = peer_bin(PEER)
        if bin_dir is None:
            raise RuntimeError(f"llama.cpp GGUFs given but the peer is not built ({PEER} build)")
        tokenizer = load_tokenizer(pair.target)
        for label, path in ggufs.items():
            runners[f"llama.cpp {label}"] = llamacpp_runner(bin_dir, path, None, tokenizer,
                                                            args.max_tokens, args.threads)
    # Speculation changes nothing within one quantization: each group's outputs are checked.
    return measure_decode(runners, groups, prompts, args.rounds)


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


# ---- kernels ----------------------------------------------------------------------------------
LAYER_SHAPES = [(1280, 1024), (1024, 1024), (8192, 1024), (1024, 4096)]  # (N, K), widened
# (name, N, K): one layer's projections (q/k/v and gate/up fused, as the model runs them).
KERNEL_SHAPES = [("widened qkv", 1280, 1024), ("widened o", 1024, 1024),
                 ("widened gate_up", 8192, 1024), ("widened down", 1024, 4096),
                 ("SmolLM2 qkv", 960, 576), ("SmolLM2 o", 576, 576),
                 ("SmolLM2 gate_up", 3072, 576), ("SmolLM2 down", 576, 1536)]
ACTS = ("q16", "q8", "fp32")  # the C kernel's activation formats (quant_cpu.ACTIVATIONS)
KERNEL_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
QUANT_KINDS = [(fmt, act) for fmt in KERNEL_FORMATS for act in ACTS]


def _quant_fn(act: str):
    from specserve.kernels.quant_cpu import quant_matmul

    return lambda x, w: quant_matmul(x, w, act=act)


def measure_kernels(rows: tuple[int, ...] = (1, 5, 8, 16, 32), layers: int = 24,
                    repeats: int = 5) -> tuple[dict[str, dict[int, float]], dict[str, int]]:
    """ms per pass over `layers` copies of LAYER_SHAPES, per weight kind and row count
    (kinds interleaved, best of `repeats`), and each kind's weight bytes per pass. Quantized
    weights in the row order a model on the CPU keeps for the activation format
    (quant_cpu.cpu_row_order: tiled for integer activations), Q16 also in the grouped order
    ("grouped"), and Q8_0 / Q16 in GGUF's row by row order ("by row")."""
    from specserve.kernels import linear
    from specserve.kernels.quant_cpu import cpu_row_order
    from specserve.kernels.quant_reference import ROW_GROUP, quantize

    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=gen).to(torch.bfloat16)
             for _ in range(layers) for n, k in LAYER_SHAPES]
    weights = {"bf16": (linear, dense)}
    for fmt in KERNEL_FORMATS:
        by_row = [quantize(w, fmt) for w in dense]
        for act in ACTS:
            weights[f"{fmt} {act}"] = (_quant_fn(act), [
                w.with_row_group(cpu_row_order(w.shape[0], act)) for w in by_row])
        weights[f"{fmt} q16 grouped"] = (_quant_fn("q16"),
                                         [w.with_row_group(ROW_GROUP) for w in by_row])
        if fmt == "Q8_0":
            weights["Q8_0 q16 by row"] = (_quant_fn("q16"), by_row)
    out: dict[str, dict[int, float]] = {kind: {} for kind in weights}
    nbytes = {kind: sum(w.nbytes if hasattr(w, "fmt") else w.numel() * w.element_size()
                        for w in ws) for kind, (_, ws) in weights.items()}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for _, k in LAYER_SHAPES}
        for _ in range(repeats):
            for kind, (fn, ws) in weights.items():
                start = time.perf_counter()
                for w, (_, k) in zip(ws, LAYER_SHAPES * layers):
                    fn(xs[k], w)
                ms = 1e3 * (time.perf_counter() - start)
                out[kind][m] = min(out[kind].get(m, float("inf")), ms)
    return out, nbytes


def _instruction(kind: str, rows: int, isa: str | None) -> str:
    """The ceiling (measure_ceilings' name) that bounds kernel `kind` at `rows` rows."""
    from specserve.kernels.cpu_linear import GEMM_MIN_ROWS

    if " q" in kind:
        return "madd16"
    if kind != "bf16":
        return "fma"
    return "fma" if rows >= GEMM_MIN_ROWS and isa not in ("avx512", "amx") else "dot"


def format_kernels(result: dict[str, dict[int, float]], nbytes: dict[str, int],
                   ceilings: dict[str, float], layers: int = 24, isa: str | None = None) -> str:
    """Per kind and row count: ms, the cost over one row, weight GB/s, GFLOP/s and the
    multiply-adds per second as a share of the ceiling of the instruction the kernel is built
    on (integer activations: int16 multiply-adds; bf16: the bf16 dot step, and on the AVX2
    and portable paths from GEMM_MIN_ROWS rows fp32 FMAs, the blocked GEMM's weights being
    packed as fp32; fp32 activations: fp32 FMAs)."""
    rows = list(next(iter(result.values())))
    macs = layers * sum(n * k for n, k in LAYER_SHAPES)  # per activation row
    lines = ["| weights | " + " | ".join(f"M={m}: ms, / M=1, GB/s, GFLOP/s, of ceiling"
                                         for m in rows) + " |",
             "|---" * (1 + len(rows)) + "|"]
    for kind, by_m in result.items():
        cells = []
        for m in rows:
            ceiling = ceilings.get(_instruction(kind, m, isa))
            seconds = by_m[m] / 1e3
            share = f"{m * macs / seconds / ceiling:.0%}" if ceiling else "-"
            cells.append(f"{by_m[m]:.1f}, {by_m[m] / by_m[rows[0]]:.2f}x, "
                         f"{nbytes[kind] / seconds / 1e9:.1f}, {2 * m * macs / seconds / 1e9:.1f}, "
                         f"{share}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _copy(w):
    from specserve.kernels.quant_reference import QuantizedWeight

    if isinstance(w, QuantizedWeight):
        return QuantizedWeight(w.fmt, w.blocks.clone(), w.shape, w.row_group)
    return w.clone()


def measure_kernel_shapes(rows: tuple[int, ...] = (1, 5), repeats: int = 5,
                          footprint: int = 96 << 20) -> dict:
    """Seconds per product and weight bytes read, per shape of KERNEL_SHAPES, weight kind and
    row count: Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K with q16, q8 and fp32 activations on the C kernel
    of the selected ISA, the blocks in the row order a model on the CPU keeps for the activation
    format (quant_cpu.cpu_row_order: tiled for integer activations, as in measure_kernels), fp32
    weights on torch's F.linear, bf16 on `kernels.linear`. Each kind cycles through
    copies of its weight totalling `footprint` bytes (past the last-level cache, so the weights
    come from memory, as in decode); kinds interleaved, best of `repeats`."""
    from specserve.kernels import linear
    from specserve.kernels.quant_cpu import cpu_row_order
    from specserve.kernels.quant_reference import QuantizedWeight, quantize

    gen = torch.Generator().manual_seed(0)
    result = {}
    for name, n, k in KERNEL_SHAPES:
        dense = torch.randn(n, k, generator=gen)
        kinds = {"fp32 torch": (F.linear, dense), "bf16 linear": (linear, dense.bfloat16())}
        for fmt, act in QUANT_KINDS:
            if fmt in ("Q4_K", "Q6_K") and k % 256:
                continue  # a k-quant needs whole super-blocks
            kinds[f"{fmt} {act}"] = (_quant_fn(act), quantize(dense, fmt).with_row_group(
                cpu_row_order(n, act)))
        copies, nbytes = {}, {}
        for kind, (_, w) in kinds.items():
            size = w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
            count = max(2, -(-footprint // size))
            copies[kind] = [w] + [_copy(w) for _ in range(count - 1)]
            nbytes[kind] = size
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            xs = {"fp32 torch": x}
            best = {kind: float("inf") for kind in kinds}
            for _ in range(repeats):
                for kind, (fn, _) in kinds.items():
                    xk = xs.get(kind, x.bfloat16())
                    start = time.perf_counter()
                    for w in copies[kind]:
                        fn(xk, w)
                    best[kind] = min(best[kind],
                                     (time.perf_counter() - start) / len(copies[kind]))
            result[f"{name} {n}x{k} M={m}"] = {
                kind: {"us": 1e6 * best[kind], "gbps": nbytes[kind] / best[kind] / 1e9}
                for kind in kinds}
        del copies
    return result


def format_kernel_shapes(result: dict, bandwidth: float) -> str:
    kinds = list(max(result.values(), key=len))  # every kind (k-quants skip some shapes)
    fmts = KERNEL_FORMATS
    lines = ["| shape | " + " | ".join(kinds) + " | "
             + " | ".join(f"{fmt} {act} vs fp32 act" for act in ACTS[:-1] for fmt in fmts) + " |",
             "|---" * (len(kinds) + 1 + len(fmts) * (len(ACTS) - 1)) + "|"]
    for shape, by_kind in result.items():
        cells = [f"{v['us']:.0f} us {v['gbps']:.1f} GB/s {v['gbps'] / bandwidth:.0%}"
                 if (v := by_kind.get(kind)) else "-" for kind in kinds]
        speedups = [f"{by_kind[f'{fmt} fp32']['us'] / by_kind[f'{fmt} {act}']['us']:.2f}x"
                    if f"{fmt} fp32" in by_kind else "-" for act in ACTS[:-1] for fmt in fmts]
        lines.append(f"| {shape} | " + " | ".join(cells + speedups) + " |")
    return "\n".join(lines)


# ---- quality --------------------------------------------------------------------------------
def held_out_windows(tokenizer, num_windows: int, length: int) -> list[list[int]]:
    """The model card's validation windows: `num_windows` of `length + 1` tokens from each of
    the held-out chat and code streams (draft_models/recipe.py)."""
    from specserve.draft_models.data import build_corpus, concat_stream, fixed_windows

    corpus = build_corpus()
    windows = []
    for docs in (corpus.val_chat, corpus.val_code):
        stream = concat_stream([tokenizer.encode(d, add_special_tokens=False) for d in docs])
        windows += fixed_windows(stream, length, num_windows).tolist()
    return windows


def window_logits(model, windows: list[list[int]], block_size: int = 16):
    """Each window's logits at every position but the last, one window at a time:
    [len - 1, vocab] float32."""
    length = len(windows[0]) - 1
    blocks = -(-length // block_size)
    runner = ModelRunner(model, num_blocks=blocks, block_size=block_size)
    for w in windows:
        seg = Segment(w[:-1], range(length), 0, list(range(blocks)), range(length))
        yield runner.forward([seg])[0].float()


def mean_nll(model, windows: list[list[int]]) -> float:
    total = sum(F.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum").item()
                for w, logits in zip(windows, window_logits(model, windows)))
    return total / (len(windows) * (len(windows[0]) - 1))


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
def main(argv: list[str] | None = None, prog: str = "python -m bench quant") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    add_modes(parser, f"off,{DEFAULT_MODE}")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--kernel-rows", default="1,5,8,16,32",
                        help="comma list of activation rows for the kernel scaling table")
    parser.add_argument("--gguf-q8-0", type=Path, help="llama.cpp q8_0 GGUF of the widened "
                        "target (default: converted with the peer tool when it is built)")
    parser.add_argument("--gguf-q4-0", type=Path, help="llama.cpp q4_0 GGUF of the widened target")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--nll-windows", type=int, default=32, help="per stream (chat, code)")
    parser.add_argument("--nll-length", type=int, default=256)
    parser.add_argument("--agreement-prompts", type=int, default=16)
    args = parser.parse_args(argv)
    setup(args)
    processor = cpu()
    report: dict = {"environment": environment(args.threads), "cpu_flags": processor["flags"]}
    print(f"torch {report['environment']['torch']}, {args.threads} threads, CPU family "
          f"{processor.get('family')} model {processor.get('model')}, flags "
          f"{' '.join(processor['flags'])}, load average "
          f"{report['environment']['load_average'][0]:.2f}")
    if not args.skip_kernels:
        from specserve.kernels import cpu_build

        log("ceilings")
        before = measure_ceilings(threads=args.threads)
        log("kernel scaling")
        report["kernels"], report["kernel_bytes"] = measure_kernels(
            tuple(int(m) for m in args.kernel_rows.split(",")))
        after = measure_ceilings(threads=args.threads)
        ceilings = {name: max(ops, after.get(name, 0.0)) for name, ops in before.items()}
        report["ceilings"] = ceilings
        print(f"\nArithmetic ceilings, {args.threads} threads, ISA path "
              f"{cpu_build.selected_isa()}, the higher of before / after the table: "
              + ", ".join(f"{name} {ops / 1e9:.1f} G multiply-adds/s ({before[name] / 1e9:.1f}"
                          f" / {after.get(name, 0.0) / 1e9:.1f})"
                          for name, ops in ceilings.items()))
        print(f"\nOne pass over 24 widened layers' projections (weights from memory), ISA path "
              f"{cpu_build.selected_isa()}, best of 5:\n")
        print(format_kernels(report["kernels"], report["kernel_bytes"], ceilings,
                             isa=cpu_build.selected_isa()))
        log("kernel shapes")
        bandwidth = measure_read_bandwidth(256 << 20)
        report["read_bandwidth_gbps"] = bandwidth / 1e9
        report["kernel_shapes"] = measure_kernel_shapes()
        print(f"\nOne product per shape, weights from memory (copies cycled past the L3), best "
              f"of 5, ISA path {cpu_build.selected_isa()}: time, weight bytes read per second, "
              f"and that as a share of torch.sum's read bandwidth "
              f"({bandwidth / 1e9:.1f} GB/s):\n")
        print(format_kernel_shapes(report["kernel_shapes"], bandwidth / 1e9))
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
    write_json(args, report)
    return 0


def _ggufs(args, target: Path) -> dict[str, Path]:
    """The llama.cpp GGUFs to time: given ones, else made once (q8_0 by the peer tool)."""
    ggufs = {"q8_0": args.gguf_q8_0, "q4_0": args.gguf_q4_0}
    if ggufs["q8_0"] is None and PEER.is_file():
        path = target.parent / f"{target.name}-q8_0.gguf"
        if not path.is_file():
            log(f"  converting {target} to {path}")
            subprocess.run([str(PEER), "convert", str(target), str(path), "q8_0"], check=True,
                           capture_output=True)
        ggufs["q8_0"] = path
    if ggufs["q4_0"] is None and ggufs["q8_0"] is not None:
        path = target.parent / f"{target.name}-q4_0.gguf"
        if not path.is_file():
            log(f"  re-quantizing {ggufs['q8_0']} to {path}")
            requantize_projections(ggufs["q8_0"], path)
        ggufs["q4_0"] = path
    return {k: v for k, v in ggufs.items() if v is not None}


def requantize_projections(source: Path, dest: Path) -> None:
    """Copy a Q8_0 GGUF with its Q8_0 attn_* / ffn_* weights re-quantized to Q4_0."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dest, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = gguf.LlamaFileType.MOSTLY_Q4_0
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
    tensors = []
    for t in reader.tensors:
        data, qtype = t.data, t.tensor_type
        if qtype == q8 and (".attn_" in t.name or ".ffn_" in t.name):
            data, qtype = quantize(dequantize(t.data, q8), q4), q4
        tensors.append((t.name, data, qtype))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
