"""Build and load the C kernels for x86 CPUs, one library per instruction set (ISA).

The kernels are compiled once per machine with the system C compiler into a cache folder and
loaded with ctypes: no build step at install time, and the `.so` links the same OpenMP runtime
torch has already loaded (same soname), so the two share one thread pool. Kernels that use
threads take `num_threads` from the caller, who passes `torch.get_num_threads()`.

ISA paths (`SPECSERVE_CPU_ISA`, default: the best this CPU supports, from /proc/cpuinfo):
  amx       avx512 with the bf16 products on AMX tiles (cpu_amx.c: a few rows cost what one
            does); needs AMX-BF16 and a kernel that grants the tile state (Linux 5.16+)
  avx512    AVX-512 F/BW/VL + BF16 (VDPBF16PS products) + VNNI (the quantized kernel's integer
            dots), with AVX2, FMA and F16C
  avx2      AVX2 + FMA + F16C (bf16 widened to fp32 by shifts, fp32 FMAs; F16C converts the
            quantized blocks' fp16 scales)
  portable  plain C with GCC/Clang vector extensions, no -m flags (any CPU)
  torch     no C kernels: `library()` is None and every caller takes its PyTorch path, which is
            also the reference the tests compare against.
Forcing a path the CPU cannot run is an error (RuntimeError at `library()`), so an AVX-512
machine can test and benchmark every path and an AVX2 one refuses avx512 loudly. A failed build
(no compiler, compiler error) logs a warning and falls back to torch.

Convention for kernel sources (how a new kernel joins the build):
- Each kernel is one `cpu_<name>.c` file in this folder, listed in `KERNELS` below with the
  ctypes signatures of the functions it exports: `{"cpu_<name>.c": {"fn": ([argtypes], restype)}}`.
  All listed files are compiled together into one library per ISA; `library()` returns it with
  every listed function's argtypes/restype set.
- One source of truth per kernel: the C file is written once, against the per-ISA vector
  primitives of `cpu_simd.h` (fp32 vectors `vf_*`, bf16 dot-product steps `dot_*`). The build
  defines exactly one of SPECSERVE_ISA_AVX512 / SPECSERVE_ISA_AVX2 / SPECSERVE_ISA_PORTABLE
  (and the matching -m flags); code that must differ per ISA (an inner loop only) goes under
  `#if` on those macros, with a branch for each of the three. The amx path is the AVX-512 build
  with SPECSERVE_AMX also defined: only the bf16 products differ (cpu_amx.c).
- Every `cpu_*.h` header in this folder is part of the cache key; exported names are
  `snake_case` and unique across files; no FMA contraction (-ffp-contract=off), so elementwise
  kernels round like the PyTorch ops they replace (fused multiply-adds are written explicitly).
- The cache key is the compiler, the ISA's flags and every source and header, so editing a
  kernel or switching ISA never loads a stale library.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
Signature = tuple[list, object]  # (argtypes, restype)

# Source file -> the functions it exports and their ctypes signatures.
KERNELS: dict[str, dict[str, Signature]] = {
    "cpu_gemv.c": {
        "gemv_bf16": ([_p] * 5 + [_i64] * 3 + [_i32], ctypes.c_int),
    },
    "cpu_gemm.c": {
        "gemm_bf16": ([_p] * 5 + [_i64] * 3 + [_i32], ctypes.c_int),
    },
    "cpu_outer.c": {
        "outer_gemm_bf16": ([_p] * 5 + [_i64] * 3 + [_i32], ctypes.c_int),
    },
    "cpu_amx.c": {},  # gemv_bf16 and gemm_bf16 on the amx path
    "cpu_attention.c": {
        "paged_attention": (
            [_p] * 3 + [_i32, _p, _i64] + [_p] * 3 + [_i64] * 6 + [_f32, _p, _i64, _p, _i32],
            ctypes.c_int),
        "store_kv_rows": ([_p, _p, _i64, _p, _p, _p] + [_i64] * 4, ctypes.c_int),
    },
    "cpu_norm_rope.c": {
        "rms_norm_rows": ([_p] * 3 + [_i64] * 2 + [_f32, _i32], None),
        "rotary_rows": ([_p] + [_i64] * 4 + [_p] * 2 + [_i64, _p, _i32], ctypes.c_int),
    },
    "cpu_decoder.c": {
        "decoder_layers": ([_p] * 3 + [_i32], ctypes.c_int),
        "silu_mul_rows": ([_p] * 2 + [_i64] * 2 + [_i32] * 2, None),
        "gelu_tanh_mul_rows": ([_p] * 2 + [_i64] * 2 + [_i32] * 2, None),
    },
    "cpu_quant.c": {
        "quant_matmul": ([_p, _i32, _p, _i32, _i32, _p, _p, _i32] + [_i64] * 3 + [_i32],
                         ctypes.c_int),
        "quant_matmul_int": ([_p, _i32, _p, _i32, _i32, _p, _p, _i32] + [_i64] * 3
                             + [_i32, _i32], ctypes.c_int),
    },
    "cpu_ceiling.c": {
        "ceiling_fma": ([_i64, _p, _i32], _i64),
        "ceiling_madd16": ([_i64, _p, _i32], _i64),
        "ceiling_dot": ([_i64, _p, _i32], _i64),
    },
}

# Best first. `required` are /proc/cpuinfo flag names.
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx2",
                 "-mfma", "-mf16c", "-DSPECSERVE_ISA_AVX512"]
ISA_FLAGS: dict[str, list[str]] = {
    "amx": [*_AVX512_FLAGS, "-mamx-tile", "-mamx-bf16", "-DSPECSERVE_AMX"],
    "avx512": _AVX512_FLAGS,
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DSPECSERVE_ISA_AVX2"],
    "portable": ["-DSPECSERVE_ISA_PORTABLE"],
}
_AVX512_REQUIRES = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma",
                    "f16c"}
ISA_REQUIRES: dict[str, set[str]] = {
    "amx": _AVX512_REQUIRES | {"amx_tile", "amx_bf16"},
    # VNNI: the quantized kernel's integer dots; every CPU with AVX-512 BF16 has it.
    "avx512": _AVX512_REQUIRES,
    "avx2": {"avx2", "fma", "f16c"},  # F16C: every AVX2 CPU has it (the quant kernel's scales)
    "portable": set(),
}
ISAS = (*ISA_FLAGS, "torch")
# -fno-trapping-math: no kernel reads the floating-point exception flags, and without it GCC
# will not turn a float select (`x > hi ? hi : x`) into a vector blend, so loops with one stay
# scalar; values and rounding are unchanged (no -ffast-math).
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
# Speed-only settings per CPU vendor (/proc/cpuinfo `vendor_id`), where they were measured;
# none changes a result. SPECSERVE_L2_PREFETCH: the few-row products also prefetch the weights
# into L2 far ahead (cpu_gemv.c): faster on a Sapphire Rapids class Intel CPU, while on a 2-core
# AMD Zen 3 a similar far prefetch made one row 15% slower, so AMD builds without it until
# measured there.
VENDOR_FLAGS: dict[str, list[str]] = {"GenuineIntel": ["-DSPECSERVE_L2_PREFETCH"]}


def supported_isas() -> list[str]:
    """The C paths this CPU can run, best first (torch, always possible, not included)."""
    return [isa for isa in ISA_REQUIRES if not missing(isa)]


def missing(isa: str) -> list[str]:
    """What this machine lacks to run `isa`'s kernels: CPU flags, the kernel's grant of the AMX
    tile state, or a C compiler that knows the ISA's instructions (so an older compiler on a new
    CPU gets the best path it can build, not the torch fallback of a failed build)."""
    lacks = sorted(ISA_REQUIRES.get(isa, set()) - cpu_flags())
    if isa == "amx" and not lacks and not amx_permitted():
        lacks.append("the Linux kernel's permission to use AMX tiles (arch_prctl, Linux 5.16+)")
    if isa in ISA_FLAGS and not lacks and not compiler_accepts(isa):
        lacks.append(f"a C compiler that takes {' '.join(ISA_FLAGS[isa])}")
    return lacks


@cache
def selected_isa() -> str:
    """SPECSERVE_CPU_ISA if set (checked), else the best C path this CPU supports."""
    wanted = os.environ.get("SPECSERVE_CPU_ISA", "").strip().lower()
    if not wanted or wanted == "auto":  # probes only as far as the first path this CPU runs
        return next(isa for isa in ISA_REQUIRES if not missing(isa))
    if wanted not in ISAS:
        raise ValueError(f"SPECSERVE_CPU_ISA={wanted!r}: expected one of {', '.join(ISAS)}")
    lacks = missing(wanted)
    if lacks:
        raise RuntimeError(f"SPECSERVE_CPU_ISA={wanted}: this machine lacks {', '.join(lacks)}")
    return wanted


def library() -> ctypes.CDLL | None:
    """The kernel library of the selected ISA, or None (torch path)."""
    return library_for(selected_isa())


def library_for(isa: str) -> ctypes.CDLL | None:
    """The kernel library built for `isa` (one of ISAS), or None for torch or a failed build."""
    if isa not in ISAS:
        raise ValueError(f"unknown ISA {isa!r}: expected one of {', '.join(ISAS)}")
    if isa == "torch":
        return None
    if isa == "amx" and not amx_permitted():  # a tile instruction would kill the process
        raise RuntimeError("the amx kernels need Linux's permission to use AMX tiles")
    return _loaded(isa)


def c_compiler() -> str | None:
    """The C compiler the kernels are built with (`CC`, default `cc`), or None."""
    return shutil.which(os.environ.get("CC", "cc"))


@cache
def _loaded(isa: str) -> ctypes.CDLL | None:
    compiler = c_compiler()
    if compiler is None:
        log.warning("no C compiler (set CC): the CPU kernels fall back to PyTorch")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler, isa)))
    except (OSError, RuntimeError, AttributeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("building the %s CPU kernels failed (%s %s): using PyTorch", isa, exc,
                    detail.decode(errors="replace")[-500:])
        return None
    for functions in KERNELS.values():
        for name, (argtypes, restype) in functions.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    return lib


def sources() -> list[Path]:
    return [HERE / name for name in KERNELS]


def headers() -> list[Path]:
    return sorted(HERE.glob("cpu_*.h"))


def build_flags(isa: str) -> list[str]:
    """The compiler flags of isa's library on this machine: common, the ISA's, its vendor's."""
    return [*COMMON_FLAGS, *ISA_FLAGS[isa], *VENDOR_FLAGS.get(cpu_vendor(), [])]


def compile_command(compiler: str, isa: str, output: Path,
                    files: list[Path] | None = None) -> list[str]:
    """Build isa's library from `files` (default: this folder's kernel sources)."""
    files = sources() if files is None else files
    return [compiler, *build_flags(isa), *map(str, files), "-lm", "-o", str(output)]


def build(compiler: str, isa: str) -> Path:
    """Compile once per ISA, flags, compiler and sources; concurrent builders rename atomically."""
    digest = hashlib.sha256(" ".join([compiler, isa, *build_flags(isa)]).encode())
    for source in [*sources(), *headers()]:
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    # An unset or empty XDG_CACHE_HOME means ~/.cache (Path.home() raises without a home).
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = (cache_root / "specserve" / "cpu_kernels"
              / f"kernels-{isa}-{digest.hexdigest()[:16]}.so")
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(compile_command(compiler, isa, built), check=True, capture_output=True)
        os.replace(built, target)
    return target


@cache
def compiler_accepts(isa: str) -> bool:
    """Whether the C compiler takes `isa`'s flags (AMX needs GCC 11 or Clang 12, AVX-512 BF16
    GCC 10 or Clang 9). True without a compiler: `library()` then warns and falls back to torch
    whatever the ISA."""
    compiler = c_compiler()
    if compiler is None:
        return True
    probe = [compiler, *ISA_FLAGS[isa], "-x", "c", "-c", "-o", os.devnull, "-"]
    return subprocess.run(probe, input="int probe;\n", capture_output=True, text=True
                          ).returncode == 0


@cache
def amx_permitted() -> bool:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA): a process
    must before its first tile instruction, or it is killed with SIGILL. The grant is
    process-wide and asking again is harmless."""
    if platform.machine() != "x86_64":
        return False
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0


@cache
def cpu_flags() -> frozenset[str]:
    return frozenset(cpuinfo_field(_cpuinfo(), "flags").split())


@cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), or "" where it says none."""
    return cpuinfo_field(_cpuinfo(), "vendor_id")


def cpuinfo_field(cpuinfo: str, name: str) -> str:
    """The first CPU's `name` field in /proc/cpuinfo's text, stripped; "" where there is none."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
