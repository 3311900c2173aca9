"""The default model's distillation corpus: its messages, its shards, and the records the draft
recipe trains on (the generation itself runs the engine, tested elsewhere; here a stand-in
writes the replies)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specserve.draft_models import corpus
from specserve.draft_models.chat_data import corpus_records, vocabulary_coverage
from specserve.draft_models.chat_prompts import HELD_OUT_PROMPTS
from specserve.draft_models.corpus import Record, read_shard, shard_path, write_shard
from specserve.draft_models.corpus_prompts import HELD_OUT_WORDS, message_pool
from specserve.outputs import RequestOutput


def test_pool_is_large_distinct_and_free_of_held_out_subjects():
    pool = message_pool()
    assert len(pool) >= 20_000 and len(set(pool)) == len(pool)
    assert not set(pool) & set(HELD_OUT_PROMPTS)
    lowered = [m.lower() for m in pool]
    assert not [(w, m) for w in HELD_OUT_WORDS for m in lowered if w.lower() in m]
    assert message_pool() == pool  # fixed order: shard k always holds the same messages


def test_any_prefix_of_the_pool_mixes_the_kinds():
    first = message_pool()[:2000]
    code = sum(any(f" {lang}" in m for lang in ("Python", "Rust", "Java", "Go", "SQL", "PHP"))
               and ("code" in m or "function" in m or " in " in m) for m in first)
    assert code < 0.3 * len(first)  # code questions are over 40% of the whole pool
    assert sum(m.startswith(("What is", "Split", "Convert", "How many")) for m in first) > 50


class StandInLLM:
    """Answers every chat with its last message reversed, as token ids of its characters."""

    def __init__(self) -> None:
        self.calls = []

    def chat(self, chats, params):
        self.calls.append((chats, params))
        outs = []
        for i, chat in enumerate(chats):
            text = chat[-1]["content"][::-1]
            outs.append(RequestOutput(str(i), [1, 2, 3], [ord(c) % 5000 for c in text], text,
                                      "stop" if i % 2 else "length"))
        return outs


def test_a_shard_holds_first_turns_follow_ups_and_fixed_sampling(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus, "FIRST_TURNS", 6)
    monkeypatch.setattr(corpus, "FOLLOW_UPS", 2)
    llm = StandInLLM()
    records, _ = corpus.generate_shard(llm, 3, max_new_tokens=50)
    assert [r.turn for r in records] == [1] * 6 + [2] * 2
    assert [r.message for r in records] == list(range(18, 24)) + [18, 19]
    first_chats, first_params = llm.calls[0]
    second_chats, second_params = llm.calls[1]
    pool = message_pool()
    assert [c[0]["content"] for c in first_chats] == list(pool[18:24])
    # A follow-up carries the first reply's text as the assistant turn.
    assert second_chats[0][1] == {"role": "assistant", "content": pool[18][::-1]}
    temps = [p.temperature for p in first_params + second_params]
    assert temps == [corpus.TEMPERATURES[i % len(corpus.TEMPERATURES)] for i in range(8)]
    assert len({p.seed for p in first_params + second_params}) == 8
    assert [r.finished for r in records[:2]] == [False, True]


def test_shards_round_trip_and_resume_where_they_stop(tmp_path):
    recs = [Record([1, 2, 3], [40000, 5, 2], 0.0, 7, 11, 1, True),
            Record([1, 2, 3, 9], [6], 0.85, 8, 11, 2, False)]
    write_shard(shard_path(tmp_path, 0), recs, {"shard": 0})
    write_shard(shard_path(tmp_path, 1), recs[:1], {"shard": 1})
    back, meta = read_shard(shard_path(tmp_path, 0))
    assert back == recs and meta == {"shard": 0}
    assert corpus.next_shard(tmp_path) == 2
    assert corpus.read_corpus(tmp_path) == recs + recs[:1]
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="uint16"):
        write_shard(shard_path(tmp_path, 2), [Record([1], [70000], 0.0, 0, 0, 1, True)], {})


def test_a_shard_past_the_pool_is_refused():
    last = len(message_pool()) // corpus.FIRST_TURNS
    corpus.shard_messages(last - 1)
    with pytest.raises(ValueError, match="pool"):
        corpus.shard_messages(last)


def test_recipe_records_hold_out_the_last_shards_greedy_replies(tmp_path: Path):
    def shard(k, temps):
        return [Record([k], [k, 100 + i], t, i, i, 1, True) for i, t in enumerate(temps)]

    for k in range(4):
        write_shard(shard_path(tmp_path, k), shard(k, [0.0, 0.7, 0.0, 1.0]), {})
    records, n_held = corpus_records(tmp_path, held_out_share=0.2)
    held = records[-n_held:]
    # 8 greedy replies in all: 20% is 1.6, so the last shard's 2 greedy ones are held out.
    assert n_held == 2 and [r["prompt_ids"] for r in held] == [[3], [3]]
    assert len(records) - n_held == 12  # shards 0-2 whole, greedy and sampled
    with pytest.raises(ValueError, match="at least 2"):
        corpus_records(tmp_path / "empty")


def test_vocabulary_coverage_counts_reply_tokens_the_head_has():
    import torch

    records = [{"reply_ids": [1, 2, 3, 3]}, {"reply_ids": [9]}]
    assert vocabulary_coverage(torch.tensor([3, 9]), records) == pytest.approx(3 / 5)


def test_committed_shards_read_back():
    """Whatever the corpus job has committed so far is readable and consistent."""
    shards = corpus.next_shard(corpus.CORPUS_DIR)
    for k in range(shards):
        records, meta = read_shard(shard_path(corpus.CORPUS_DIR, k))
        assert meta["shard"] == k and len(records) == meta["first_turns"] + meta["follow_ups"]
        assert sum(len(r.reply_ids) for r in records) == meta["reply_tokens"]
        assert Counter(r.turn for r in records) == {1: meta["first_turns"],
                                                    2: meta["follow_ups"]}
        assert all(np.all(np.array(r.prompt_ids) < 49152) for r in records)
