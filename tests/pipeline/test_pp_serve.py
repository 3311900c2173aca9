"""`specserve serve --pp 2`: serves like pp=1, and exits with a clear error naming the stage
when one dies; under torchrun every rank runs the same command and only rank 0 prints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specserve.distributed import free_port
from tests.distributed.test_tp_serve import _children, _get

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_serve_pp2_then_a_dead_stage_ends_the_server(tiny_target):
    from specserve import LLM, SamplingParams

    expected = LLM(tiny_target).generate("def add(a, b):", SamplingParams(
        temperature=0, max_tokens=5))[0].text
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "specserve", "serve", "--target", str(tiny_target), "--pp", "2",
         "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if _get(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.5)
        body = json.dumps({"model": "target", "prompt": "def add(a, b):", "max_tokens": 5,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["choices"][0]["text"] == expected
        workers = [c for c in _children(server.pid)
                   if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        code = server.wait(timeout=30)
        assert time.monotonic() - start < 15
        err = server.stderr.read()
        assert code == 1
        assert "pipeline stage 1 (tp rank 0) worker rank 1" in err
        assert "exited with code -9" in err
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_torchrun_stages_generate_like_pp1(tiny_target):
    """The multi-machine launch on one machine: two torchrun ranks, one stage each."""
    from specserve import LLM, SamplingParams

    expected = LLM(tiny_target).generate("def add(a, b):", SamplingParams(
        temperature=0, max_tokens=8))[0].text
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "specserve", "generate", "--raw", "--target", str(tiny_target), "--pp", "2",
         "--speculation", "ngram:2", "--prompt", "def add(a, b):", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
