"""bench/decode.py and bench/batching.py on tiny models: well-formed results, exact counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import batching, decode

TINY_QWEN2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # noqa: C408
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=400,
                  max_position_embeddings=256)


@pytest.fixture(autouse=True)
def _restore_globals():
    """The benchmarks set torch's thread count and turn off transformers' progress bars."""
    from transformers.utils import logging

    threads, bars = torch.get_num_threads(), logging.is_progress_bar_enabled()
    yield
    torch.set_num_threads(threads)
    if bars:
        logging.enable_progress_bar()


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Float32 with a wide init, so greedy choices are not near-ties and both sides agree."""
    folder = tmp_path_factory.mktemp("qwen2")
    return decode.save_random_qwen2(folder, std=0.08, dtype=torch.float32, **TINY_QWEN2)


def test_decode_specserve_vs_transformers(tiny_qwen2: Path) -> None:
    res = decode.run_decode(tiny_qwen2, prompt_tokens=8, new_tokens=10, repeats=2, threads=1,
                            dtype="float32", bandwidth_bytes=8 * 2**20)
    assert len(res.specserve_tok_s) == len(res.hf_tok_s) == 2
    assert all(x > 0 for x in res.specserve_tok_s + res.hf_tok_s)
    assert res.ids_equal and res.first_mismatch is None and res.matching_positions == 10
    assert res.ratio > 0 and res.read_bandwidth_bytes_s > 0
    # Tied embeddings: about every parameter once (the embedding matrix read by the LM head).
    params = sum(p.numel() for p in decode.load_hf(tiny_qwen2, torch.float32).parameters())
    assert abs(res.weight_bytes - 4 * params) <= 4 * TINY_QWEN2["hidden_size"]
    assert res.step_time_s["target_forward"] > 0
    assert "ratio specserve / transformers" in decode.format_result(res)
    json.dumps(res.to_json())


def test_decode_runs_count_every_token(tiny_qwen2: Path) -> None:
    from specserve import LLM

    llm = LLM(tiny_qwen2, speculation="off", dtype="float32", max_num_seqs=1, num_blocks=4)
    prompt = list(range(3, 11))
    ours = decode.specserve_run(llm, prompt, 6)
    theirs = decode.hf_run(decode.load_hf(tiny_qwen2, torch.float32), prompt, 6)
    for run in (ours, theirs):
        assert len(run.token_ids) == len(run.stamps) == 6
        assert run.stamps == sorted(run.stamps) and run.decode_tokens_per_s > 0
    assert ours.token_ids == theirs.token_ids
    assert llm.engine.block_manager.num_free_blocks == 4


def test_decode_cli_json(tiny_qwen2: Path, capsys) -> None:
    decode.main(["--model-dir", str(tiny_qwen2), "--prompt-tokens", "4", "--new-tokens", "4",
                 "--repeats", "1", "--threads", "1", "--dtype", "float32",
                 "--bandwidth-gib", "0.01", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 4 and out["ids_equal"]
    assert out["specserve_median_tok_s"] > 0 and out["hf_median_tok_s"] > 0


@pytest.mark.parametrize("draft", [False, True], ids=["off", "chain2"])
def test_batching_concurrent_equals_sequential(tiny_target: Path, draft: bool) -> None:
    from specserve import LLM

    llm = LLM(tiny_target, tiny_target if draft else None,
              speculation="chain:2" if draft else "off", max_num_seqs=3,
              enable_prefix_caching=False)
    rows = batching.run_batching(llm, (1, 3), max_tokens=5, repeats=2,
                                 prompts=batching.demo_prompts(3))
    assert [r.concurrency for r in rows] == [1, 3]
    for row in rows:
        n = row.concurrency
        for run in (row.sequential, row.concurrent):
            assert run.output_tokens == n * 5
            assert run.tokens_per_s > 0 and run.wall_s > 0
            assert 0 < run.schedule_us_per_step and 0 <= run.schedule_share < 1
        assert row.outputs_equal and row.differences == []
        assert row.speedup > 0
        if not draft:  # one token per request per step; all prompts fit in the first step
            assert row.sequential.num_steps == n * 5
            assert row.concurrent.num_steps == 5
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert "speedup" in batching.format_rows(rows)


def test_batching_cli_json(tiny_target: Path, capsys) -> None:
    batching.main(["--target", str(tiny_target), "--concurrency", "1", "2", "--max-tokens", "3",
                   "--threads", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in out["rows"]] == [1, 2]
    assert [r["concurrent"]["output_tokens"] for r in out["rows"]] == [3, 6]
    assert len(out["setup"]["prompt_lengths"]) == 2


def test_demo_prompts_mix_chat_and_code() -> None:
    prompts = batching.demo_prompts(8)
    assert len(prompts) == len(set(prompts)) == 8
    assert sum(p.startswith("# file: ") for p in prompts) == 2
    assert all(p.endswith("<|im_start|>assistant\n") for i, p in enumerate(prompts) if i % 4 != 3)


def test_beside_llamacpp_alternates_per_n_and_keeps_each_sides_best(monkeypatch) -> None:
    """Ours and llama.cpp's runs take turns, one N at a time, so a drift in the machine's speed
    falls on both sides of each ratio; per side the fastest round is kept."""
    calls = []
    rounds = {"ours": iter([10.0, 30.0, 20.0, 5.0]), "theirs": iter([7.0, 3.0, 1.0, 9.0])}

    def fake(side):
        def rates(*args):
            n = args[1][0]
            calls.append((side, n))
            return {n: {"decode_tok_s": next(rounds[side]), "prefill_tok_s": 1.0}}
        return rates

    monkeypatch.setattr(batching, "decode_rates", fake("ours"))
    monkeypatch.setattr(batching, "llamacpp_batched", fake("theirs"))
    ours, theirs = batching.rates_beside_llamacpp(None, Path("m.gguf"), (4, 16), repeats=2,
                                                  threads=2)
    assert calls == [("ours", 4), ("theirs", 4), ("ours", 4), ("theirs", 4),
                     ("ours", 16), ("theirs", 16), ("ours", 16), ("theirs", 16)]
    assert {n: r["decode_tok_s"] for n, r in ours.items()} == {4: 30.0, 16: 20.0}
    assert {n: r["decode_tok_s"] for n, r in theirs.items()} == {4: 7.0, 16: 9.0}


def test_beside_llamacpp_without_the_peer_keeps_ours(monkeypatch) -> None:
    monkeypatch.setattr(batching, "decode_rates",
                        lambda llm, ns, repeats: {ns[0]: {"decode_tok_s": 2.0,
                                                          "prefill_tok_s": 1.0}})
    monkeypatch.setattr(batching, "llamacpp_batched", lambda gguf, ns, threads: {})
    ours, theirs = batching.rates_beside_llamacpp(None, Path("m.gguf"), (1, 4), 1, 2)
    assert sorted(ours) == [1, 4] and theirs == {}
    assert "| 4 | 2.0 | - | - |" in batching.format_beside(ours, theirs)
