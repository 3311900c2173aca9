"""ISA selection of the C kernels (SPECSERVE_CPU_ISA) and a compile check of every ISA path,
so the AVX-512 code keeps compiling on machines that cannot run it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from specserve.kernels import cpu_build


@pytest.fixture
def isa_env(monkeypatch: pytest.MonkeyPatch):
    """Set SPECSERVE_CPU_ISA (None: unset) and pretend the CPU has the given flags."""

    def set_env(value: str | None, flags: set[str]) -> None:
        if value is None:
            monkeypatch.delenv("SPECSERVE_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("SPECSERVE_CPU_ISA", value)
        monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset(flags))
        cpu_build.selected_isa.cache_clear()

    yield set_env
    cpu_build.selected_isa.cache_clear()


AVX512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma",
                "f16c"}


def test_default_is_the_best_isa_the_cpu_supports(isa_env):
    isa_env(None, AVX512_FLAGS)
    assert cpu_build.supported_isas() == ["avx512", "avx2", "portable"]
    assert cpu_build.selected_isa() == "avx512"
    isa_env("auto", AVX512_FLAGS - {"avx512_vnni"})  # the quantized kernel's dots need VNNI
    assert cpu_build.selected_isa() == "avx2"
    isa_env("", {"avx2", "fma", "f16c", "avx"})
    assert cpu_build.selected_isa() == "avx2"
    isa_env("auto", {"avx2", "f16c"})  # AVX2 without FMA is not enough
    assert cpu_build.selected_isa() == "portable"
    isa_env("auto", {"avx2", "fma"})  # nor without F16C
    assert cpu_build.selected_isa() == "portable"


def test_amx_needs_its_flags_and_the_kernels_permission(isa_env, monkeypatch):
    amx_flags = AVX512_FLAGS | {"amx_tile", "amx_bf16"}
    monkeypatch.setattr(cpu_build, "amx_permitted", lambda: True)
    isa_env(None, amx_flags)
    assert cpu_build.supported_isas() == ["amx", "avx512", "avx2", "portable"]
    assert cpu_build.selected_isa() == "amx"
    isa_env("amx", AVX512_FLAGS | {"amx_tile"})
    with pytest.raises(RuntimeError, match="amx_bf16"):
        cpu_build.selected_isa()
    # A kernel that does not grant the tile state (before Linux 5.16): avx512, and forcing amx
    # (or building its library) is refused rather than killed by SIGILL at the first tile.
    monkeypatch.setattr(cpu_build, "amx_permitted", lambda: False)
    isa_env(None, amx_flags)
    assert cpu_build.selected_isa() == "avx512"
    isa_env("amx", amx_flags)
    with pytest.raises(RuntimeError, match="permission to use AMX"):
        cpu_build.selected_isa()
    with pytest.raises(RuntimeError, match="permission to use AMX"):
        cpu_build.library_for("amx")


def test_a_compiler_without_the_isas_flags_falls_back_to_the_next_path(isa_env, monkeypatch):
    """An older compiler on a newer CPU (GCC 10 knows AVX-512 BF16, not AMX): the best path it
    can build, not the torch fallback of a failed build; forcing the path says why not."""
    monkeypatch.setattr(cpu_build, "amx_permitted", lambda: True)
    monkeypatch.setattr(cpu_build, "compiler_accepts", lambda isa: isa != "amx")
    isa_env(None, AVX512_FLAGS | {"amx_tile", "amx_bf16"})
    assert cpu_build.selected_isa() == "avx512"
    isa_env("amx", AVX512_FLAGS | {"amx_tile", "amx_bf16"})
    with pytest.raises(RuntimeError, match="a C compiler that takes .*-mamx-tile"):
        cpu_build.selected_isa()


def test_the_compiler_probe_accepts_every_path_it_builds(monkeypatch):
    if cpu_build.c_compiler() is None:
        pytest.skip("no C compiler")
    assert all(cpu_build.compiler_accepts(isa) for isa in cpu_build.ISA_FLAGS)
    monkeypatch.setitem(cpu_build.ISA_FLAGS, "bogus", ["-mno-such-instruction-set"])
    try:
        assert not cpu_build.compiler_accepts("bogus")
    finally:
        cpu_build.compiler_accepts.cache_clear()


def test_a_forced_isa_is_used_or_refused(isa_env):
    isa_env("AVX2", AVX512_FLAGS)
    assert cpu_build.selected_isa() == "avx2"
    isa_env("torch", AVX512_FLAGS)
    assert cpu_build.selected_isa() == "torch" and cpu_build.library() is None
    isa_env("avx512", {"avx2", "fma", "f16c"})
    with pytest.raises(RuntimeError, match="avx512_bf16"):
        cpu_build.selected_isa()
    isa_env("sse9", AVX512_FLAGS)
    with pytest.raises(ValueError, match="SPECSERVE_CPU_ISA='sse9'"):
        cpu_build.selected_isa()


def test_every_listed_function_is_exported_by_its_source():
    for source, functions in cpu_build.KERNELS.items():
        text = (cpu_build.HERE / source).read_text()
        for name in functions:
            assert f" {name}(" in text, f"{source} does not define {name}"


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("isa", list(cpu_build.ISA_FLAGS))
def test_every_isa_path_compiles_without_warnings(isa, vendor, tmp_path, monkeypatch):
    compiler = cpu_build.c_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_build, "cpu_vendor", lambda: vendor)
    command = cpu_build.compile_command(compiler, isa, tmp_path / "k.so")
    if vendor in cpu_build.VENDOR_FLAGS:
        # Only the sources that read a vendor's defines build differently from the plain
        # build (AMD's); the rest (cpu_quant.c alone takes a minute at -O3) are built once.
        defines = [flag.removeprefix("-D") for flag in cpu_build.VENDOR_FLAGS[vendor]]
        command = [arg for arg in command if not arg.endswith(".c")
                   or any(d in Path(arg).read_text() for d in defines)]
        assert any(arg.endswith(".c") for arg in command), "no source reads " + str(defines)
    done = subprocess.run([*command, "-Wall", "-Wextra", "-Werror"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-4000:]


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu avx2 fma f16c
bugs\t\t: sysret_ss_attrs

processor\t: 1
vendor_id\t: AuthenticAMD
"""


def test_cpuinfo_fields_are_read_from_the_first_cpu():
    assert cpu_build.cpuinfo_field(CPUINFO, "vendor_id") == "AuthenticAMD"
    assert cpu_build.cpuinfo_field(CPUINFO, "flags").split() == ["fpu", "avx2", "fma", "f16c"]
    assert cpu_build.cpuinfo_field(CPUINFO, "model name") == ""
    assert cpu_build.cpuinfo_field("", "flags") == ""


@pytest.mark.parametrize("vendor, l2_prefetch", [("GenuineIntel", True), ("AuthenticAMD", False),
                                                 ("", False)])
def test_the_l2_prefetch_is_built_only_where_it_was_measured_faster(vendor, l2_prefetch,
                                                                    monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_vendor", lambda: vendor)
    for isa in cpu_build.ISA_FLAGS:
        flags = cpu_build.build_flags(isa)
        assert ("-DSPECSERVE_L2_PREFETCH" in flags) == l2_prefetch
        assert flags[:len(cpu_build.COMMON_FLAGS)] == cpu_build.COMMON_FLAGS
        command = cpu_build.compile_command("cc", isa, Path("k.so"))
        assert command[1:1 + len(flags)] == flags
