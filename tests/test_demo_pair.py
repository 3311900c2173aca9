"""Tests of the bundled demo pair in ``draft_models/demo/`` and of its tokenizer files.

The checkpoint tests skip (with the reason) until ``python -m draft_models.recipe`` has written
both folders; ``SPECSERVE_DEMO_DIR`` points them at another output folder of the recipe. The
tokenizer-file test trains a tiny BPE on the fly, so it always runs.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from specserve.draft_models.evaluate import acceptance_length, chat_prompt_ids, greedy_generate
from specserve.draft_models.recipe import DEMO_DIR
from specserve.draft_models.tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOKENIZER_FILES,
    render_chat,
    save_tokenizer_files,
    train_bpe,
)

DEMO = Path(os.environ.get("SPECSERVE_DEMO_DIR", DEMO_DIR))
TARGET, DRAFT = DEMO / "target", DEMO / "draft"

requires_demo = pytest.mark.skipif(
    not ((TARGET / "model.safetensors").is_file() and (DRAFT / "model.safetensors").is_file()),
    reason=f"demo pair not built yet: run `python -m draft_models.recipe` (looked in {DEMO})",
)

# Code (indentation, tabs), unicode (accents, CJK, emoji, a lone combining mark), chat markup.
SAMPLE_TEXTS = [
    "def wrap(text, width=70, **kwargs):\n    \"\"\"Wrap text.\"\"\"\n\treturn [text]  # ok\n",
    "héllo wörld, naïve café; 日本語のテキスト 😀👍🏽 e\u0301 — “quotes” ¿qué?",
    render_chat([{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "What does `json.dumps` do?"},
                 {"role": "assistant", "content": "It serializes `obj` to a JSON str."}],
                add_generation_prompt=True),
    "   leading spaces and trailing   \n\n\n",
    f"{ENDOFTEXT}{IM_START}user\n{IM_END}",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is `textwrap.wrap`?"},
    {"role": "assistant", "content": "It wraps a paragraph.\nSee `textwrap.fill`."},
    {"role": "user", "content": "Thanks! 👍"},
]
EXPECTED_CHATML = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWhat is `textwrap.wrap`?<|im_end|>\n"
    "<|im_start|>assistant\nIt wraps a paragraph.\nSee `textwrap.fill`.<|im_end|>\n"
    "<|im_start|>user\nThanks! 👍<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _assert_auto_matches_raw(folder: Path) -> None:
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    for text in SAMPLE_TEXTS:
        expected = raw.encode(text).ids
        # The default call must not add a BOS or rebuild a family-specific pre-tokenizer.
        assert auto(text)["input_ids"] == expected, text
        assert auto.encode(text, add_special_tokens=False) == expected, text
        assert auto.decode(expected) == text


def test_saved_tokenizer_loads_as_written_next_to_a_llama_config(tmp_path: Path) -> None:
    """The pitfall: a llama config.json must not make AutoTokenizer re-interpret tokenizer.json."""
    tok = train_bpe(SAMPLE_TEXTS * 20 + ["def f(x):\n    return x\n"] * 50, vocab_size=400)
    save_tokenizer_files(tok, tmp_path)
    LlamaConfig(vocab_size=400, hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                intermediate_size=64).save_pretrained(tmp_path)
    assert [tok.token_to_id(s) for s in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    _assert_auto_matches_raw(tmp_path)


@requires_demo
def test_checkpoints_are_bf16_llama_with_the_required_shapes() -> None:
    target = json.loads((TARGET / "config.json").read_text())
    draft = json.loads((DRAFT / "config.json").read_text())
    for cfg in (target, draft):
        assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
        assert cfg["vocab_size"] == 8192
    assert (target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"],
            target["head_dim"]) == (256, 4, 2, 64)
    counts = {}
    for name, folder in (("target", TARGET), ("draft", DRAFT)):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
            counts[name] = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        assert dtypes == {"BF16"}, (name, dtypes)
    assert 10_000_000 <= counts["target"] <= 14_000_000
    assert counts["draft"] * 8 <= counts["target"]
    total = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    assert total <= 60 * 2**20


@requires_demo
def test_target_and_draft_ship_identical_tokenizer_files() -> None:
    names = [n for n in TOKENIZER_FILES if (TARGET / n).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(names)
    assert names == [n for n in TOKENIZER_FILES if (DRAFT / n).is_file()]
    for name in names:
        assert (TARGET / name).read_bytes() == (DRAFT / name).read_bytes(), name


@requires_demo
@pytest.mark.parametrize("folder", [TARGET, DRAFT], ids=["target", "draft"])
def test_autotokenizer_encodes_like_the_tokenizers_file(folder: Path) -> None:
    _assert_auto_matches_raw(folder)


@requires_demo
def test_chat_template_round_trips_a_conversation() -> None:
    tok = AutoTokenizer.from_pretrained(str(TARGET), local_files_only=True)
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED_CHATML == render_chat(CONVERSATION, add_generation_prompt=True)
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED_CHATML.removesuffix(
        "<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    # Each marker is one special token, not a spelling of it in byte pieces.
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 5
    assert ids.count(tok.convert_tokens_to_ids(IM_END)) == 4
    assert tok.eos_token == IM_END


@pytest.fixture(scope="module")
def demo_models():
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype="auto", local_files_only=True)
    draft = AutoModelForCausalLM.from_pretrained(str(DRAFT), dtype="auto", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(TARGET), local_files_only=True)
    return target.eval(), draft.eval(), tok


@requires_demo
def test_models_load_in_bf16_and_stop_on_im_end(demo_models) -> None:
    target, draft, tok = demo_models
    im_end = tok.convert_tokens_to_ids(IM_END)
    for model in (target, draft):
        assert next(model.parameters()).dtype == torch.bfloat16  # the files' dtype, unconverted
        assert model.generation_config.eos_token_id == im_end
        assert model.generation_config.bos_token_id is None


@requires_demo
def test_target_gives_a_coherent_greedy_chat_reply(demo_models) -> None:
    target, _, tok = demo_models
    max_new = 48
    prompt = chat_prompt_ids(tok, "What are the parameters of `textwrap.wrap`?")
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    reply = out[0, len(prompt):].tolist()
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert reply and (reply[-1] == im_end or len(reply) == max_new)
    assert im_end not in reply[:-1]  # generate stops at the first end of turn
    assert IM_START not in tok.decode(reply)  # the reply does not open a new turn itself
    text = tok.decode(reply, skip_special_tokens=True)
    words = [w for w in text.split() if any(c.isalpha() for c in w)]
    assert len(words) >= 3, text
    # The demo target is tiny: it gets names wrong, but it has learned the answer format that
    # the training data uses for this kind of question (a random or broken model has not).
    assert text.startswith("The signature is `"), text


@requires_demo
def test_draft_agrees_with_target_far_more_than_an_untrained_draft(demo_models) -> None:
    target, draft, tok = demo_models
    # fp32 copies (bf16 -> fp32 is exact); .float() alone would convert the shared fixture.
    target, draft = copy.deepcopy(target).float(), copy.deepcopy(draft).float()
    torch.manual_seed(0)
    untrained = type(draft)(draft.config).eval()
    prompts = [chat_prompt_ids(tok, q) for q in ("What does `json.dumps` do?",
                                                 "Where is `dedent` defined?",
                                                 "Which public methods does `queue.Queue` have?")]
    eos = target.generation_config.eos_token_id
    outputs = [greedy_generate(target, p, 32, eos) for p in prompts]
    distilled = acceptance_length(outputs, prompts, draft, k=4).acceptance_length
    baseline = acceptance_length(outputs, prompts, untrained, k=4).acceptance_length
    # An untrained tied-embedding model mostly repeats its last token, which matches only a
    # degenerate (repeating) target; the distilled draft must follow real replies.
    assert distilled >= 2.0 and distilled >= baseline + 0.8, (distilled, baseline)


@requires_demo
def test_our_loader_and_transformers_give_the_same_greedy_replies() -> None:
    """The shipped pair through specserve (with and without speculation) and transformers."""
    from specserve import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(TARGET), local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32,
                                              local_files_only=True).eval()
    questions = ["What does `os.path.join` do?", "How do I use `json.dumps`?",
                 "What are the parameters of `textwrap.wrap`?"]
    prompts = [chat_prompt_ids(tok, q) for q in questions]
    want = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        want.append(out[0, len(ids):].tolist())
    llm = LLM(TARGET, DRAFT, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=40)
    for mode in ("off", "tree", "chain:4"):
        got = [o.token_ids for o in llm.generate(prompts, params, speculation=mode)]
        assert got == want, mode
    llm.engine.block_manager.check_no_leak()
