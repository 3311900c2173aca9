"""`specserve serve --tp 2`: serves like tp=1, and exits with a clear error when a worker dies."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parallel_serve import PROMPT, serve_then_kill_the_worker, torchrun_generate

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_serve_tp2_then_a_dead_worker_ends_the_server(tiny_target):
    text, code, seconds, err = serve_then_kill_the_worker(tiny_target, ["--tp", "2"])
    assert text
    assert code == 1 and seconds < 15
    assert "tensor-parallel worker rank 1" in err and "exited with code -9" in err


def test_torchrun_ranks_generate_like_tp1(tiny_target):
    """Under torchrun every rank runs the same command; rank 0 prints, rank 1 only computes."""
    from specserve import LLM, SamplingParams

    expected = LLM(tiny_target).generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=8))[0].text
    out = torchrun_generate(tiny_target, ["--tp", "2"])
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
