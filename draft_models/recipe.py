"""The one command that rebuilds the bundled demo pair in ``draft_models/demo/``.

    python -m draft_models.recipe            # from the repository root
    python -m specserve.draft_models.recipe  # once installed

Phases: stdlib corpus -> byte-level BPE -> target pre-training -> draft distillation (toward the
saved bf16 target) -> evaluation. Step counts are fixed (not time-based), all seeds are fixed, so
the same interpreter (stdlib version) and torch build give the same pair. Writes
``target/``, ``draft/``, ``target_loss.csv``, ``draft_loss.csv`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from .data import WindowSampler, build_corpus, concat_stream, fixed_windows, pick_questions
from .distill import distill, draft_config_for, load_target
from .evaluate import SAMPLE_QUESTIONS, evaluate_pair
from .tokenizer import ENDOFTEXT, IM_END, copy_tokenizer_files, save_tokenizer_files, train_bpe
from .train import (
    count_parameters,
    init_model,
    lm_loss,
    run_training,
    save_checkpoint,
    target_config,
)

# Computed here rather than imported from the package: when ``specserve`` resolves as a namespace
# package (repository root on sys.path), ``specserve.draft_models.__init__`` is never executed.
DEMO_DIR = Path(__file__).resolve().parent / "demo"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Rebuild the bundled demo target/draft pair.")
    p.add_argument("--out", default=str(DEMO_DIR))
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--target-layers", type=int, default=10)
    p.add_argument("--target-intermediate", type=int, default=1024)
    p.add_argument("--target-steps", type=int, default=450)
    p.add_argument("--target-lr", type=float, default=2.5e-3)
    p.add_argument("--draft-steps", type=int, default=300)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--chat-weight", type=float, default=0.6,
                   help="share of each batch drawn from chat documents (the rest is code)")
    p.add_argument("--val-windows", type=int, default=32, help="per stream (chat, code)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    # One thread by default: on the shared 2-core machine (other jobs at normal priority, this one
    # niced), two OpenMP threads measured ~4x slower per step than one, waiting at barriers for
    # whichever thread was preempted (14.0 vs 3.4 s per target step).
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fp32", action="store_true", help="train without bf16 autocast")
    return p.parse_args(argv)


def log(msg: str, start: float) -> None:
    print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.time()
    out = Path(args.out)
    target_dir, draft_dir = out / "target", out / "draft"
    timings: dict[str, float] = {}

    corpus = build_corpus(seed=args.seed)
    log(f"corpus {corpus.summary()}", start)
    tok = train_bpe(corpus.train_code + corpus.train_chat, vocab_size=args.vocab_size)
    save_tokenizer_files(tok, target_dir)
    eos_id, pad_id = tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)

    def stream(docs: list[str]) -> torch.Tensor:
        return concat_stream([e.ids for e in tok.encode_batch(docs)])

    train_chat, train_code = stream(corpus.train_chat), stream(corpus.train_code)
    val_sets = {"chat": fixed_windows(stream(corpus.val_chat), args.seq_len, args.val_windows),
                "code": fixed_windows(stream(corpus.val_code), args.seq_len, args.val_windows)}
    timings["data_and_tokenizer_s"] = time.time() - start
    log(f"tokens: train chat {train_chat.numel()}, train code {train_code.numel()}", start)

    weights = [args.chat_weight, 1.0 - args.chat_weight]
    t0 = time.time()
    config = target_config(tok.get_vocab_size(), eos_id, pad_id, args.target_layers,
                           args.target_intermediate)
    target = init_model(config, args.seed)
    log(f"target parameters {count_parameters(target)}", start)
    batches = WindowSampler([train_chat, train_code], weights, args.seq_len, args.batch_size,
                            seed=args.seed)
    target_summary = run_training(target, lm_loss(target), batches, args.target_steps,
                                  args.target_lr, warmup=min(100, args.target_steps // 10 + 1),
                                  log_path=out / "target_loss.csv", bf16=not args.fp32,
                                  desc="target")
    target_summary["parameters"] = count_parameters(target)
    save_checkpoint(target, target_dir, eos_token_id=eos_id, pad_token_id=pad_id)
    timings["target_s"] = time.time() - t0
    log(f"target done {target_summary}", start)
    del target

    t0 = time.time()
    # Distil toward the shipped bf16 weights, so the draft imitates exactly what users run.
    teacher = load_target(target_dir)
    batches = WindowSampler([train_chat, train_code], weights, args.seq_len, args.batch_size,
                            seed=args.seed + 1)
    draft, draft_summary = distill(teacher, draft_config_for(teacher.config), batches,
                                   args.draft_steps, lr=args.draft_lr,
                                   warmup=min(50, args.draft_steps // 10 + 1),
                                   kl_weight=args.kl_weight, seed=args.seed,
                                   log_path=out / "draft_loss.csv", bf16=not args.fp32)
    save_checkpoint(draft, draft_dir, eos_token_id=eos_id, pad_token_id=pad_id)
    copy_tokenizer_files(target_dir, draft_dir)
    timings["draft_s"] = time.time() - t0
    log(f"draft done {draft_summary}", start)
    del teacher, draft

    t0 = time.time()
    questions = pick_questions(corpus.val_questions, args.num_prompts, seed=args.seed)
    evaluation = evaluate_pair(target_dir, draft_dir, questions,
                               [*SAMPLE_QUESTIONS, questions[0]], val_sets=val_sets)
    timings["evaluate_s"] = time.time() - t0
    timings["total_s"] = time.time() - start

    results = {
        "settings": vars(args),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "threads": args.threads},
        "corpus": corpus.summary(),
        "tokens": {"train_chat": train_chat.numel(), "train_code": train_code.numel()},
        "held_out_modules": corpus.val_modules,
        "prompts": questions,
        "target": target_summary,
        "draft": draft_summary,
        "evaluation": evaluation,
        "timings": timings,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    log(f"evaluation {json.dumps(evaluation, indent=2)}", start)
    log(f"done in {timings['total_s'] / 60:.1f} min", start)
    return results


if __name__ == "__main__":
    main()
