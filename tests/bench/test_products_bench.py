"""bench.products: a revision's kernel sources come out of git, a built tree computes the
product, and bad arguments are refused before anything loads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench import products
from specserve.kernels import cpu_build


def test_a_revisions_kernel_sources_come_out_of_git(tmp_path):
    sources = products.checkout_kernels("HEAD", tmp_path)
    names = {p.name for p in sources.glob("cpu_*.[ch]")}
    assert {"cpu_gemv.c", "cpu_simd.h", "cpu_dot_order.h"} <= names
    assert (sources / "cpu_gemv.c").read_text().startswith("/*")


def test_a_built_tree_computes_the_product(tmp_path):
    if cpu_build.c_compiler() is None:
        pytest.skip("no C compiler")
    lib = products.build_tree(products.REPO / products.KERNELS_DIR, "portable", tmp_path, "t")
    torch.manual_seed(0)
    x = torch.randn(3, 80).to(torch.bfloat16)  # [M, K]
    w = torch.randn(40, 80).to(torch.bfloat16)  # [N, K]
    y = torch.full((5, 64), float("nan"), dtype=torch.bfloat16)  # larger than [M, N]
    products.product(lib, x, w, y, 1)
    got = y.flatten()[:3 * 40].view(3, 40).float()
    torch.testing.assert_close(got, F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("argv, message", [
    (["--isas", "sse9"], "not a C path"),
    (["--rows", "2,5"], "must include 1"),
    (["--rows", "0,1,5"], "no count below 1"),
    (["--rows", "1,five"], "comma list of integers"),
    (["--pages", "2m,1g"], "not a page size"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        products.main(argv)
    assert message in capsys.readouterr().err
