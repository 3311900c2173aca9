"""User messages written by the target itself, for the corpus's second family of chats.

The templated pool (`corpus_prompts`) varies subjects inside a few hundred phrasings, and a draft
trained on its replies stops improving on questions phrased otherwise (bench/HISTORY.md,
2026-12-06). A chat model asked to continue its own template where a user message begins writes
one (Magpie, Xu et al., 2024): requests for help, stories, maths, code, advice, in phrasings
nobody listed, drawn from what the model itself expects users to say. Sampled at several
temperatures, they widen the corpus's messages at no cost beyond a few dozen tokens each.

A written message is kept when it ended by itself (the template's end of turn), is neither empty
nor a runaway, names none of `corpus_prompts.HELD_OUT_WORDS` (the evaluation questions stay
unseen) and was not written before in the same shard.
"""

from __future__ import annotations

from collections.abc import Sequence

MESSAGE_TEMPERATURES = (0.7, 0.85, 1.0)  # cycled over the candidates
MAX_MESSAGE_TOKENS = 128
MIN_MESSAGE_CHARS = 8
_MARKER = "\x00message\x00"


def user_turn_opening(tokenizer, chat: Sequence[dict]) -> list[int]:
    """Token ids of `chat` rendered with the model's template up to where the next user
    message's text begins (the system prompt and role header included)."""
    text = tokenizer.apply_chat_template(list(chat) + [{"role": "user", "content": _MARKER}],
                                         tokenize=False, add_generation_prompt=False)
    return tokenizer.encode(text[:text.index(_MARKER)], add_special_tokens=False)


def acceptable(text: str, finished: bool, held_out_words: Sequence[str]) -> bool:
    lowered = text.lower()
    return (finished and len(text.strip()) >= MIN_MESSAGE_CHARS
            and not any(w.lower() in lowered for w in held_out_words))


def write_messages(llm, chats: Sequence[Sequence[dict]], seeds: Sequence[int],
                   held_out_words: Sequence[str]) -> list[str | None]:
    """For each chat, the next user message the target writes (sampled with its seed, at
    MESSAGE_TEMPERATURES cycled by seed), or None where it is not acceptable."""
    from specserve import SamplingParams

    openings = [user_turn_opening(llm.tokenizer, chat) for chat in chats]
    params = [SamplingParams(temperature=MESSAGE_TEMPERATURES[s % len(MESSAGE_TEMPERATURES)],
                             top_p=1.0, max_tokens=MAX_MESSAGE_TOKENS, seed=s) for s in seeds]
    outs = llm.generate(openings, params)
    return [o.text.strip() if acceptable(o.text, o.finish_reason == "stop", held_out_words)
            else None for o in outs]


def distinct_messages(llm, count: int, first_seed: int, held_out_words: Sequence[str],
                      batch: int | None = None) -> list[tuple[int, str]]:
    """`count` distinct first-turn messages as (seed, text), written from an empty chat with
    seeds first_seed, first_seed + 1, ... until enough are kept: the first acceptable ones in
    seed order, so the same list on a rerun whatever the batch (by default half as many again
    as wanted, written together: about one in nine is not kept, 31 of shard 0's first 288)."""
    batch = batch or count + count // 2
    kept: dict[str, int] = {}
    seed = first_seed
    while len(kept) < count:
        seeds = list(range(seed, seed + batch))
        seed += batch
        for s, text in zip(seeds, write_messages(llm, [[]] * batch, seeds, held_out_words)):
            if text is not None and text not in kept and len(kept) < count:
                kept[text] = s
        if seed - first_seed > 20 * count + batch:
            raise RuntimeError(f"the model wrote only {len(kept)} acceptable distinct messages "
                               f"in {seed - first_seed} tries")
    return [(s, text) for text, s in kept.items()]
