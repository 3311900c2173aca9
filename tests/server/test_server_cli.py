"""`specserve generate`, `specserve chat` and `python -m specserve`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specserve import SamplingParams
from specserve.cli import build_parser, main, run_chat

pytestmark = pytest.mark.timeout(120)


def test_generate_prints_the_completion(tiny_target, capsys):
    from specserve import LLM

    argv = ["generate", "--target", str(tiny_target), "--draft", str(tiny_target),
            "--speculation", "chain:3", "--prompt", "def add(a, b):", "--max-tokens", "9", "--raw"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    expected = LLM(tiny_target).generate("def add(a, b):", SamplingParams(
        temperature=0, max_tokens=9))[0].text
    assert printed == expected + "\n"


def test_chat_streams_replies_and_keeps_history(server, reference, capsys):
    lines = iter(["hello", "/reset", "again"])

    def fake_input(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    args = build_parser().parse_args(["chat", "--url", server.http, "--temperature", "0",
                                      "--max-tokens", "6"])
    assert run_chat(args, fake_input) == 0
    out = capsys.readouterr()
    tok = reference.tokenizer

    def reply(messages):
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False), add_special_tokens=False)
        return reference.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].text

    # After /reset the second question is asked without the first exchange.
    assert out.out == reply([{"role": "user", "content": "hello"}]) + "\n" + \
        reply([{"role": "user", "content": "again"}]) + "\n"
    assert "acceptance length" in out.err


def test_chat_reports_an_unreachable_server(capsys):
    args = build_parser().parse_args(["chat", "--url", "ws://127.0.0.1:9"])
    assert run_chat(args, lambda prompt: "x") == 1
    assert "cannot connect" in capsys.readouterr().err


def test_python_dash_m_is_the_same_program():
    out = subprocess.run([sys.executable, "-m", "specserve", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for command in ("serve", "generate", "chat"):
        assert command in out.stdout


def test_serve_start_line_names_the_cpu_path(monkeypatch, request):
    from specserve.cli import _cpu_path
    from specserve.kernels import cpu_build

    monkeypatch.setenv("SPECSERVE_CPU_ISA", "portable")
    cpu_build.selected_isa.cache_clear()  # the ISA is read once per process
    request.addfinalizer(cpu_build.selected_isa.cache_clear)
    monkeypatch.setenv("SPECSERVE_QUANT_ACT", "q8")
    assert _cpu_path("cpu") == ", CPU kernels portable, quantized activations q8"
    monkeypatch.setenv("SPECSERVE_QUANT_ACT", "fp32")
    assert _cpu_path("cpu").endswith("quantized activations fp32")
    assert _cpu_path("cuda:0") == ""
    monkeypatch.setenv("SPECSERVE_QUANT_ACT", "int4")
    with pytest.raises(ValueError, match="SPECSERVE_QUANT_ACT"):
        _cpu_path("cpu")
