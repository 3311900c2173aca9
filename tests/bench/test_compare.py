"""bench.compare on tiny random models: equality check, row summaries, roofline arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.compare import (
    HF_ASSISTED,
    HF_GREEDY,
    OutputMismatch,
    Pair,
    PairResult,
    Row,
    Sample,
    check_outputs,
    compare_pair,
    format_pair,
    measure,
    pair_json,
)
from bench.roofline import roofline_fraction, weight_bytes

PROMPTS = [[1, 40, 41, 42, 43, 2, 1], [1, 50, 60, 70, 2, 1]]


def test_compare_pair_on_tiny_models(tiny_target: Path, tiny_draft: Path) -> None:
    result = compare_pair(Pair("tiny", tiny_target, tiny_draft), PROMPTS,
                          modes=("off", "chain:2", "tree:4"), max_tokens=8, rounds=1,
                          dtype="float32", ignore_eos=True, bandwidth=10e9)
    names = [r.name for r in result.rows]
    assert names == [HF_GREEDY, HF_ASSISTED, "specserve off", "specserve chain:2",
                     "specserve tree:4"]
    for row in result.rows:
        assert row.num_tokens == 2 * 8
        assert row.tokens_per_s > 0 and row.ms_per_token > 0 and row.ttft_ms > 0
        assert row.acceptance_length >= 1.0
        assert bool(row.stage_ms_per_token) == row.name.startswith("specserve")
    assert result.row(HF_GREEDY).acceptance_length == 1.0
    assert result.row("specserve off").acceptance_length == 1.0
    assert set(result.roofline) == {HF_GREEDY, "specserve off"}
    text = format_pair(result, max_tokens=8, rounds=1, ignore_eos=True)
    assert "identical token ids on all 2 prompts" in text and "specserve tree:4" in text
    json.dumps(pair_json(result))


def test_check_outputs_fails_loudly() -> None:
    check_outputs({"a": [[1, 2, 3], [4, 5]], "b": [[1, 2, 3], [4, 5]]})
    with pytest.raises(OutputMismatch) as info:
        check_outputs({"a": [[1, 2, 3], [4, 5]], "b": [[1, 2, 3], [4, 6]]})
    message = str(info.value)
    assert "prompt 1: 'b' differs from 'a' at token 1" in message
    assert "b 1/2" in message
    with pytest.raises(OutputMismatch, match="at token 2"):  # one output is a prefix of the other
        check_outputs({"a": [[1, 2, 3]], "b": [[1, 2]]})


def test_measure_checks_before_timing() -> None:
    calls = []

    def runner(offset: int):
        def run(prompt: list[int]) -> Sample:
            calls.append(offset)
            return Sample([t + offset for t in prompt], 0.01, 0.001, len(prompt))
        return run

    with pytest.raises(OutputMismatch, match="'bad' differs"):
        measure({"good": runner(0), "bad": runner(1)}, PROMPTS, rounds=3)
    assert len(calls) == 2 * len(PROMPTS)  # the warm-up pass only: nothing was timed


def _sample(n: int, e2e: float, ttft: float, forwards: int) -> Sample:
    return Sample(list(range(n)), e2e, ttft, forwards)


def test_row_summary_and_roofline_from_known_numbers() -> None:
    # Two rounds x two prompts of 11 and 21 tokens; the best round per prompt is used.
    row = Row("specserve off", [[_sample(11, 1.0, 0.1, 11), _sample(21, 3.0, 0.2, 21)],
                                [_sample(11, 2.0, 0.2, 11), _sample(21, 2.1, 0.1, 21)]])
    assert row.tokens_per_s == pytest.approx(32 / (1.0 + 2.1))
    assert row.round_tokens_per_s == pytest.approx([32 / 4.0, 32 / 4.1])
    assert row.ms_per_token == pytest.approx(1e3 * (0.9 + 2.0) / 30)
    assert row.ttft_ms == pytest.approx(100.0)
    assert row.acceptance_length == 1.0
    assert Row("chain", [[_sample(11, 1.0, 0.1, 5)]]).acceptance_length == pytest.approx(2.5)
    # Assisted generation: its first forward already verifies drafts, so every forward counts.
    assisted = Sample(list(range(12)), 1.0, 0.1, 4, prefill_forwards=0)
    assert Row("assisted", [[assisted]]).acceptance_length == pytest.approx(3.0)
    # The stage profile comes from each prompt's best round: 10 tokens in 1.0 s.
    fast = Sample([0] * 10, 1.0, 0.1, 10, {"draft": 0.1, "target_forward": 0.5,
                                          "verify": 0.0, "schedule": 0.0, "commit": 0.1})
    slow = Sample([0] * 10, 2.0, 0.1, 10, {"draft": 1.0, "target_forward": 0.5,
                                          "verify": 0.0, "schedule": 0.0, "commit": 0.1})
    stages = Row("spec", [[slow], [fast]]).stage_ms_per_token
    assert stages == pytest.approx({"draft": 10.0, "target_forward": 50.0, "verify": 0.0,
                                    "schedule": 0.0, "commit": 10.0, "other": 30.0})

    assert roofline_fraction(1e9, 0.1, 2e10) == pytest.approx(0.5)
    result = PairResult(Pair("p", Path("t"), Path("d")), 2, [row], target_weight_bytes=29_000_000,
                        num_params=0, bandwidth=20e9)
    # 29 MB per token at 96.67 ms/token = 0.3 GB/s of 20 GB/s.
    assert result.roofline["specserve off"] == pytest.approx(29e6 / (row.ms_per_token / 1e3) / 20e9)
    assert result.roofline["specserve off"] == pytest.approx(0.015)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_counts_the_head_once(tmp_path: Path, tied: bool) -> None:
    tensors = {"model.embed_tokens.weight": torch.zeros(10, 4),  # fp32: 160 bytes, rows of 16
               "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(10, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    # The LM head matrix in full (160), one embedding row for the gather (16), the layer (32).
    assert weight_bytes(tmp_path) == 160 + 16 + 32
    assert weight_bytes(tmp_path, torch.bfloat16) == 80 + 8 + 32
