"""`specserve serve --pp 2`: serves like pp=1, and exits with a clear error naming the stage
when one dies; under torchrun every rank runs the same command and only rank 0 prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parallel_serve import PROMPT, serve_then_kill_the_worker, torchrun_generate

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_serve_pp2_then_a_dead_stage_ends_the_server(tiny_target):
    from specserve import LLM, SamplingParams

    expected = LLM(tiny_target).generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=5))[0].text
    text, code, seconds, err = serve_then_kill_the_worker(tiny_target, ["--pp", "2"])
    assert text == expected
    assert code == 1 and seconds < 15
    assert "pipeline stage 1 (tp rank 0) worker rank 1" in err
    assert "exited with code -9" in err


def test_torchrun_stages_generate_like_pp1(tiny_target):
    """The multi-machine launch on one machine: two torchrun ranks, one stage each."""
    from specserve import LLM, SamplingParams

    expected = LLM(tiny_target).generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=8))[0].text
    out = torchrun_generate(tiny_target, ["--pp", "2", "--speculation", "ngram:2"])
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
