"""specserve against Hugging Face transformers on one model pair: same prompts, same outputs.

    python -m bench latency                       # demo and widened pairs, 4 prompts, 2 rounds
    python -m bench latency --pairs widened --prompts 4 --max-tokens 64 --rounds 3 --json out.json
    python -m bench latency --modes off,chain:4,tree --no-transformers
    python -m bench.compare ...                   # the same runner, under its module's name

Rows, all greedy at batch 1 (one request at a time) on the same prompts:

- ``transformers greedy``: ``AutoModelForCausalLM.generate(do_sample=False)``, target alone.
- ``transformers assisted``: the same with ``assistant_model=`` the draft (transformers' defaults:
  up to 20 draft tokens per step, confidence threshold 0.4).
- ``specserve off``, ``chain:2/4/6``, ``tree:12`` and ``tree`` (dynamic tree, 24 nodes): one
  ``LLM`` holds the weights once and each row passes its mode to ``generate(speculation=...)``.

Pairs: ``demo`` is the bundled pair (11.9M target, 1.44M draft); ``widened`` is the demo target
widened to a Qwen2.5-0.5B-like shape (~367M parameters, ~700 MiB bf16, the same function; built
once by ``draft_models.widen.ensure_widened_demo``) with the demo draft. Prompts are held-out
questions from the demo model card, through the chat template.

Procedure, per pair: one untimed pass of every row over every prompt (warm-up) whose token ids
must be EQUAL for every row and prompt; if any differ the mismatches are printed and the program
exits with status 1 before any speed is reported. Then ``--rounds`` timed rounds; within a round
each prompt is run by every row back to back, in an order that rotates from prompt to prompt and
round to round, so slow spells of a shared machine hit every row alike. Timed outputs must still
equal the checked ones.

Columns: tok/s = generated tokens / end-to-end time, each prompt taking its best round (the least
disturbed one), with the median and min-max over whole rounds in brackets; ms/tok = decode time
per token after the first (end-to-end minus TTFT); TTFT = request start to first token; accept =
tokens per target forward while decoding (a forward over the prompt alone, which commits one
token, is left out, as in specserve's ``acceptance_length``; assisted generation verifies drafts
from its first forward on, so all its forwards count; transformers rows count target forwards
with a hook). The profile table
splits specserve's time per generated token (prefill included; each prompt's best round) into
the engine's stages (``EngineStats``): draft, target forward, verify, schedule, commit
(verification, KV moves, commits) and other (the ``generate`` loop outside ``step``). The
roofline line (see ``bench/roofline.py``) compares the no-speculation decode speed with the
memory bandwidth measured in this process with the same threads.

specserve runs without prefix caching, so repeated prompts are prefilled each time, like
transformers. ``--dtype float32`` runs every row in float32 (for an equality check free of bf16
rounding differences between the two implementations).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from bench.options import (
    DEFAULT_MODE,
    DTYPES,
    add_common_args,
    add_modes,
    environment,
    log,
    setup,
    write_json,
)
from bench.roofline import measure_read_bandwidth, roofline_fraction, weight_bytes
from specserve import LLM, SamplingParams
from specserve.draft_models.evaluate import chat_prompt_ids
from specserve.draft_models.widen import ensure_widened_demo
from specserve.llm import demo_pair
from specserve.model.loader import load_tokenizer

HF_GREEDY = "transformers greedy"
HF_ASSISTED = "transformers assisted"
SPEC_MODES = ("off", "chain:2", "chain:4", "chain:6", "tree:12", "tree")
STAGES = ("draft", "target_forward", "verify", "schedule", "commit")  # EngineStats.<stage>_time_s


@dataclass(frozen=True)
class Pair:
    name: str
    target: Path
    draft: Path


@dataclass
class Sample:
    """One row's run of one prompt."""

    token_ids: list[int]
    e2e_s: float
    ttft_s: float
    target_forwards: int  # prefill included
    stage_s: dict[str, float] = field(default_factory=dict)  # specserve: EngineStats deltas
    # Forwards that committed exactly one token from the prompt alone: 1 for specserve and
    # transformers greedy; 0 for assisted generation, whose first forward already verifies
    # draft tokens after the prompt and may commit several.
    prefill_forwards: int = 1


Runner = Callable[[list[int]], Sample]


class OutputMismatch(AssertionError):
    """Rows produced different token ids for the same prompt."""


# ---- pairs and prompts ----------------------------------------------------------------------
def load_pair(name: str) -> Pair:
    """``demo`` (the bundled pair) or ``widened`` (the widened demo target, demo draft)."""
    target, draft = demo_pair()
    if name == "widened":
        target = ensure_widened_demo()
    elif name != "demo":
        raise ValueError(f"unknown pair {name!r}; use demo or widened")
    return Pair(name, target, draft)


def held_out_questions(n: int) -> list[str]:
    """The first ``n`` held-out questions the demo model card measured acceptance on."""
    results = json.loads((demo_pair()[0].parent / "results.json").read_text())
    questions = results["prompts"]
    if not 1 <= n <= len(questions):
        raise ValueError(f"--prompts must be in 1..{len(questions)}")
    return questions[:n]


def chat_prompts(tokenizer, questions: Sequence[str]) -> list[list[int]]:
    """One-turn chat prompts (token ids ending in the assistant generation prompt)."""
    return [chat_prompt_ids(tokenizer, q) for q in questions]


# ---- runners --------------------------------------------------------------------------------
def specserve_runner(llm, mode: str | None, max_tokens: int, ignore_eos: bool = False) -> Runner:
    """Runs one prompt alone through ``llm`` with speculation ``mode`` (``"default"`` or None:
    the engine's own choice for the loaded pair, which ``generate`` takes as None).

    The engine's suffix store is emptied first: every row times each prompt several times
    (warm-up, rounds, other modes), and suffix drafting (the default mode's on CPU) would
    otherwise draft each reply from an earlier run of the same prompt."""
    speculation = None if mode == DEFAULT_MODE else mode
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    stats = llm.engine.stats
    suffix = getattr(llm.engine, "suffix", None)

    def run(prompt: list[int]) -> Sample:
        if suffix is not None:
            suffix.store.clear()
        before = [getattr(stats, f"{s}_time_s") for s in STAGES]
        start = time.perf_counter()
        out = llm.generate([prompt], params, speculation=speculation)[0]
        e2e = time.perf_counter() - start
        stage_s = {s: getattr(stats, f"{s}_time_s") - b for s, b in zip(STAGES, before)}
        return Sample(list(out.token_ids), e2e, out.metrics["ttft_s"],
                      out.metrics["num_target_steps"], stage_s)

    return run


def run_specserve(llm, modes: Sequence[str], prompts: Sequence[list[int]], max_tokens: int,
                  rounds: int, ignore_eos: bool = False, log=None) -> list[Row]:
    """Rows for specserve speculation ``modes`` on one loaded ``LLM`` (checked, then timed)."""
    runners = {m: specserve_runner(llm, m, max_tokens, ignore_eos) for m in modes}
    return measure(runners, prompts, rounds, log=log)


class _FirstTokenClock(BaseStreamer):
    """A transformers streamer that notes when the first generated tokens arrive."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1  # the first put is the prompt
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def load_transformers(path: Path, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.eval()
    model.forward_calls = 0

    def count(*_) -> None:
        model.forward_calls += 1

    model.register_forward_pre_hook(count)
    return model


def transformers_runner(model, max_tokens: int, assistant=None, ignore_eos: bool = False,
                        pad_token_id: int | None = 0) -> Runner:
    """``model.generate`` greedy on one prompt, optionally assisted by ``assistant``."""
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_token_id,
                  temperature=None, top_p=None, top_k=None)
    if ignore_eos:
        config.eos_token_id = None

    def run(prompt: list[int]) -> Sample:
        ids = torch.tensor([prompt])
        clock = _FirstTokenClock()
        calls = model.forward_calls
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             assistant_model=assistant, streamer=clock)
        e2e = time.perf_counter() - start
        ttft = (clock.first or start + e2e) - start
        return Sample(out[0, len(prompt):].tolist(), e2e, ttft, model.forward_calls - calls,
                      prefill_forwards=0 if assistant is not None else 1)

    return run


# ---- equality check -------------------------------------------------------------------------
def output_mismatches(outputs: dict[str, list[list[int]]], reference: str) -> list[str]:
    """One line per (row, prompt) whose token ids differ from the ``reference`` row's."""
    ref = outputs[reference]
    problems = []
    for name, outs in outputs.items():
        if len(outs) != len(ref):
            problems.append(f"{name}: {len(outs)} outputs for {len(ref)} prompts")
            continue
        for i, (want, got) in enumerate(zip(ref, outs)):
            if want != got:
                at = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b),
                          min(len(want), len(got)))
                problems.append(f"prompt {i}: {name!r} differs from {reference!r} at token {at} "
                                f"({len(got)} vs {len(want)} tokens; {got[at:at + 4]} vs "
                                f"{want[at:at + 4]})")
    return problems


def check_outputs(outputs: dict[str, list[list[int]]], reference: str | None = None) -> None:
    """Raise ``OutputMismatch`` unless every row produced the same token ids for every prompt."""
    reference = reference if reference is not None else next(iter(outputs))
    problems = output_mismatches(outputs, reference)
    if problems:
        num_prompts = len(outputs[reference])
        rates = [f"{name} {sum(a == b for a, b in zip(outs, outputs[reference]))}/{num_prompts}"
                 for name, outs in outputs.items() if name != reference]
        raise OutputMismatch("outputs differ:\n  " + "\n  ".join(problems)
                             + f"\nprompts matching {reference!r}: " + ", ".join(rates))


# ---- measurement ----------------------------------------------------------------------------
@dataclass
class Row:
    """All timed samples of one row, ``samples[round][prompt]``, and their summary."""

    name: str
    samples: list[list[Sample]]

    def _best(self, key: Callable[[Sample], float]) -> list[float]:
        return [min(key(s) for s in per_prompt) for per_prompt in zip(*self.samples)]

    @property
    def num_tokens(self) -> int:  # per round
        return sum(len(s.token_ids) for s in self.samples[0])

    @property
    def tokens_per_s(self) -> float:
        """Each prompt at its best round."""
        return self.num_tokens / sum(self._best(lambda s: s.e2e_s))

    @property
    def round_tokens_per_s(self) -> list[float]:
        return [self.num_tokens / sum(s.e2e_s for s in r) for r in self.samples]

    @property
    def ms_per_token(self) -> float:
        """Decode time per token after the first, each prompt at its best round."""
        decode_tokens = sum(max(0, len(s.token_ids) - 1) for s in self.samples[0])
        return 1e3 * sum(self._best(lambda s: s.e2e_s - s.ttft_s)) / max(1, decode_tokens)

    @property
    def ttft_ms(self) -> float:
        return 1e3 * statistics.mean(self._best(lambda s: s.ttft_s))

    @property
    def acceptance_length(self) -> float:
        """Tokens per target forward while decoding (a prompt-only forward left out)."""
        first = self.samples[0]
        forwards = sum(s.target_forwards - s.prefill_forwards for s in first)
        tokens = sum(len(s.token_ids) - s.prefill_forwards for s in first)
        return tokens / forwards if forwards > 0 else 1.0

    @property
    def stage_ms_per_token(self) -> dict[str, float]:
        """specserve only: ms per generated token in each engine stage, best round per prompt."""
        flat = [min(per_prompt, key=lambda s: s.e2e_s) for per_prompt in zip(*self.samples)]
        if not flat[0].stage_s:
            return {}
        tokens = sum(len(s.token_ids) for s in flat)
        out = {st: 1e3 * sum(s.stage_s[st] for s in flat) / tokens for st in STAGES}
        out["other"] = 1e3 * sum(s.e2e_s for s in flat) / tokens - sum(out.values())
        return out

    def summary(self) -> dict:
        rounds = self.round_tokens_per_s
        return {"name": self.name, "tokens": self.num_tokens, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_median": statistics.median(rounds),
                "tokens_per_s_rounds": rounds, "ms_per_token": self.ms_per_token,
                "ttft_ms": self.ttft_ms, "acceptance_length": self.acceptance_length,
                "stage_ms_per_token": self.stage_ms_per_token}


def measure(runners: dict[str, Runner], prompts: Sequence[list[int]], rounds: int,
            reference: str | None = None, log=None) -> list[Row]:
    """Warm-up pass with the equality check, then ``rounds`` interleaved timed rounds.

    Raises ``OutputMismatch`` (before timing anything) if rows disagree on any prompt.
    """
    log = log or (lambda msg: None)
    names = list(runners)
    log(f"  warm-up and equality check: {len(names)} rows x {len(prompts)} prompts")
    checked = {name: [runners[name](list(p)).token_ids for p in prompts] for name in names}
    check_outputs(checked, reference)
    samples: dict[str, list[list[Sample]]] = {name: [] for name in names}
    for r in range(rounds):
        start = time.perf_counter()
        for name in names:
            samples[name].append([])
        for i, prompt in enumerate(prompts):
            shift = (r + i) % len(names)
            for name in names[shift:] + names[:shift]:
                s = runners[name](list(prompt))
                samples[name][r].append(s)
        log(f"  round {r + 1}/{rounds}: {time.perf_counter() - start:.1f} s")
        check_outputs({"checked": checked[names[0]]}
                      | {name: [s.token_ids for s in samples[name][r]] for name in names},
                      "checked")
    return [Row(name, samples[name]) for name in names]


# ---- one pair -------------------------------------------------------------------------------
@dataclass
class PairResult:
    pair: Pair
    num_prompts: int
    rows: list[Row]
    target_weight_bytes: int
    num_params: int
    bandwidth: float  # bytes/s, measured in this process

    def row(self, name: str) -> Row | None:
        return next((r for r in self.rows if r.name == name), None)

    @property
    def roofline(self) -> dict[str, float]:
        """Roofline fraction of each no-speculation row (weights per token / bandwidth)."""
        return {r.name: roofline_fraction(self.target_weight_bytes, r.ms_per_token / 1e3,
                                          self.bandwidth)
                for r in self.rows if r.name in (HF_GREEDY, "specserve off")}


def compare_pair(pair: Pair, prompts: Sequence[list[int]], *, modes: Sequence[str] = SPEC_MODES,
                 max_tokens: int = 64, rounds: int = 3, dtype: str = "bfloat16",
                 ignore_eos: bool = False, transformers: bool = True, bandwidth: float,
                 log=None) -> PairResult:
    """Load ``pair`` once per implementation, check outputs equal, time every row."""
    llm = LLM(pair.target, pair.draft, dtype=dtype, enable_prefix_caching=False)
    runners: dict[str, Runner] = {}
    if transformers:
        target = load_transformers(pair.target, DTYPES[dtype])
        assistant = load_transformers(pair.draft, DTYPES[dtype])
        pad = llm.tokenizer.pad_token_id
        runners[HF_GREEDY] = transformers_runner(target, max_tokens, None, ignore_eos, pad)
        runners[HF_ASSISTED] = transformers_runner(target, max_tokens, assistant, ignore_eos, pad)
    for mode in modes:
        runners[f"specserve {mode}"] = specserve_runner(llm, mode, max_tokens, ignore_eos)
    rows = measure(runners, prompts, rounds, log=log)
    num_params = sum(p.numel() for p in llm.engine.target.parameters())
    result = PairResult(pair, len(prompts), rows, weight_bytes(pair.target, DTYPES[dtype]),
                        num_params, bandwidth)
    del llm, runners
    gc.collect()
    return result


# ---- report ---------------------------------------------------------------------------------
def _ratio(value: float, base: Row | None) -> str:
    return f"{value / base.tokens_per_s:5.2f}x" if base is not None else "    -"


def format_rows(rows: Sequence[Row], baselines: Sequence[tuple[str, Row | None]]) -> str:
    """The speed table; one ratio column per named baseline row."""
    widths = [max(10, len(label) + 5) for label, _ in baselines]
    head = (f"{'row':<24}{'tok/s':>8}  {'[median, min-max]':<20}{'ms/tok':>8}{'TTFT ms':>9}"
            f"{'accept':>8}" + "".join(f"{'vs ' + label:>{w}}"
                                       for (label, _), w in zip(baselines, widths)))
    lines = [head, "-" * len(head)]
    for r in rows:
        rounds = r.round_tokens_per_s
        spread = f"[{statistics.median(rounds):.1f}, {min(rounds):.1f}-{max(rounds):.1f}]"
        lines.append(f"{r.name:<24}{r.tokens_per_s:8.1f}  {spread:<20}{r.ms_per_token:8.2f}"
                     f"{r.ttft_ms:9.1f}{r.acceptance_length:8.2f}"
                     + "".join(f"{_ratio(r.tokens_per_s, b):>{w}}"
                               for (_, b), w in zip(baselines, widths)))
    return "\n".join(lines)


def format_profile(rows: Sequence[Row]) -> str:
    """specserve rows: ms per generated token in each engine stage, and its share."""
    parts = (*STAGES, "other")
    head = f"{'ms per generated token':<24}" + "".join(f"{p:>16}" for p in parts)
    lines = [head, "-" * len(head)]
    for r in rows:
        stage = r.stage_ms_per_token
        if not stage:
            continue
        total = sum(stage.values())
        lines.append(f"{r.name:<24}" + "".join(
            f"{stage[p]:9.2f} ({100 * stage[p] / total:3.0f}%)" for p in parts))
    return "\n".join(lines)


def format_roofline(result: PairResult) -> str:
    wb, bw = result.target_weight_bytes, result.bandwidth
    floor_ms = wb / bw * 1e3
    text = (f"roofline: {wb / 2**20:.1f} MiB of target weights per forward, read bandwidth "
            f"{bw / 1e9:.1f} GB/s -> floor {floor_ms:.2f} ms/token ({1e3 / floor_ms:.0f} tok/s)")
    for name, frac in result.roofline.items():
        text += (f"\n  {name}: {result.row(name).ms_per_token:.2f} ms/token decode = "
                 f"{frac:.2f} of roofline")
    best = max((r for r in result.rows if r.name.startswith("specserve")),
               key=lambda r: r.tokens_per_s, default=None)
    if best is not None:
        text += (f"\n  fastest specserve row, {best.name.removeprefix('specserve ')}: "
                 f"{best.ms_per_token:.2f} ms/token decode"
                 f" = {floor_ms / best.ms_per_token:.2f}x the no-speculation roofline speed")
    if wb < 64 * 2**20:
        text += "\n  (weights this small stay in the CPU caches: the DRAM roofline is not a bound)"
    return text


def format_pair(result: PairResult, max_tokens: int, rounds: int, ignore_eos: bool) -> str:
    pair, rows = result.pair, result.rows
    stop = "ignoring EOS" if ignore_eos else "stopping at EOS"
    total = rows[0].num_tokens
    baselines = [("HF", result.row(HF_GREEDY)), ("off", result.row("specserve off"))]
    return "\n".join([
        f"== pair {pair.name}: target {pair.target} ({result.num_params / 1e6:.1f}M params), "
        f"draft {pair.draft} ==",
        f"{result.num_prompts} held-out prompts, greedy, batch 1, up to {max_tokens} tokens "
        f"({stop}), {rounds} timed rounds after a warm-up",
        f"outputs: all {len(rows)} rows produced identical token ids on all "
        f"{result.num_prompts} prompts ({total} tokens)",
        "",
        format_rows(rows, [(label, b) for label, b in baselines if b is not None]),
        "",
        format_profile(rows),
        "",
        format_roofline(result),
    ])


def pair_json(result: PairResult) -> dict:
    return {"pair": {k: str(v) for k, v in asdict(result.pair).items()},
            "num_prompts": result.num_prompts, "target_params": result.num_params,
            "target_weight_bytes": result.target_weight_bytes,
            "bandwidth_bytes_per_s": result.bandwidth, "roofline_fraction": result.roofline,
            "rows": [r.summary() for r in result.rows]}


# ---- CLI ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None, prog: str = "python -m bench.compare") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="demo,widened", help="comma list of demo, widened")
    add_modes(parser, ",".join(SPEC_MODES))
    parser.add_argument("--no-transformers", action="store_true", help="skip the HF rows")
    add_common_args(parser)
    args = parser.parse_args(argv)
    setup(args)
    started = time.perf_counter()
    env = environment(args.threads)
    log(f"measuring read bandwidth ({args.threads} threads)")
    bandwidth = measure_read_bandwidth()
    questions = held_out_questions(args.prompts)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report: dict = {"settings": settings, "environment": env,
                    "questions": questions, "pairs": []}
    print(f"torch {env['torch']}, transformers {env['transformers']}, {args.threads} threads on "
          f"{env['cpus']} CPUs, load average {env['load_average'][0]:.2f}, dtype {args.dtype}")
    status = 0
    for name in args.pairs.split(","):
        pair = load_pair(name.strip())
        log(f"pair {pair.name}")
        prompts = chat_prompts(load_tokenizer(pair.target), questions)
        try:
            result = compare_pair(pair, prompts, modes=args.modes.split(","),
                                  max_tokens=args.max_tokens, rounds=args.rounds,
                                  dtype=args.dtype, ignore_eos=args.ignore_eos,
                                  transformers=not args.no_transformers, bandwidth=bandwidth,
                                  log=log)
        except OutputMismatch as e:
            print(f"\n== pair {pair.name}: OUTPUTS DIFFER, no speeds reported ==\n{e}")
            report["pairs"].append({"pair": pair.name, "error": str(e)})
            status = 1
            break
        print()
        print(format_pair(result, args.max_tokens, args.rounds, args.ignore_eos))
        report["pairs"].append(pair_json(result))
    report["environment"]["load_average_end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - started
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; wall time "
          f"{report['wall_s']:.0f} s")
    write_json(args, report)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
