"""The kernels compile for Hopper (sm_90) without spilling registers, on a machine with no GPU.

The interpreter checks what the kernels compute, not whether Triton's GPU compiler accepts them
or how many registers they need. Triton compiles ahead of time for an explicit target without a
driver, and ships `ptxas` and `cuobjdump`, so both are checked here for every launch shape.
The signatures mirror what a launch specializes: 16-byte aligned pointers, and strides that are
multiples of 16 except those that depend on batch sizes.

The compiler must see Triton's library in compiled mode, while the interpreter tests of this
directory import it interpreted (conftest.py), so the compiles run in one child process: this
file run as a script prints the stack bytes (spilled registers) of every case as JSON.
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

# name -> (dtype, max_query_len, tree mask, GQA group, split-K), one per launch shape and dtype.
ATTENTION_CASES = {
    f"{shape}-{dtype}": (dtype, max_query_len, tree, group, split)
    for shape, max_query_len, tree, group, split in [
        ("decode-split", 1, False, 4, True),
        ("decode", 1, False, 1, False),
        ("tree-split", 64, True, 8, True),
        ("prefill", 256, False, 4, False),
    ]
    for dtype in ("bf16", "fp32")
}
SMALL_CASES = ["merge", "store_kv", "copy_gather", "copy_scatter"]
NOT_ALIGNED = {"stride_bt", "stride_mt", "stride_mj"}  # block-table width, max_query_len


def compile_all() -> dict[str, int]:
    """Compile every case for sm_90; return the stack bytes per thread of each."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve.kernels import attention, kv_store

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

    def spilled(kernel, dtype: str, constexprs: dict, num_warps: int) -> int:
        fn = kernel._compiled
        pointers = {
            "part_out_ptr": "fp32", "part_lse_ptr": "fp32", "block_tables_ptr": "i32",
            "query_start_loc_ptr": "i32", "context_lens_ptr": "i32", "mask_ptr": "u8",
            "slot_mapping_ptr": "i64", "slots_ptr": "i64",
        }
        signature, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
                continue
            if name.endswith("_ptr"):
                signature[name] = "*" + pointers.get(name, dtype)
            else:
                signature[name] = "fp32" if name == "scale_log2" else "i32"
            if name.endswith("_ptr") or (name.startswith("stride") and name not in NOT_ALIGNED):
                attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps},
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "kernel.cubin"
            path.write_bytes(compiled.asm["cubin"])
            usage = subprocess.run(
                [str(tools / "cuobjdump"), "-res-usage", str(path)], capture_output=True,
                text=True, check=True,
            ).stdout
        return int(re.search(r"STACK:(\d+)", usage).group(1))

    results = {}
    for name, (dtype, max_query_len, tree, group, split) in ATTENTION_CASES.items():
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        cfg = attention._launch_config(max_query_len, tree, group, torch_dtype)
        constexprs = {
            "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16, "GROUP": group,
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "TREE_MASK": tree, "SPLIT": split,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "UPCAST_DOT": False,
        }
        results[name] = spilled(attention._attention_kernel, dtype, constexprs, cfg.num_warps)
    shape = {"NUM_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128}
    merge = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 8}
    results["merge"] = spilled(attention._merge_splits_kernel, "bf16", merge, 4)
    results["store_kv"] = spilled(kv_store._store_kv_kernel, "bf16", shape, 4)
    for name, to_cache in (("copy_gather", False), ("copy_scatter", True)):
        copy = {**shape, "TO_CACHE": to_cache}
        results[name] = spilled(kv_store._copy_slots_kernel, "bf16", copy, 4)
    return results


@pytest.fixture(scope="module")
def spills() -> dict[str, int]:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, env=env, timeout=900
    )
    if child.returncode != 0:
        pytest.fail(f"compiling for sm_90 failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", [*ATTENTION_CASES, *SMALL_CASES])
def test_compiles_for_sm90_without_spills(spills: dict[str, int], case: str):
    assert spills[case] == 0, f"{case} spills {spills[case]} bytes per thread"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
