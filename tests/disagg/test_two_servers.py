"""`specserve serve --role prefill` and `--role decode --prefill-url` as two plain processes on
loopback: replies equal a colocated engine's, `response.done` carries `kv_transfer_ms`, and
once the prefill server is gone a request fails at once with an error naming the cause."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from specserve.client import Client, SpecserveError
from specserve.distributed import free_port

pytestmark = [pytest.mark.timeout(170), pytest.mark.slow]

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. " * 6]


def _serve(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as err:  # a file, not a pipe: a chatty server can never block on it
        return subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--log-level",
                                 "warning", *args], stdout=subprocess.DEVNULL, stderr=err)


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path, deadline: float) -> None:
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"server on {port} not healthy: {log.read_text()}"
        time.sleep(0.3)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_prefill_and_decode_servers(tiny_target, tiny_draft, tmp_path):
    models = ["--target", str(tiny_target), "--draft", str(tiny_draft), "--speculation",
              "chain:3"]
    p_port, d_port = free_port(), free_port()
    token = ["--kv-token", "s3cret"]  # both sides: every pull proves the shared secret
    prefill = _serve([*models, *token, "--role", "prefill", "--port", str(p_port)],
                     tmp_path / "prefill.log")
    decode = _serve([*models, *token, "--role", "decode", "--port", str(d_port),
                     "--prefill-url", f"http://127.0.0.1:{p_port}"], tmp_path / "decode.log")
    try:
        reference = LLM(tiny_target, tiny_draft, speculation="chain:3")
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        expected = [o.text for o in reference.generate(PROMPTS, params)]
        deadline = time.monotonic() + 120
        _wait_healthy(prefill, p_port, tmp_path / "prefill.log", deadline)
        _wait_healthy(decode, d_port, tmp_path / "decode.log", deadline)
        with Client(f"ws://127.0.0.1:{d_port}", timeout=60) as client:
            results = [client.complete(p, temperature=0, max_output_tokens=12,
                                       ignore_eos=True).result() for p in PROMPTS]
            assert [r.text for r in results] == expected
            assert all(r.reason == "max_output_tokens" and r.metrics["kv_transfer_ms"] > 0
                       for r in results)

            _stop(prefill)
            start = time.monotonic()
            with pytest.raises(SpecserveError, match="no prefill server answered"):
                client.complete(PROMPTS[0], max_output_tokens=4).result()
            assert time.monotonic() - start < 15
    finally:
        _stop(prefill)
        _stop(decode)
