"""bench/serve.py against a real server (tiny model, `chain:3`), over WebSocket and OpenAI SSE."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.serve import RequestRecord, main, parse_goodput, percentile, run
from specserve.cli import main as specserve_main

N, MAX_TOKENS = 6, 8


def bench(server, tmp_path: Path, *extra: str) -> dict:
    argv = ["--url", server.ws, "--no-progress", "--warmup", "0", "--ignore-eos",
            "--max-tokens", str(MAX_TOKENS), *extra]
    return asyncio.run(asyncio.wait_for(main(argv), 60))


def check_stats(stats: dict) -> None:
    assert stats["median"] <= stats["p90"] <= stats["p99"]
    assert stats["mean"] > 0 and stats["median"] > 0


def check_run(run: dict, n: int, backend: str) -> None:
    s, requests = run["summary"], run["requests"]
    assert s["backend"] == backend
    assert (s["completed"], s["failed"], len(requests)) == (n, 0, n)
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in requests) == MAX_TOKENS * n
    assert s["duration_s"] > 0 and s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["goodput"] is None or 0 <= s["goodput"] <= s["request_throughput"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        check_stats(s[name])
    for r in requests:
        assert r["ok"] and r["error"] is None and r["input_tokens"] > 0
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] > 0
        assert r["chunk_times_s"] == sorted(r["chunk_times_s"])


def test_websocket_run(server, tmp_path):
    out = tmp_path / "ws.json"
    result = bench(server, tmp_path, "--num-requests", str(N), "--concurrency", "2",
                   "--goodput", "ttft_ms=10000,tpot_ms=10000", "--result-json", str(out))
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["config"]["concurrency"] == 2 and len(result["runs"]) == 1
    run_ = result["runs"][0]
    check_run(run_, N, "ws")
    s = run_["summary"]
    assert s["itl_basis"] == "token" and s["goodput"] == pytest.approx(s["request_throughput"])
    # The self-draft accepts every token: deltas carry several tokens, their counts add up.
    assert s["acceptance_length"]["mean"] > 1
    for r in run_["requests"]:
        assert sum(r["chunk_tokens"]) == MAX_TOKENS and len(r["chunk_tokens"]) < MAX_TOKENS


def test_openai_sse_run(server, tmp_path):
    result = bench(server, tmp_path, "--backend", "openai", "--num-requests", str(N),
                   "--concurrency", "2", "--goodput", "e2e_ms=0.001")
    run_ = result["runs"][0]
    check_run(run_, N, "openai")
    s = run_["summary"]
    assert s["itl_basis"] == "chunk" and s["acceptance_length"] is None
    assert s["goodput"] == 0  # nobody answers in a microsecond


def test_poisson_arrivals(server, tmp_path):
    result = bench(server, tmp_path, "--request-rate", "50", "--num-requests", "4",
                   "--concurrency", "2", "--seed", "3")
    run_ = result["runs"][0]
    check_run(run_, 4, "ws")
    assert run_["summary"]["request_rate"] == 50 and run_["summary"]["goodput"] is None
    sent = [r["sent_at_s"] for r in run_["requests"]]
    assert sent == sorted(sent) and sent[-1] > 0


def test_sweep_writes_one_json_and_a_png(server, tmp_path):
    out = tmp_path / "sweep" / "runs.json"
    bench(server, tmp_path, "--sweep", "1,2", "--num-requests", "2", "--result-json", str(out))
    result = json.loads(out.read_text())
    assert [r["summary"]["concurrency"] for r in result["runs"]] == [1, 2]
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


@pytest.mark.parametrize("backend", ["ws", "openai"])
def test_refused_requests_count_as_failed(server, tmp_path, backend):
    chats = tmp_path / "chats.jsonl"
    ask = {"messages": [{"role": "user", "content": "What does `json.dumps` do?"}]}
    chats.write_text("\n".join(json.dumps(c) for c in [ask, ask | {"max_tokens": 10**6}, ask]))
    result = bench(server, tmp_path, "--backend", backend, "--prompts", str(chats),
                   "--num-requests", "3", "--concurrency", "2")
    s = result["runs"][0]["summary"]
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_output_tokens"] == 2 * MAX_TOKENS
    [(message, count)] = s["errors"].items()
    assert count == 1 and "max" in message  # the server names the field it refused
    [bad] = [r for r in result["runs"][0]["requests"] if not r["ok"]]
    assert bad["chat_index"] == 1 and bad["output_tokens"] == 0


def test_unreachable_server_is_one_line(capsys):
    assert run(["--url", "ws://127.0.0.1:9", "--no-progress"], prog="bench") == 1
    err = capsys.readouterr().err
    assert err.startswith("bench: cannot connect to ws://127.0.0.1:9/v1/ws")
    assert err.count("\n") == 1


def test_the_command_line_runs_a_benchmark(server, capsys):
    assert run(["--url", server.ws, "--num-requests", "2", "--max-tokens", "4", "--warmup", "0",
                "--no-progress"], prog="python -m bench.serve") == 0
    assert "Completed / failed requests       2 / 0" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        run(["--help"], prog="python -m bench.serve")
    assert exit_.value.code == 0 and "usage: python -m bench.serve" in capsys.readouterr().out


def test_the_installed_cli_has_no_bench_subcommand(capsys):
    # bench/ is not in the wheel: the installed program must not promise what it cannot load.
    with pytest.raises(SystemExit) as exit_:
        specserve_main(["bench", "--url", "ws://127.0.0.1:9"])
    assert exit_.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err


def test_itl_spreads_a_delta_over_its_tokens():
    record = RequestRecord(0, 0, ok=True, output_tokens=6)
    for t, n in ((0.1, 1), (0.4, 3), (0.6, 2)):
        record.add_chunk(t, n)
    record.e2e_s = 0.6
    assert record.itl_s() == pytest.approx([0.1] * 5)
    assert record.tpot_s == pytest.approx(0.1)  # (0.6 - 0.1) / 5: the mean ITL
    record.add_chunk(0.9, None)  # a chunk of unknown size: ITL falls back to per chunk
    assert record.itl_s() == pytest.approx([0.3, 0.2, 0.3])


def test_percentile_and_goodput_spec():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert parse_goodput("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500, "tpot_ms": 50}
    with pytest.raises(ValueError, match="ttft_ms"):
        parse_goodput("ttft=5")
