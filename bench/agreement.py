"""Greedy agreement with llama.cpp on the same GGUF file: for each held-out prompt, specserve's
greedy continuation beside llama-completion's, per activation format of the quantized products.

    python -m bench agreement --target FILE.gguf            # 16 prompts x 32 tokens
    python -m bench agreement --target FILE.gguf --acts q16,q8,fp32 --prompts 16 --max-tokens 32

Both engines read the file's own blocks, but their arithmetic differs: llama.cpp quantizes a
k-quant product's activations into 8-bit blocks (Q8_K), specserve into 16-bit ones by default
(`SPECSERVE_QUANT_ACT=q16`; `q8` takes 8-bit blocks, `fp32` keeps them exact), and the two sum
in different orders. Near-ties between the two most likely tokens then fall either way, and a
continuation that differs once goes its own way. So this counts, per prompt, the tokens the two
share from the start (specserve's tokens whose decoded text is a prefix of llama.cpp's), and how
many continuations are identical throughout; where the two part, how close our model found the
choice (a near-tie is a gap of hundredths of a nat). Prompts without a chat template in the file run
as plain text, as `bench default-model` runs them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.compare import chat_prompts
from bench.cpu_paths import PEER, llamacpp_prompt_text, peer_bin, run_peer
from bench.options import add_threads, log
from specserve import LLM, SamplingParams
from specserve.draft_models.chat_prompts import HELD_OUT_PROMPTS
from specserve.kernels.quant_cpu import ACTIVATIONS

TOP = 5  # log-probabilities listed per generated token, to find llama.cpp's choice where they part


def llamacpp_text(bin_dir: Path, target: Path, prompt_text: str, max_tokens: int,
                  threads: int) -> str:
    """llama-completion's greedy continuation of prompt_text (the prompt itself not echoed), up
    to max_tokens or the end of the reply."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt_text + "\n")  # -f strips one trailing newline
        f.flush()
        done = run_peer(
            [str(bin_dir / "llama-completion"), "-m", str(target), "-f", f.name, "-n",
             str(max_tokens), "-t", str(threads), "--temp", "0", "--top-k", "1", "-c", "1024",
             "-no-cnv", "--no-warmup", "--no-display-prompt"])
    return done.stdout.removesuffix("\n").removesuffix(" [end of text]")


def shared_tokens(tokenizer, ids: list[int], text: str) -> int:
    """How many of ids, from the first, decode to a prefix of text (special tokens, such as the
    end of the reply, decode to nothing, as llama-completion prints them)."""
    n = 0
    while n < len(ids) and text.startswith(visible(tokenizer, ids[:n + 1])):
        n += 1
    return n


def divergence_gap(tokenizer, ids: list[int], logprobs, text: str, shared: int) -> float | None:
    """Where ids leave text (at index `shared`), how much likelier our model found its own token
    than llama.cpp's next one: log p(ours) - log p(theirs) in nats, theirs found among the top
    tokens that logprobs lists there; None when it is not among them."""
    here = logprobs[shared]
    for token, logprob in here.top:
        if token != ids[shared] and text.startswith(visible(tokenizer, ids[:shared] + [token])):
            return here.logprob - logprob
    return None


def visible(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def same_text(tokenizer, ids: list[int], text: str) -> bool:
    """Whether ids say what text says (llama-completion ends its output with a newline)."""
    return visible(tokenizer, ids).rstrip() == text.rstrip()


def main(argv: list[str] | None = None, prog: str = "python -m bench.agreement") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="a GGUF file")
    parser.add_argument("--acts", default="q16,q8,fp32",
                        help=f"activation formats to compare ({', '.join(ACTIVATIONS)})")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--peer", type=Path, default=PEER, help="the llama.cpp peer script")
    add_threads(parser)
    args = parser.parse_args(argv)
    acts = args.acts.split(",")
    if unknown := set(acts) - set(ACTIVATIONS):
        parser.error(f"--acts: unknown {sorted(unknown)}; choose from {', '.join(ACTIVATIONS)}")
    if args.target.suffix != ".gguf" or not args.target.is_file():
        parser.error(f"--target {args.target}: not a GGUF file")
    if not 1 <= args.prompts <= len(HELD_OUT_PROMPTS):
        parser.error(f"--prompts must be 1..{len(HELD_OUT_PROMPTS)}")
    bin_dir = peer_bin(args.peer)
    if bin_dir is None:
        parser.error(f"llama.cpp is not built: {args.peer} build")
    import torch

    torch.set_num_threads(args.threads)
    questions = list(HELD_OUT_PROMPTS[:args.prompts])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=TOP)
    theirs: list[str] | None = None
    print(f"{args.target.name}: {len(questions)} held-out prompts x {args.max_tokens} greedy "
          f"tokens, beside llama-completion; {args.threads} threads")
    print("| activations | identical continuations | our tokens shared from the start | "
          "fewest in one | "
          "where they part, log p(ours) - log p(llama.cpp's), median / max (nats) |\n"
          "|---|---|---|---|---|")
    for act in acts:
        os.environ["SPECSERVE_QUANT_ACT"] = act  # read when the weights' row order is chosen
        llm = LLM(args.target, speculation="off", enable_prefix_caching=False)
        tok = llm.tokenizer
        if getattr(tok, "chat_template", None):
            prompts = chat_prompts(tok, questions)
        else:
            prompts = [tok.encode(q) for q in questions]
        if theirs is None:
            log("  llama-completion on each prompt")
            theirs = [llamacpp_text(bin_dir, args.target, text, args.max_tokens, args.threads)
                      for text in (llamacpp_prompt_text(tok, p) for p in prompts)]
        outs = llm.generate(prompts, params)
        ours = [out.token_ids for out in outs]
        shared = [shared_tokens(tok, ids, text) for ids, text in zip(ours, theirs)]
        same = sum(same_text(tok, ids, text) for ids, text in zip(ours, theirs))
        gaps = [divergence_gap(tok, out.token_ids, out.logprobs, text, s)
                for out, text, s in zip(outs, theirs, shared) if s < len(out.token_ids)]
        found = [g for g in gaps if g is not None]
        parted = (f"{statistics.median(found):.3f} / {max(found):.3f}" if found else "-") + (
            f" ({len(gaps) - len(found)} outside our top {TOP})" if len(found) < len(gaps)
            else "")
        total = sum(len(ids) for ids in ours)
        print(f"| {act} | {same}/{len(ours)} | {sum(shared)} of {total} "
              f"({100 * sum(shared) / total:.1f}%) | {min(shared)} | {parted} |", flush=True)
        del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
