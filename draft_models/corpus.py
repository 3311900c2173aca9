"""The default model's distillation corpus: the target's own replies, in shards kept in git.

    nice -n 19 python -m draft_models.corpus generate --shards 40 --commit >> corpus.log 2>&1 &
    nice -n 19 python -m draft_models.corpus generate --family self --shards 40 --commit ...
    nice -n 19 python -m draft_models.corpus generate --family ask --max-new-tokens 192 ...
    python -m draft_models.corpus stats

Three families of shards. Pool shard k (`shard-NNNNN.npz`) holds `FIRST_TURNS` first-turn chats
(messages k * FIRST_TURNS ... of `corpus_prompts.message_pool()`) and `FOLLOW_UPS` two-turn chats
that continue the first of them with the target's own reply in context and a follow-up question.
Self shard k (`self-NNNNN.npz`) holds as many chats whose user messages, first and second, the
target wrote itself (`self_messages.py`): phrasings and subjects the templates do not have, a
record's `message` being its place in the shard. Question shard k (`ask-NNNNN.npz`) is made as a
self shard whose first messages the target begins with a question's first words
(`self_messages.QUESTION_STARTS`): the short factual and how-to questions chat users ask most.
Half the replies are greedy, the
rest sampled at temperature 0.7 / 0.85 / 1.0 (top_p 1, a fixed seed per record), so the draft
learns the target's distribution and not one path through it.

The replies are written by the specserve engine serving the default model as it is served (its
Q4_1 / Q8_0 blocks on the quantized kernels, speculation off, continuous batching): the labels
come from the function that the draft will be verified against. Measured on a 2-core first-
generation Zen (family 23 model 1): 70 tok/s in all at 32 concurrent chats, against 53 for the
dequantized float32 weights in the same engine and 50 for batched transformers generation (the
same 64 replies, token for token, in all three).

A shard is a compressed numpy file (token ids uint16): each record's prompt ids (the chat
template applied), reply ids (ending with EOS when the reply finished), temperature, seed,
message index and turn, and a `meta` JSON string (target file, settings, generation wall time
and tokens/s, CPU, niceness). It is written atomically and, with `--commit`, committed alone at
once, so an interrupted job loses at most the shard in progress and resumes from the repository
on any machine: the next shard of a family is the first one missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .corpus_prompts import HELD_OUT_WORDS, follow_up, message_pool

CORPUS_DIR = Path(__file__).resolve().parent / "smollm2" / "corpus"
FIRST_TURNS = 192  # first-turn chats per shard
FOLLOW_UPS = 64  # of those, continued with a second user turn
TEMPERATURES = (0.0, 0.7, 0.0, 0.85, 0.0, 1.0)  # cycled over a shard's records: half greedy
MAX_NEW_TOKENS = 384
CONCURRENT_CHATS = 32
# The generating engine's KV cache. A shard's chats (about 50k tokens of the default model, 46 KB
# of float32 KV a token) then stay cached from their first turns to their follow-ups, so that
# writing the second messages and answering them reuses the first turns' KV (prefix caching)
# instead of computing it again; in the engine's default 512 MiB the first chats, the ones
# continued, were evicted first. One question shard on SPR-480: 109 s -> 78 s, the same records.
KV_CACHE_MIB = 2048


@dataclass
class Record:
    prompt_ids: list[int]
    reply_ids: list[int]
    temperature: float
    seed: int
    message: int  # index into message_pool()
    turn: int  # 1: a first-turn chat; 2: its continuation
    finished: bool  # the reply ended (EOS) before max_new_tokens


# The families of shards: pool messages, self-written ones, self-written questions.
POOL, SELF, ASK = "shard", "self", "ask"
FAMILIES = (POOL, SELF, ASK)
# A written message's seeds, apart from the replies' (shard k's: k * 100_003 + i, i < 256) and
# from each other's: first messages from the offset on (at most 20 tries per message), second
# messages SELF_FOLLOW_UP_SEEDS past it.
SELF_SEED_OFFSET = 50_000
ASK_SEED_OFFSET = 55_000
SELF_FOLLOW_UP_SEEDS = 40_000


def shard_path(corpus: Path, k: int, family: str = POOL) -> Path:
    return corpus / f"{family}-{k:05d}.npz"


def next_shard(corpus: Path, family: str = POOL) -> int:
    """The first shard index of `family` with no file: shards are made in order, so this
    resumes."""
    k = 0
    while shard_path(corpus, k, family).is_file():
        k += 1
    return k


def shard_messages(k: int) -> range:
    """Pool indices of shard k's first-turn chats."""
    pool = len(message_pool())
    start = k * FIRST_TURNS
    if start + FIRST_TURNS > pool:
        raise ValueError(f"shard {k} would need messages up to {start + FIRST_TURNS}; the pool "
                         f"holds {pool}")
    return range(start, start + FIRST_TURNS)


def sampling_for(k: int, i: int) -> tuple[float, int]:
    """(temperature, seed) of record i of shard k: fixed, so a rerun writes the same shard."""
    return TEMPERATURES[i % len(TEMPERATURES)], k * 100_003 + i


def write_shard(path: Path, records: Sequence[Record], meta: dict) -> None:
    def ids(lists):  # concatenated uint16 ids and their lengths
        lengths = np.array([len(x) for x in lists], dtype=np.int32)
        flat = np.fromiter((t for x in lists for t in x), dtype=np.int64, count=int(lengths.sum()))
        if flat.size and (flat.min() < 0 or flat.max() >= 2**16):
            raise ValueError("token ids do not fit uint16")
        return flat.astype(np.uint16), lengths

    prompt_ids, prompt_lens = ids([r.prompt_ids for r in records])
    reply_ids, reply_lens = ids([r.reply_ids for r in records])
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f, prompt_ids=prompt_ids, prompt_lens=prompt_lens, reply_ids=reply_ids,
            reply_lens=reply_lens,
            temperature=np.array([r.temperature for r in records], dtype=np.float32),
            seed=np.array([r.seed for r in records], dtype=np.int64),
            message=np.array([r.message for r in records], dtype=np.int32),
            turn=np.array([r.turn for r in records], dtype=np.uint8),
            finished=np.array([r.finished for r in records], dtype=bool),
            meta=np.array(json.dumps(meta, sort_keys=True)))
    os.replace(tmp, path)


def read_shard(path: Path) -> tuple[list[Record], dict]:
    with np.load(path) as z:
        def split(flat, lens):
            ends = np.cumsum(lens)
            return [flat[e - n:e].astype(np.int64).tolist() for e, n in zip(ends, lens)]

        prompts = split(z["prompt_ids"], z["prompt_lens"])
        replies = split(z["reply_ids"], z["reply_lens"])
        # temperatures are stored as float32: rounded back to the settings they came from
        records = [Record(p, r, round(float(t), 4), int(s), int(m), int(u), bool(f))
                   for p, r, t, s, m, u, f in zip(prompts, replies, z["temperature"], z["seed"],
                                                  z["message"], z["turn"], z["finished"])]
        return records, json.loads(str(z["meta"]))


def read_corpus(corpus: Path = CORPUS_DIR, family: str = POOL) -> list[Record]:
    records: list[Record] = []
    for k in range(next_shard(corpus, family)):
        records += read_shard(shard_path(corpus, k, family))[0]
    return records


def cpu_description() -> str:
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name") and key not in fields:
                fields[key] = value.strip()
    except OSError:
        return platform.processor()
    return (f"{fields.get('model name', '?')} ({fields.get('vendor_id', '?')} family "
            f"{fields.get('cpu family', '?')} model {fields.get('model', '?')})")


def _two_turn_records(llm, k: int, first: list[list[dict]], messages: Sequence[int],
                      second_turns, max_new_tokens: int) -> list[Record]:
    """The replies to `first` (chats of one user message; `messages` their ids), then to the
    second turns: `second_turns(chats)` gets the first chats with their replies and returns
    (i, text) for the chats it continues, text being the next user message."""
    from specserve import SamplingParams

    def params(i: int) -> SamplingParams:
        temperature, seed = sampling_for(k, i)
        return SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_new_tokens,
                              seed=seed)

    outs = llm.chat(first, [params(i) for i in range(len(first))])
    records = [Record(o.prompt_token_ids, list(o.token_ids), *sampling_for(k, i), m, 1,
                      o.finish_reason == "stop") for i, (m, o) in enumerate(zip(messages, outs))]
    answered = [chat + [{"role": "assistant", "content": o.text}]
                for chat, o in zip(first, outs)]
    continued = second_turns(answered)
    second = [answered[i] + [{"role": "user", "content": text}] for i, text in continued]
    offset = len(first)
    outs2 = llm.chat(second, [params(offset + j) for j in range(len(second))])
    records += [Record(o.prompt_token_ids, list(o.token_ids), *sampling_for(k, offset + j),
                       messages[i], 2, o.finish_reason == "stop")
                for j, ((i, _), o) in enumerate(zip(continued, outs2))]
    return records


def generate_shard(llm, k: int, max_new_tokens: int) -> tuple[list[Record], float]:
    """Pool shard k's records and the seconds they took."""
    pool = message_pool()
    indices = list(shard_messages(k))
    start = time.time()
    first = [[{"role": "user", "content": pool[m]}] for m in indices]
    records = _two_turn_records(
        llm, k, first, indices,
        lambda chats: [(i, follow_up(indices[i])) for i in range(min(FOLLOW_UPS, len(chats)))],
        max_new_tokens)
    return records, time.time() - start


def generate_self_shard(llm, k: int, max_new_tokens: int,
                        questions: bool = False) -> tuple[list[Record], float]:
    """Self shard k's records and the seconds they took: FIRST_TURNS distinct messages the
    target wrote (self_messages.py; a record's `message` is its place in the shard), and up to
    FOLLOW_UPS of those chats continued with a second message it wrote after its own reply.
    With `questions`, question shard k's: the first messages begun with QUESTION_STARTS."""
    from .self_messages import QUESTION_STARTS, distinct_messages, write_messages

    start = time.time()
    seed = k * 100_003 + (ASK_SEED_OFFSET if questions else SELF_SEED_OFFSET)
    written = distinct_messages(llm, FIRST_TURNS, seed, HELD_OUT_WORDS,
                                starts=QUESTION_STARTS if questions else ("",))
    first = [[{"role": "user", "content": text}] for _, text in written]

    def second_turns(chats):
        tried = chats[:2 * FOLLOW_UPS]  # about one written message in nine is not kept
        seeds = [seed + SELF_FOLLOW_UP_SEEDS + i for i in range(len(tried))]
        texts = write_messages(llm, tried, seeds, HELD_OUT_WORDS)
        return [(i, t) for i, t in enumerate(texts) if t is not None][:FOLLOW_UPS]

    records = _two_turn_records(llm, k, first, list(range(len(first))), second_turns,
                                max_new_tokens)
    return records, time.time() - start


def commit(path: Path, message: str, attempts: int = 30) -> None:
    """Commit `path` alone (other staged work is left as it is); waits out another git
    command's index lock."""
    repo = path.parent
    for attempt in range(attempts):
        add = subprocess.run(["git", "add", "--", path.name], cwd=repo, capture_output=True,
                             text=True)
        done = add.returncode == 0 and subprocess.run(
            ["git", "commit", "--quiet", "-m", message, "--", path.name], cwd=repo,
            capture_output=True, text=True).returncode == 0
        if done:
            return
        time.sleep(2 + attempt)
    raise RuntimeError(f"could not commit {path}")


def generate(args: argparse.Namespace) -> None:
    import torch

    from specserve import LLM
    from specserve.named_models import default_target

    torch.set_num_threads(args.threads)
    corpus = Path(args.corpus)
    corpus.mkdir(parents=True, exist_ok=True)
    target = Path(args.target) if args.target else default_target()
    llm = LLM(target, None, speculation="off", max_num_seqs=args.concurrent,
              kv_cache_memory_bytes=args.kv_cache_mib * 2**20)
    family = args.family
    first = next_shard(corpus, family)
    for k in range(first, first + args.shards):
        if family == POOL:
            records, seconds = generate_shard(llm, k, args.max_new_tokens)
        else:
            records, seconds = generate_self_shard(llm, k, args.max_new_tokens,
                                                   questions=family == ASK)
        tokens = sum(len(r.reply_ids) for r in records)
        meta = {"target": target.name, "family": family, "shard": k,
                "first_turns": sum(r.turn == 1 for r in records),
                "follow_ups": sum(r.turn == 2 for r in records),
                "max_new_tokens": args.max_new_tokens,
                "concurrent_chats": args.concurrent, "kv_cache_mib": args.kv_cache_mib,
                "threads": args.threads,
                "reply_tokens": tokens, "seconds": round(seconds, 1),
                "tokens_per_second": round(tokens / seconds, 2), "cpu": cpu_description(),
                "niceness": os.nice(0), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        path = shard_path(corpus, k, family)
        write_shard(path, records, meta)
        print(f"{meta['date']} {family} shard {k}: {len(records)} records, {tokens} reply tokens "
              f"in {seconds:.0f} s ({tokens / seconds:.1f} tok/s)", flush=True)
        if args.commit:
            commit(path, f"draft_models/smollm2/corpus: {family} shard {k} ({tokens} reply tokens, "
                         f"{tokens / seconds:.1f} tok/s on {meta['cpu']}, nice {meta['niceness']})")


def family_stats(corpus: Path, family: str) -> dict:
    shards = next_shard(corpus, family)
    records, seconds, tokens, finished, messages = 0, 0.0, 0, 0, 0
    temps: dict[float, int] = {}
    for k in range(shards):
        recs, meta = read_shard(shard_path(corpus, k, family))
        records += len(recs)
        messages += sum(r.turn == 1 for r in recs)
        tokens += sum(len(r.reply_ids) for r in recs)
        seconds += meta["seconds"]
        finished += sum(r.finished for r in recs)
        for r in recs:
            t = round(r.temperature, 2)
            temps[t] = temps.get(t, 0) + 1
    size = sum(shard_path(corpus, k, family).stat().st_size for k in range(shards))
    return {"shards": shards, "records": records, "distinct_messages": messages,
            "reply_tokens": tokens, "generation_hours": round(seconds / 3600, 2),
            "tokens_per_second": round(tokens / seconds, 2) if seconds else None,
            "finished_replies": finished, "bytes": size,
            "records_by_temperature": {str(t): n for t, n in sorted(temps.items())}}


def stats(args: argparse.Namespace) -> dict:
    corpus = Path(args.corpus)
    out = {"pool_messages": family_stats(corpus, POOL),
           "self_written_messages": family_stats(corpus, SELF),
           "self_written_questions": family_stats(corpus, ASK)}
    print(json.dumps(out, indent=2))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write the next shards")
    g.add_argument("--shards", type=int, default=1, help="how many shards to add")
    g.add_argument("--target", help="target .gguf or folder (default: the default model)")
    g.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    g.add_argument("--concurrent", type=int, default=CONCURRENT_CHATS)
    g.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB,
                   help="the engine's KV cache (MiB): enough to keep a shard's chats")
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--commit", action="store_true", help="git-commit each shard once written")
    g.add_argument("--family", choices=FAMILIES, default=POOL,
                   help=f"{POOL!r}: the templated pool's messages; {SELF!r}: messages the "
                        f"target writes itself (self_messages.py); {ASK!r}: questions it "
                        "writes from a question's first words")
    s = sub.add_parser("stats", help="what the corpus holds")
    for q in (g, s):
        q.add_argument("--corpus", default=str(CORPUS_DIR))
    args = p.parse_args(argv)
    if args.command == "generate":
        for option in ("concurrent", "kv_cache_mib", "threads"):
            if getattr(args, option) < 1:
                p.error(f"--{option.replace('_', '-')} must be at least 1")
    (generate if args.command == "generate" else stats)(args)


if __name__ == "__main__":
    sys.exit(main())
