"""A CPU model's weights in a huge-page mapping (specserve/model/huge_pages.py): where they
live, that they are the same values and the same sharing as the loader made, and the switch."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from specserve.model import huge_pages
from specserve.model.loader import load_model
from specserve.model.quant import QuantizedLinear
from specserve.model.runner import ModelRunner, Segment
from tests.model.test_reduced_draft import make_reduced_draft
from tests.tiny_models import save_model

pytestmark = pytest.mark.skipif(not huge_pages.enabled(), reason="no madvise huge pages here")


def _tensors(model):
    return [*model.parameters(), *model.buffers()]


def _logits(model) -> torch.Tensor:
    ids = list(range(3, 40))
    runner = ModelRunner(model, num_blocks=4, block_size=16)
    return runner.forward([Segment(ids, range(len(ids)), 0, [0, 1, 2], range(len(ids)))])[0]


def _load_plain(path, **kwargs):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_HUGE_PAGES", "0")
        return load_model(path, **kwargs)


def _advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` carries MADV_HUGEPAGE ("hg" in its VmFlags)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_every_weight_moves_and_keeps_its_values(tiny_target, quantization):
    model = load_model(tiny_target, dtype="float32", quantization=quantization)
    plain = _load_plain(tiny_target, dtype="float32", quantization=quantization)
    assert all(huge_pages.in_huge_pages(t) for t in _tensors(model))
    assert not any(huge_pages.in_huge_pages(t) for t in _tensors(plain))
    if sys.platform == "linux":
        assert _advised_huge(model.norm.weight.data_ptr())
    for (name, got), (_, want) in zip(model.state_dict().items(), plain.state_dict().items(),
                                      strict=True):
        assert torch.equal(got, want), name
    if quantization is not None:  # the kernels read qweight: it must be the moved buffer
        for linear in (m for m in model.modules() if isinstance(m, QuantizedLinear)):
            assert linear.qweight.blocks.data_ptr() == linear.blocks.data_ptr()
    assert torch.equal(_logits(model), _logits(plain))


def test_tied_embeddings_stay_one_tensor(tmp_path):
    path = save_model(tmp_path / "tied", "llama", seed=3, tie_word_embeddings=True)
    model = load_model(path, dtype="float32")
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    assert huge_pages.in_huge_pages(model.embed_tokens.weight)
    assert head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_a_draft_keeps_its_targets_embeddings_where_they_are(tmp_path, tiny_target):
    full = save_model(tmp_path / "full", "llama", seed=1, num_hidden_layers=1)
    draft_dir = make_reduced_draft(full, tmp_path / "draft", tiny_target)
    target = load_model(tiny_target, dtype="float32")
    embedding = target.embed_tokens.weight.data_ptr()
    draft = load_model(draft_dir, dtype="float32", target=target)
    assert draft.embed_tokens.weight is target.embed_tokens.weight
    assert target.embed_tokens.weight.data_ptr() == embedding  # not copied into the draft's
    assert all(huge_pages.in_huge_pages(t) for t in _tensors(draft))


def test_the_mapping_goes_with_the_model(tiny_target):
    gc.collect()
    before = len(huge_pages._arenas)
    model = load_model(tiny_target, dtype="float32")
    assert len(huge_pages._arenas) == before + 1
    del model
    gc.collect()
    assert len(huge_pages._arenas) == before


def test_a_kernel_without_huge_pages_leaves_the_weights_where_they_are(monkeypatch, tiny_target):
    """madvise refuses MADV_HUGEPAGE where transparent huge pages are not built in."""
    import mmap

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages.mmap, "mmap", Refusing)
    huge_pages._can_advise.cache_clear()
    try:
        assert not huge_pages.enabled()
        model = load_model(tiny_target, dtype="float32")
        assert not any(huge_pages.in_huge_pages(t) for t in _tensors(model))
    finally:
        monkeypatch.undo()
        huge_pages._can_advise.cache_clear()
    assert huge_pages.enabled()


def test_the_switch(monkeypatch):
    monkeypatch.setenv("SPECSERVE_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    assert huge_pages.move_to_huge_pages(torch.nn.Linear(4, 4)) == 0
    monkeypatch.setenv("SPECSERVE_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match="SPECSERVE_HUGE_PAGES"):
        huge_pages.enabled()
