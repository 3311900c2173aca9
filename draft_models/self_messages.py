"""User messages written by the target itself, for the corpus's second family of chats.

The templated pool (`corpus_prompts`) varies subjects inside a few hundred phrasings, and a draft
trained on its replies stops improving on questions phrased otherwise (bench/HISTORY.md,
2026-12-06). A chat model asked to continue its own template where a user message begins writes
one (Magpie, Xu et al., 2024): requests for help, stories, maths, code, advice, in phrasings
nobody listed, drawn from what the model itself expects users to say. Sampled at several
temperatures, they widen the corpus's messages at no cost beyond a few dozen tokens each.

Begun with a question's first words (`QUESTION_STARTS`, one per seed), the same model writes the
short factual and how-to questions that chat users ask most ("How many feet are in a mile?",
"Give me a recipe for a vegan meal without dairy."): the kind of message whose replies the draft
is weakest on, where the target is least sure of itself (its mean top probability 0.59 on the
held-out chat questions' replies against 0.80 on the corpus's; bench/HISTORY.md, 2026-12-07).

A written message is kept when it ended by itself (the template's end of turn), is neither empty
nor a runaway, names none of `corpus_prompts.HELD_OUT_WORDS` (the evaluation questions stay
unseen) and was not written before in the same shard.
"""

from __future__ import annotations

from collections.abc import Sequence

MESSAGE_TEMPERATURES = (0.7, 0.85, 1.0)  # cycled over the candidates
MAX_MESSAGE_TOKENS = 128
MIN_MESSAGE_CHARS = 8
QUESTION_STARTS = (
    "What is", "How do I", "Why do", "Can you", "Explain", "Write a", "Give me", "Who was",
    "Describe", "Suggest", "What are some", "How does", "What should I", "How many", "Tell me",
    "Which", "What's the difference between", "How can I", "Why is", "Is it", "When did",
    "Where", "List", "Help me",
)
# Openings and temperatures are both cycled by seed, and 24 is a multiple of the 3 temperatures,
# so each opening is always written at the same temperature ("What is" at 0.7, "How do I" at
# 0.85, ...). Kept so: the committed question shards were written this way and a rerun of one
# must write it again.
_MARKER = "\x00message\x00"


def user_turn_opening(tokenizer, chat: Sequence[dict], start: str = "") -> list[int]:
    """Token ids of `chat` rendered with the model's template up to where the next user
    message's text begins (the system prompt and role header included), then `start`, the
    message's first words if given."""
    text = tokenizer.apply_chat_template(list(chat) + [{"role": "user", "content": _MARKER}],
                                         tokenize=False, add_generation_prompt=False)
    return tokenizer.encode(text[:text.index(_MARKER)] + start, add_special_tokens=False)


def acceptable(text: str, finished: bool, held_out_words: Sequence[str]) -> bool:
    lowered = text.lower()
    return (finished and len(text.strip()) >= MIN_MESSAGE_CHARS
            and not any(w.lower() in lowered for w in held_out_words))


def write_messages(llm, chats: Sequence[Sequence[dict]], seeds: Sequence[int],
                   held_out_words: Sequence[str],
                   starts: Sequence[str] = ("",)) -> list[str | None]:
    """For each chat, the next user message the target writes (sampled with its seed, at
    MESSAGE_TEMPERATURES cycled by seed, begun with `starts` cycled by seed), or None where it
    is not acceptable."""
    from specserve import SamplingParams

    begun = [starts[s % len(starts)] for s in seeds]
    openings = [user_turn_opening(llm.tokenizer, chat, start)
                for chat, start in zip(chats, begun)]
    params = [SamplingParams(temperature=MESSAGE_TEMPERATURES[s % len(MESSAGE_TEMPERATURES)],
                             top_p=1.0, max_tokens=MAX_MESSAGE_TOKENS, seed=s) for s in seeds]
    outs = llm.generate(openings, params)
    texts = [start + o.text for start, o in zip(begun, outs)]
    return [text.strip() if acceptable(text, o.finish_reason == "stop", held_out_words)
            else None for text, o in zip(texts, outs)]


def distinct_messages(llm, count: int, first_seed: int, held_out_words: Sequence[str],
                      batch: int | None = None,
                      starts: Sequence[str] = ("",)) -> list[tuple[int, str]]:
    """`count` distinct first-turn messages as (seed, text), written from an empty chat (begun
    with `starts` cycled by seed) with seeds first_seed, first_seed + 1, ... until enough are
    kept: the first acceptable ones in seed order, so the same list on a rerun whatever the
    batch (by default half as many again as wanted, written together: about one in nine is not
    kept, 31 of shard 0's first 288)."""
    batch = batch or count + count // 2
    kept: dict[str, int] = {}
    seed = first_seed
    while len(kept) < count:
        seeds = list(range(seed, seed + batch))
        seed += batch
        texts = write_messages(llm, [[]] * batch, seeds, held_out_words, starts)
        for s, text in zip(seeds, texts):
            if text is not None and text not in kept and len(kept) < count:
                kept[text] = s
        if seed - first_seed > 20 * count + batch:
            raise RuntimeError(f"the model wrote only {len(kept)} acceptable distinct messages "
                               f"in {seed - first_seed} tries")
    return [(s, text) for text, s in kept.items()]
