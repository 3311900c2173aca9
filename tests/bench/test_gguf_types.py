"""bench.gguf_types on tiny GGUF files: a type converted exactly (Q5_0 -> Q8_0) scores as the
file does, one re-quantized (Q5_1 -> Q8_0) close to it, and the table says what ran."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bench.gguf_types import AIM, block_types, format_rows, measure_file
from tests.model.test_gguf import write_gguf


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))


WINDOWS = torch.randint(3, 300, (3, 25), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_a_converted_file_scores_as_its_own_blocks(tiny_target, tmp_path, qtype, monkeypatch):
    monkeypatch.setenv("SPECSERVE_QUANT_ACT", "fp32")  # the kernels' sums alone, no act rounding
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(tiny_target, path, qtype)
    assert block_types(path) == {qtype.name: 7 * 2 + 2}  # 7 projections a layer, embedding, head
    row = measure_file(path, WINDOWS)
    assert row["runs_as"] == {"Q8_0": 4 * 2}  # fused qkv and gate_up, o, down in each layer
    assert row["reference"] > 0 and abs(row["relative"]) <= AIM
    if qtype == Q.Q5_0:  # exact conversion: only the order of fp32 sums differs
        assert abs(row["relative"]) < 1e-5 and row["top1_same"] == 1.0
    else:  # re-quantized: the NLL moves, a little
        assert row["runtime"] != row["reference"]
    table = format_rows([{"file_type": qtype.name, **row}], len(WINDOWS), 24)
    assert f"| {qtype.name} | 16 {qtype.name} | 8 Q8_0 |" in table and "| yes |" in table
