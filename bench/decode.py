"""Batch-1 greedy decode speed: specserve (speculation off) against transformers `generate`.

    python -m bench decode                        # Qwen2.5-0.5B shape, random init, bf16
    python -m bench decode --threads 1 --new-tokens 32 --repeats 2 --json

The model is a random-init `Qwen2ForCausalLM` shaped like Qwen2.5-0.5B (hidden 896, 24 layers,
14 query / 2 KV heads, MLP 4864, vocabulary 151936, tied embeddings, RoPE base 1e6), saved once
in bfloat16 to a cache folder (`--model-dir`) and reused by later runs. Its tokenizer is a
word-level one with one token per model id (`t0`, `t1`, ...): specserve's engine loads a
tokenizer and detokenizes every output token, and a tokenizer smaller than the model's vocabulary
would make most generated ids decode to nothing, which is not the work a real model's engine does.
Prompts are token ids, so the tokenizer never encodes anything.

Both sides get the same prompt ids, the same greedy decode length and the same torch thread
count, in one process; repeats alternate which side goes first. Speed is *decode only*: each side
records a timestamp when each generated token becomes available (specserve: after the engine step
that committed it; transformers: when `generate` hands it to a streamer), and

    decode tokens/s = (N - 1) / (time of token N - time of token 1)

so the prompt forward that produces token 1 is left out. The table shows the median over repeats.

The generated ids are compared position by position. Random-init models have flat logits, so a
bf16 rounding difference between the two implementations can flip a near-tie and the sequences
part from there. The first differing position is reported with the size of the disagreement:
in transformers' logits at that position, its token's logit minus specserve's token's logit,
next to the logits' standard deviation (a gap far below it is a near-tie). With `--dtype float32`
the same model gives identical ids on both sides.

Roofline (`bench/roofline.py`): one decode forward reads every weight once (with tied
embeddings the LM head reads the embedding matrix in full). The achieved weight-read rate,
weight bytes x tokens/s, is divided by the streaming read bandwidth this process's threads reach
(`torch.sum` over a buffer far larger than the last-level cache, measured after the decode runs).
KV reads at these context lengths are under 1% of the weight bytes and are not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.options import add_json, add_threads, write_json
from bench.roofline import measure_read_bandwidth, roofline_fraction, weight_bytes

# Qwen2.5-0.5B's shape (its config.json), for a random-init stand-in.
QWEN25_05B = dict(  # noqa: C408
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
    max_window_layers=24,
)
EOS_TOKEN = "<|endoftext|>"


def default_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "specserve" / "bench" / "qwen2.5-0.5b-random-bf16"


def save_word_tokenizer(folder: Path, vocab_size: int, eos_id: int) -> None:
    """A word-level tokenizer, one token per model id: `t<id>`; EOS_TOKEN at `eos_id` (> 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size) if i != eos_id}
    vocab[EOS_TOKEN] = eos_id
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.save_pretrained(folder)


def save_random_qwen2(folder: Path, seed: int = 0, std: float = 0.02,
                      dtype: torch.dtype = torch.bfloat16, **overrides) -> Path:
    """Random-init Qwen2 (Qwen2.5-0.5B shape unless overridden) plus its tokenizer, in `folder`.

    Every matrix is drawn from N(0, std), norms and biases keep transformers' init (ones, zeros).
    A small std keeps the residual stream bounded through 24 layers in bf16 (no inf / NaN).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = {**QWEN25_05B, **overrides}
    eos_id = shape["vocab_size"] - 1
    config = Qwen2Config(**shape, bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    folder.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(folder)
    save_word_tokenizer(folder, shape["vocab_size"], eos_id)
    return folder


def ensure_model(folder: Path) -> Path:
    """The Qwen2.5-0.5B-shaped model in `folder`, created on first use."""
    if not ((folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()):
        print(f"saving a random-init Qwen2.5-0.5B-shaped model to {folder} (once) ...", flush=True)
        save_random_qwen2(folder)
    return folder


# ---- the two decoders ---------------------------------------------------------------------
@dataclass
class Run:
    """One greedy generation: its ids and the perf_counter time each became available."""

    token_ids: list[int]
    stamps: list[float]

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.stamps) - 1) / (self.stamps[-1] - self.stamps[0])


_STEP_FIELDS = ("num_steps", "schedule_time_s", "draft_time_s", "target_forward_time_s",
                "verify_time_s", "commit_time_s")


def _stats_snapshot(engine) -> dict[str, float]:
    return {f: getattr(engine.stats, f) for f in _STEP_FIELDS}


def specserve_run(llm, prompt_ids: list[int], new_tokens: int,
                  step_stats: dict[str, float] | None = None) -> Run:
    """Greedy-decode `new_tokens` through the engine's own step loop, stamping each token.

    `step_stats`, when given, accumulates the engine's step-time counters over the decode steps
    (every step after the one that computed the prompt).
    """
    from specserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    req = engine.add_request(list(prompt_ids), params)
    stamps: list[float] = []
    before = None
    try:
        while not req.is_finished:
            deltas = engine.step()
            now = time.perf_counter()
            for d in deltas:
                if d.request_id == req.request_id:
                    stamps.extend([now] * len(d.token_ids))
            if before is None and stamps:
                before = _stats_snapshot(engine)
    finally:
        engine.abort(req.request_id)
    if step_stats is not None and before is not None:
        after = _stats_snapshot(engine)
        for f in _STEP_FIELDS:
            step_stats[f] = step_stats.get(f, 0) + after[f] - before[f]
    return Run(list(req.output_token_ids), stamps)


def load_hf(folder: Path, dtype: torch.dtype):
    """transformers' own model for `folder`, set to generate exactly max_new_tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # never stop early (ids are compared)
    return model


def hf_run(model, prompt_ids: list[int], new_tokens: int) -> Run:
    """Greedy `generate` with a streamer that stamps each generated token."""
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value) -> None:
            if not self.prompt_seen:  # generate first hands over the prompt itself
                self.prompt_seen = True
                return
            self.times.extend([time.perf_counter()] * value.numel())

        def end(self) -> None:
            pass

    streamer = Stamps()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=0, streamer=streamer)
    return Run(out[0, len(prompt_ids):].tolist(), streamer.times)


def tie_gap(model, prompt_ids: list[int], generated: list[int], pos: int, other: int
            ) -> tuple[float, float]:
    """transformers' logit of `generated[pos]` minus that of `other` at `pos`, and logits' std."""
    ids = torch.tensor([prompt_ids + generated[:pos]])
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].float()  # [vocab]
    return float(logits[generated[pos]] - logits[other]), float(logits.std())


# ---- the measurement ----------------------------------------------------------------------
@dataclass
class DecodeResult:
    threads: int
    prompt_tokens: int
    new_tokens: int
    repeats: int
    specserve_tok_s: list[float]  # decode tokens/s per repeat
    hf_tok_s: list[float]
    ids_equal: bool  # every repeat's ids equal between the two, and across repeats
    first_mismatch: int | None  # first generated position where they differ (repeat 0)
    matching_positions: int  # positions with equal ids (repeat 0)
    # At first_mismatch, in transformers' logits (one full forward over the common prefix):
    # logit of its own choice minus logit of specserve's choice, and the logits' std for scale.
    mismatch_logit_gap: float | None
    mismatch_logit_std: float | None
    weight_bytes: int
    read_bandwidth_bytes_s: float
    cpu_bf16_kernel: bool | None  # specserve's AVX-512 BF16 linear in use (None: not built in)
    # specserve per decode step, averaged: scheduler, draft, target forward, verify, commit (s)
    step_time_s: dict[str, float] = field(default_factory=dict)

    @property
    def specserve_median(self) -> float:
        return statistics.median(self.specserve_tok_s)

    @property
    def hf_median(self) -> float:
        return statistics.median(self.hf_tok_s)

    @property
    def ratio(self) -> float:
        return self.specserve_median / self.hf_median

    def roofline(self, tok_s: float) -> float:
        return roofline_fraction(self.weight_bytes, 1 / tok_s, self.read_bandwidth_bytes_s)

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(specserve_median_tok_s=self.specserve_median, hf_median_tok_s=self.hf_median,
                   ratio=self.ratio,
                   specserve_roofline=self.roofline(self.specserve_median),
                   hf_roofline=self.roofline(self.hf_median))
        return out


def run_decode(model_dir: Path, prompt_tokens: int = 32, new_tokens: int = 64, repeats: int = 3,
               threads: int | None = None, dtype: str = "bfloat16", seed: int = 0,
               bandwidth_bytes: int = 1 << 30) -> DecodeResult:
    """Measure both decoders on `model_dir`; see the module docstring."""
    from specserve import LLM

    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    block = 16
    llm = LLM(model_dir, speculation="off", dtype=dtype, max_num_seqs=1,
              num_blocks=-(-(prompt_tokens + new_tokens) // block) + 1, block_size=block)
    hf = load_hf(model_dir, torch_dtype)
    vocab = llm.engine.target.spec.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab - 1, (prompt_tokens,), generator=gen).tolist()

    specserve_run(llm, prompt, 4)  # warm-up: first-call allocations, lazy inits
    hf_run(hf, prompt, 4)
    spec_rates, hf_rates, spec_ids, hf_ids = [], [], [], []
    step_stats: dict[str, float] = {}
    for r in range(repeats):
        order = ("specserve", "hf") if r % 2 == 0 else ("hf", "specserve")
        for side in order:
            if side == "specserve":
                run = specserve_run(llm, prompt, new_tokens, step_stats)
                spec_rates.append(run.decode_tokens_per_s)
                spec_ids.append(run.token_ids)
            else:
                run = hf_run(hf, prompt, new_tokens)
                hf_rates.append(run.decode_tokens_per_s)
                hf_ids.append(run.token_ids)
            assert len(run.token_ids) == new_tokens == len(run.stamps), side

    a, b = spec_ids[0], hf_ids[0]
    mismatches = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    gap = std = None
    if mismatches:
        gap, std = tie_gap(hf, prompt, b, mismatches[0], a[mismatches[0]])
    steps = max(1, step_stats.get("num_steps", 0))
    bandwidth = measure_read_bandwidth(bandwidth_bytes)
    return DecodeResult(
        threads=threads, prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats,
        specserve_tok_s=spec_rates, hf_tok_s=hf_rates,
        ids_equal=all(ids == a for ids in spec_ids + hf_ids),
        first_mismatch=mismatches[0] if mismatches else None,
        matching_positions=new_tokens - len(mismatches),
        mismatch_logit_gap=gap, mismatch_logit_std=std,
        weight_bytes=weight_bytes(model_dir, torch_dtype), read_bandwidth_bytes_s=bandwidth,
        cpu_bf16_kernel=_cpu_bf16_kernel() if torch_dtype == torch.bfloat16 else False,
        step_time_s={name: step_stats.get(f"{name}_time_s", 0.0) / steps
                     for name in ("schedule", "draft", "target_forward", "verify",
                                  "commit")},
    )


def _cpu_bf16_kernel() -> bool | None:
    try:
        from specserve.kernels import cpu_linear
    except ImportError:
        return None
    return cpu_linear.available()


_KERNEL_STATE = {True: "on", False: "off", None: "not in this version"}


def format_result(res: DecodeResult) -> str:
    bw = res.read_bandwidth_bytes_s
    lines = [
        f"batch 1 greedy decode, {res.prompt_tokens}-token prompt, {res.new_tokens} new tokens "
        f"(decode rate excludes token 1), {res.threads} threads, median of {res.repeats}",
        f"{'':<14}{'tok/s':>9}{'ms/tok':>9}{'roofline':>10}   per repeat",
    ]
    for name, rates, med in (("specserve", res.specserve_tok_s, res.specserve_median),
                             ("transformers", res.hf_tok_s, res.hf_median)):
        lines.append(f"{name:<14}{med:9.2f}{1e3 / med:9.2f}{res.roofline(med):10.1%}   "
                     + " ".join(f"{x:.2f}" for x in rates))
    lines.append(f"ratio specserve / transformers: {res.ratio:.3f} (specserve's AVX-512 BF16 "
                 f"linear kernel: {_KERNEL_STATE[res.cpu_bf16_kernel]})")
    lines.append(f"weights read per forward {res.weight_bytes / 2**20:.1f} MiB; streaming read "
                 f"bandwidth {bw / 1e9:.2f} GB/s (torch.sum of a float32 buffer, "
                 f"{res.threads} threads) -> roofline {bw / res.weight_bytes:.2f} tok/s")
    st = res.step_time_s
    lines.append("specserve per decode step: " + ", ".join(
        f"{k} {v * 1e3:.3f} ms" for k, v in st.items()))
    if res.ids_equal:
        lines.append(f"generated ids: identical ({res.new_tokens}/{res.new_tokens}, all repeats)")
    else:
        lines.append("generated ids: specserve and transformers agree in repeat 0, a later "
                     "repeat differs" if res.first_mismatch is None else
                     f"generated ids: {res.matching_positions}/{res.new_tokens} positions equal "
                     f"(repeat 0); first difference at generated token {res.first_mismatch}, "
                     f"where transformers' logits rank its token "
                     f"{res.mismatch_logit_gap:+.4f} above specserve's (logit std "
                     f"{res.mismatch_logit_std:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m bench decode") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="model folder (default: the random Qwen2.5-0.5B-shaped one, "
                             "created in the cache on first use)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_threads(parser)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bandwidth-gib", type=float, default=1.0,
                        help="buffer for the read-bandwidth measurement (well above the LLC)")
    add_json(parser)
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()
    folder = args.model_dir or ensure_model(default_model_dir())
    res = run_decode(folder, args.prompt_tokens, args.new_tokens, args.repeats, args.threads,
                     args.dtype, bandwidth_bytes=int(args.bandwidth_gib * 2**30))
    if args.json:
        write_json(args, res.to_json())
    else:
        print(format_result(res))
