"""bench.agreement's counting: tokens shared from the start of two continuations; the
prompt text llama.cpp reads, its timing lines, and what a crash of its binaries reports."""

from __future__ import annotations

import pytest

from bench.agreement import divergence_gap, same_text, shared_tokens
from bench.cpu_paths import llamacpp_prompt_text, llamacpp_timing, run_peer


class Letters:
    """A tokenizer whose token i is the letter chr(ord('a') + i); token 25 is BOS ("<s>"), a
    special token."""

    bos_token_id = 25

    def decode(self, ids, skip_special_tokens=False):
        bos = "" if skip_special_tokens else "<s>"
        return "".join(bos if i == 25 else chr(ord("a") + i) for i in ids)


def test_shared_tokens_counts_the_common_start():
    tok = Letters()
    assert shared_tokens(tok, [0, 1, 2], "abc") == 3
    assert shared_tokens(tok, [0, 1, 2], "abd") == 2
    assert shared_tokens(tok, [0, 1, 2], "abcdef") == 3  # llama.cpp's text may run on
    assert shared_tokens(tok, [3, 1], "abc") == 0
    assert shared_tokens(tok, [], "abc") == 0
    assert shared_tokens(tok, [0, 1, 25], "ab") == 3  # the end of the reply prints nothing


def test_same_text_ignores_special_tokens_and_the_final_newline():
    tok = Letters()
    assert same_text(tok, [0, 1, 25], "ab\n")
    assert not same_text(tok, [0, 1], "abc")


def test_llamacpp_prompt_text_leaves_out_a_leading_bos_only():
    tok = Letters()
    assert [llamacpp_prompt_text(tok, p) for p in ([25, 0, 1], [0, 25, 1], [2])] == [
        "ab", "a<s>b", "c"]


def test_divergence_gap_finds_llamacpps_token_among_the_top():
    from specserve.outputs import TokenLogprob

    tok = Letters()
    logprobs = [TokenLogprob(0, -0.1, [(0, -0.1), (1, -2.3)]),
                TokenLogprob(1, -0.5, [(1, -0.5), (2, -0.6), (3, -1.0)])]
    assert divergence_gap(tok, [0, 1], logprobs, "ac", 1) == pytest.approx(0.1)
    assert divergence_gap(tok, [0, 1], logprobs, "ad", 1) == pytest.approx(0.5)
    assert divergence_gap(tok, [0, 1], logprobs, "ax", 1) is None


COMPLETION_LOG = """\
I common_perf_print:        load time =     320.57 ms
I common_perf_print: prompt eval time =     320.39 ms /     7 tokens (   45.77 ms per token, ...)
I common_perf_print:        eval time =    1679.42 ms /     7 runs   (  239.92 ms per token, ...)
I common_perf_print:       total time =    2000.68 ms /    14 tokens
"""
SPECULATIVE_LOG = """\
0.00.573.930 I encoded    7 tokens in    0.001 seconds, speed: 8353.223 t/s
0.00.573.944 I decoded    9 tokens in    0.100 seconds, speed:   90.127 t/s
I common_perf_print: prompt eval time =       1.13 ms /    15 tokens (    0.08 ms per token, ...)
I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token, ...)
"""


def test_llamacpp_timing_reads_the_prompt_and_the_decode_apart():
    """llama-completion's own lines (the prompt's forward is not the `eval time` one), and
    llama-speculative's encode / decode lines, whose perf lines count only its draft context."""
    assert llamacpp_timing(COMPLETION_LOG, speculative=False) == (7, 320.39 / 1e3, 1679.42 / 1e3)
    assert llamacpp_timing(SPECULATIVE_LOG, speculative=True) == (9, 0.001, 0.1)
    with pytest.raises(RuntimeError, match="no eval timing"):
        llamacpp_timing(COMPLETION_LOG.replace("prompt eval", "prompt"), speculative=False)
    with pytest.raises(RuntimeError, match="llama-speculative"):
        llamacpp_timing(COMPLETION_LOG, speculative=True)


def fake_binary(tmp_path, body: str) -> str:
    path = tmp_path / "llama-completion"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_peer_crash_names_the_signal_and_the_repacking_switch(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_ARG_REPACK", raising=False)
    assert run_peer([fake_binary(tmp_path, "echo fine")]).stdout == "fine\n"
    crash = fake_binary(tmp_path, "echo 'loading model' >&2; kill -SEGV $$")
    with pytest.raises(RuntimeError, match=r"(?s)llama-completion died with SIGSEGV.*"
                                           r"LLAMA_ARG_REPACK=0.*loading model"):
        run_peer([crash, "-m", "x.gguf"])
    monkeypatch.setenv("LLAMA_ARG_REPACK", "0")  # already off: no advice to turn it off
    with pytest.raises(RuntimeError, match="SIGSEGV") as err:
        run_peer([crash])
    assert "LLAMA_ARG_REPACK" not in str(err.value)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        run_peer([fake_binary(tmp_path, "exit 3")])
