"""The Triton quantized matmul compiles for Hopper (sm_90) without spilling, with no GPU here.

Like test_kernels_compile.py: Triton compiles ahead of time for an explicit target, and its
`cuobjdump` reports the stack bytes (spilled registers) per thread. The compile runs in a child
process because this directory's interpreter tests import Triton interpreted (conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CASES = [f"{fmt}-{dtype}-bias{bias}" for fmt in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
         for dtype in ("bf16", "fp32") for bias in (0, 1)]


def compile_all() -> dict[str, int]:
    """Compile every case for sm_90; return the stack bytes per thread of each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve.kernels import quant_triton
    from specserve.kernels.quant_reference import FORMATS

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    fn = quant_triton._quant_matmul_kernel._compiled
    results = {}
    for case in CASES:
        fmt, dtype, bias = case.split("-")
        constexprs = {"FMT": FORMATS[fmt].code, "BLOCK_BYTES": FORMATS[fmt].block_bytes,
                      "HAS_BIAS": bias == "bias1", "BLOCK_M": 16, "BLOCK_N": 32}
        signature, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = "*u8" if name == "w_ptr" else f"*{dtype}"
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "i32"
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "kernel.cubin"
            path.write_bytes(compiled.asm["cubin"])
            usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(path)],
                                   capture_output=True, text=True, check=True).stdout
        results[case] = int(re.search(r"STACK:(\d+)", usage).group(1))
    return results


@pytest.fixture(scope="module")
def spills() -> dict[str, int]:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                           timeout=900)
    if child.returncode != 0:
        pytest.fail(f"compiling for sm_90 failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_compiles_for_sm90_without_spills(spills: dict[str, int], case: str):
    assert spills[case] == 0, f"{case} spills {spills[case]} bytes per thread"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
