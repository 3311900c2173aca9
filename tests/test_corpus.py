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


class SelfWritingLLM(StandInLLM):
    """The stand-in above, which also writes user messages: the candidate written with seed s
    is WRITTEN[s % len(WRITTEN)], finished unless it is the one marked unfinished."""

    WRITTEN = ["How do I bake bread at home?", "Tell me about the sky at night.", "Hi",
               "What is a good name for a cat?", "UNFINISHED", "Plan a trip to Rome for me.",
               "What is a good name for a cat?", "Explain how tides work."]

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        super().__init__()
        self.tokenizer = AutoTokenizer.from_pretrained(DRAFT)
        self.written = []

    def generate(self, prompts, params):
        outs = []
        for prompt, p in zip(prompts, params):
            text = self.WRITTEN[p.seed % len(self.WRITTEN)]
            self.written.append((self.tokenizer.decode(prompt), p))
            outs.append(RequestOutput("w", list(prompt), [5], text,
                                      "length" if text == "UNFINISHED" else "stop"))
        return outs


DRAFT = Path(corpus.__file__).parent / "smollm2" / "draft"


def test_a_shard_is_the_same_whatever_the_kv_cache_keeps(monkeypatch, tiny_target):
    """The engine writes a shard with its KV cache large enough to keep the first turns for
    their follow-ups (KV_CACHE_MIB): the follow-ups then reuse the cached prefixes, and the
    records are those a cache that evicts them writes."""
    from specserve import LLM

    monkeypatch.setattr(corpus, "FIRST_TURNS", 6)
    monkeypatch.setattr(corpus, "FOLLOW_UPS", 3)
    shards, hits = [], []
    for num_blocks in (40, 4096):  # 40 blocks of 16 tokens hold about three chats
        llm = LLM(tiny_target, None, speculation="off", max_num_seqs=2, num_blocks=num_blocks)
        records, _ = corpus.generate_shard(llm, 0, max_new_tokens=32)
        shards.append(records)
        hits.append(llm.engine.block_manager.prefix_hits)
    assert [r.turn for r in shards[0]] == [1] * 6 + [2] * 3
    assert shards[0] == shards[1]
    assert hits[1] > hits[0]  # the kept first turns were reused


def test_self_written_messages_are_finished_distinct_and_never_held_out():
    from specserve.draft_models.self_messages import MESSAGE_TEMPERATURES, distinct_messages

    llm = SelfWritingLLM()
    kept = distinct_messages(llm, 4, first_seed=8, held_out_words=HELD_OUT_WORDS, batch=8)
    # "sky" is a held-out word, "Hi" too short, UNFINISHED did not end, the cat question repeats.
    assert kept == [(8, "How do I bake bread at home?"), (11, "What is a good name for a cat?"),
                    (13, "Plan a trip to Rome for me."), (15, "Explain how tides work.")]
    opening, params = llm.written[0]
    assert opening.endswith("<|im_end|>\n<|im_start|>user\n") and "system" in opening
    assert [p.temperature for _, p in llm.written[:3]] == [
        MESSAGE_TEMPERATURES[s % len(MESSAGE_TEMPERATURES)] for s in (8, 9, 10)]
    with pytest.raises(RuntimeError, match="acceptable distinct"):
        distinct_messages(llm, 6, first_seed=0, held_out_words=HELD_OUT_WORDS, batch=8)


def test_a_self_shard_continues_chats_with_messages_the_target_wrote(monkeypatch):
    monkeypatch.setattr(corpus, "FIRST_TURNS", 3)
    monkeypatch.setattr(corpus, "FOLLOW_UPS", 2)
    monkeypatch.setattr(corpus, "SELF_SEED_OFFSET", 0)
    monkeypatch.setattr(corpus, "sampling_for", lambda k, i: (0.0, i))
    llm = SelfWritingLLM()
    records, _ = corpus.generate_self_shard(llm, 0, max_new_tokens=50)
    first_chats, _ = llm.calls[0]
    assert [c[0]["content"] for c in first_chats] == [
        "How do I bake bread at home?", "What is a good name for a cat?",
        "Plan a trip to Rome for me."]
    # The second messages are written after each chat's first reply, with seeds 40000, 40001,
    # 40002 (WRITTEN 0, 1, 2): the bread chat goes on with WRITTEN[0]; the cat chat's candidate
    # names a held-out word and the Rome chat's is too short, so neither is continued.
    second_chats, _ = llm.calls[1]
    assert len(second_chats) == 1
    assert second_chats[0][1] == {"role": "assistant",
                                  "content": "How do I bake bread at home?"[::-1]}
    assert second_chats[0][2] == {"role": "user", "content": "How do I bake bread at home?"}
    assert "How do I bake bread at home?"[::-1] in llm.written[-3][0]
    assert [(r.turn, r.message) for r in records] == [(1, 0), (1, 1), (1, 2), (2, 0)]


def test_a_question_shard_begins_its_first_messages_with_question_starts(monkeypatch):
    from specserve.draft_models.self_messages import QUESTION_STARTS

    monkeypatch.setattr(corpus, "FIRST_TURNS", 3)
    monkeypatch.setattr(corpus, "FOLLOW_UPS", 1)
    monkeypatch.setattr(corpus, "sampling_for", lambda k, i: (0.0, i))
    llm = SelfWritingLLM()
    records, _ = corpus.generate_self_shard(llm, 0, max_new_tokens=50, questions=True)
    # Seeds run from ASK_SEED_OFFSET; the stand-in writes WRITTEN[seed % 8] after the start.
    seeds = range(corpus.ASK_SEED_OFFSET, corpus.ASK_SEED_OFFSET + 4)
    begun = [(QUESTION_STARTS[s % len(QUESTION_STARTS)], s) for s in seeds]
    for (opening, p), (start, seed) in zip(llm.written, begun):
        assert p.seed == seed and opening.endswith("<|im_start|>user\n" + start)
    # WRITTEN 0-3 after QUESTION_STARTS 16-19: the second names "sky", a held-out word.
    first_chats, _ = llm.calls[0]
    assert [c[0]["content"] for c in first_chats] == [
        "What's the difference betweenHow do I bake bread at home?", "Why isHi",
        "Is itWhat is a good name for a cat?"]
    # Second messages are written freely after the reply, as in a self shard.
    follow_opening, _ = llm.written[-2]
    assert follow_opening.endswith("<|im_start|>user\n")
    assert [r.turn for r in records].count(1) == 3


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
    # Self-written shards hold out their own last shards; one alone is trained on whole.
    write_shard(shard_path(tmp_path, 0, corpus.SELF), shard(10, [0.0, 0.7, 0.0, 0.0]), {})
    records, n_held = corpus_records(tmp_path, held_out_share=0.2)
    assert n_held == 2 and len(records) - n_held == 16
    write_shard(shard_path(tmp_path, 1, corpus.SELF), shard(11, [0.0, 0.7, 0.0, 0.0]), {})
    records, n_held = corpus_records(tmp_path, held_out_share=0.2)
    assert [r["prompt_ids"] for r in records[-n_held:]] == [[3], [3], [11], [11], [11]]
    assert [r["prompt_ids"] for r in records[:-n_held]].count([10]) == 4


def test_vocabulary_coverage_counts_reply_tokens_the_head_has():
    import torch

    records = [{"reply_ids": [1, 2, 3, 3]}, {"reply_ids": [9]}]
    assert vocabulary_coverage(torch.tensor([3, 9]), records) == pytest.approx(3 / 5)


@pytest.mark.parametrize("family", corpus.FAMILIES)
def test_committed_shards_read_back(family):
    """Whatever the corpus job has committed so far is readable and consistent."""
    shards = corpus.next_shard(corpus.CORPUS_DIR, family)
    assert shards > 0 or family != corpus.POOL
    for k in range(shards):
        records, meta = read_shard(shard_path(corpus.CORPUS_DIR, k, family))
        assert meta["shard"] == k and len(records) == meta["first_turns"] + meta["follow_ups"]
        assert sum(len(r.reply_ids) for r in records) == meta["reply_tokens"]
        assert Counter(r.turn for r in records) == {1: meta["first_turns"],
                                                    2: meta["follow_ups"]}
        assert all(np.all(np.array(r.prompt_ids) < 49152) for r in records)
