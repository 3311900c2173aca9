"""Where the kernel tests run: Triton's CPU interpreter or the GPU for the Triton kernels, and
every C-kernel ISA path this CPU supports (`cpu_isa`).

Two layers decide the mode, and they read TRITON_INTERPRET at different times:
* Triton's own library functions (`tl.max`, `tl.sum`, `tl.cdiv`, ...) are `@triton.jit`
  functions, fixed as compiled or interpreted when `triton.language` is first imported;
* this package's kernels read the variable at each launch (`specserve/kernels/triton_utils.py`).

So without CUDA this file imports Triton once with TRITON_INTERPRET=1 (and puts the variable
back as it was), and the `device` fixture sets the variable per test with monkeypatch: nothing
is left in the environment for other test modules. With CUDA, Triton stays compiled and the
same tests run on the GPU instead.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch


def _interpreter_unavailable() -> str | None:
    """Import Triton in interpreter mode when possible; else say why the interpreter is off."""
    if torch.cuda.is_available():
        return "CUDA is present: the kernels are tested compiled (the gpu cases)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if "triton" not in sys.modules:
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            importlib.import_module("triton.language")
        finally:
            if before is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = before
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(sys.modules["triton.language"].max, InterpretedFunction):
        return "triton was imported in compiled mode before the kernel tests"
    return None


INTERPRETER_UNAVAILABLE = _interpreter_unavailable()


@pytest.fixture(params=["interpret", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Device for the kernels' tensors: "cpu" under the interpreter, or "cuda" compiled."""
    if request.param == "interpret":
        if INTERPRETER_UNAVAILABLE:
            pytest.skip(INTERPRETER_UNAVAILABLE)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return "cuda"
