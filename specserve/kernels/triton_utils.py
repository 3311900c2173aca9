"""Launch helpers shared by the Triton kernels.

`triton.jit` decides at decoration time (module import) whether a kernel is compiled for the GPU
or run by Triton's CPU interpreter, from `TRITON_INTERPRET`; whoever imports a kernel module
first would decide for the whole process. `kernel` keeps both forms of each kernel and reads
`TRITON_INTERPRET` at each launch instead, so a test can turn the interpreter on for itself
with `monkeypatch.setenv` and compiled GPU launches stay compiled.

One thing stays process-wide: Triton's own library functions (`tl.max`, `tl.sum`, `tl.cdiv`,
...) are themselves `@triton.jit` functions, fixed when `triton.language` is first imported.
Interpreted launches need that import to have happened under TRITON_INTERPRET=1, compiled ones
without it (tests/kernels/conftest.py arranges this for the tests).

The interpreter form is `triton.runtime.interpreter.InterpretedFunction`, the class that
`triton.jit` itself returns under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


def interpreting() -> bool:
    """Whether launches run in Triton's CPU interpreter (TRITON_INTERPRET=1, read right now)."""
    return bool(triton.knobs.runtime.interpret)


class Kernel:
    """A Triton kernel launched as `kernel[grid](...)`, compiled or interpreted per launch."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._compiled = JITFunction(fn)
        self._interpreted: InterpretedFunction | None = None

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if interpreting():
            if self._interpreted is None:
                self._interpreted = InterpretedFunction(self.fn)
            return self._interpreted[grid]
        return self._compiled[grid]


def kernel(fn: Callable[..., Any]) -> Kernel:
    """Decorator used instead of `triton.jit` for every kernel in this package."""
    return Kernel(fn)


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise a clear error instead of Triton's "0 active drivers" for CPU tensors."""
    for t in tensors:
        if not t.is_cuda and not interpreting():
            raise ValueError(
                "the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); "
                f"got a tensor on {t.device}"
            )

