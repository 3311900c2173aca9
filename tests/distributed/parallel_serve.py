"""What the `--tp` and `--pp` serve tests share: a server with one spawned worker, checked and
then made to lose that worker, and a generate under torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from specserve.distributed import free_port

PROMPT = "def add(a, b):"


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def serve_then_kill_the_worker(target: Path, flags: list[str]) -> tuple[str, int, float, str]:
    """`specserve serve --target target *flags`: waits until healthy, completes PROMPT (5
    greedy tokens), SIGKILLs the one worker process it spawned. -> (the completion's text, the
    server's exit code, seconds from the kill to the exit, its stderr)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "specserve", "serve", "--target", str(target), *flags,
         "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if get(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.5)
        body = json.dumps({"model": "target", "prompt": PROMPT, "max_tokens": 5,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert resp.status == 200
            text = json.loads(resp.read())["choices"][0]["text"]
        workers = [c for c in children(server.pid)
                   if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        code = server.wait(timeout=30)
        return text, code, time.monotonic() - start, server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def torchrun_generate(target: Path, flags: list[str]) -> subprocess.CompletedProcess:
    """`specserve generate --raw` of PROMPT (8 tokens) on two torchrun ranks, one machine."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "specserve", "generate", "--raw", "--target", str(target), *flags,
         "--prompt", PROMPT, "--max-tokens", "8"],
        capture_output=True, text=True, timeout=240)
