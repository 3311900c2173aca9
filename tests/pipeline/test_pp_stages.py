"""Pipeline stages in one process (no process group: loading a stage only reads the
checkpoint): each stage holds and reads only its layers, and the stages' forwards, one after
the other, give the whole model's logits and KV."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specserve.distributed import PipelineStage, TPShard
from specserve.model import loader
from specserve.model import runner as runner_module
from specserve.model.loader import load_model
from specserve.model.runner import ModelRunner, Segment, kv_bytes_per_block
from specserve.pipeline.link import StageLink
from specserve.pipeline.stage_model import StageLM
from tests.tiny_models import save_model


@pytest.fixture(scope="module")
def tied(model_dir):
    """Qwen2 (q/k/v biases), LM head tied to the embedding, 3 layers (an uneven split)."""
    return save_model(model_dir / "pp_tied", "qwen2", seed=3, tie_word_embeddings=True,
                      num_hidden_layers=3)


def test_layer_ranges():
    assert [PipelineStage(k, 2).layers(2) for k in range(2)] == [range(0, 1), range(1, 2)]
    # Earlier stages take the extra layers: rank 0 sizes the KV pool from the largest stage.
    assert [PipelineStage(k, 3).layers(8) for k in range(3)] == [range(0, 3), range(3, 6),
                                                                 range(6, 8)]
    with pytest.raises(ValueError, match="3 layers cannot be split over pp=4"):
        PipelineStage(0, 4).layers(3)


def test_stages_hold_only_their_weights(tiny_target):
    whole = dict(load_model(tiny_target).named_parameters())
    first = load_model(tiny_target, stage=PipelineStage(0, 2))
    last = load_model(tiny_target, stage=PipelineStage(1, 2))
    assert isinstance(first, StageLM) and first.spec.num_layers == 1
    p0, p1 = dict(first.named_parameters()), dict(last.named_parameters())
    assert "embed_tokens.weight" in p0 and "lm_head.weight" not in p0 and "norm.weight" not in p0
    assert "embed_tokens.weight" not in p1 and {"lm_head.weight", "norm.weight"} <= set(p1)
    assert not any(n.startswith("layers.1.") for n in {*p0, *p1})  # one layer each, local index
    for name, value in p0.items():
        assert torch.equal(value, whole[name]), name
    for name, value in p1.items():
        assert torch.equal(value, whole[name.replace("layers.0.", "layers.1.")]), name
    # Each stage's KV cache holds its own layers: half the whole model's per block.
    assert 2 * kv_bytes_per_block(first, 16) == kv_bytes_per_block(load_model(tiny_target), 16)


def test_tied_head_is_read_by_the_last_stage(tied):
    whole = dict(load_model(tied).named_parameters())
    stages = [load_model(tied, stage=PipelineStage(k, 2)) for k in range(2)]
    assert [s.spec.num_layers for s in stages] == [2, 1]
    assert torch.equal(stages[1].lm_head.weight, whole["embed_tokens.weight"])
    assert stages[0].lm_head is None
    with pytest.raises(RuntimeError, match="pipeline stage 0 has no LM head"):
        stages[0].compute_logits(torch.zeros(1, 64))


def test_each_stage_reads_only_its_tensors(tiny_target, monkeypatch):
    """Bytes read from the file per stage: its layers' tensors, the embedding on the first,
    the final norm and LM head on the last; with tp=2 inside a stage, half of each split one."""
    reads = []

    class CountingSlice:
        def __init__(self, inner):
            self.inner = inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            t = self.inner[index]
            reads.append(t.numel() * t.element_size())
            return t

    class CountingHandle:
        def __init__(self, *args, **kwargs):
            self.inner = safe_open(*args, **kwargs)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return CountingSlice(self.inner.get_slice(name))

    monkeypatch.setattr(loader, "safe_open", CountingHandle)
    nbytes = {n: t.numel() * t.element_size()
              for n, t in load_file(tiny_target / "model.safetensors").items()}

    def total(prefixes, split=1):
        return sum(b if n.endswith("norm.weight") else b // split
                   for n, b in nbytes.items() if n.startswith(prefixes))

    want = [total(("model.embed_tokens.", "model.layers.0.")),
            total(("model.layers.1.", "model.norm.", "lm_head."))]
    for k in range(2):
        reads.clear()
        load_model(tiny_target, stage=PipelineStage(k, 2))
        assert sum(reads) == want[k]
    reads.clear()
    load_model(tiny_target, shard=TPShard(1, 2), stage=PipelineStage(1, 2))
    assert sum(reads) == total(("model.layers.1.", "model.norm.", "lm_head."), split=2)


def test_gguf_stage_dequantizes_only_its_tensors(tiny_target, tmp_path, monkeypatch):
    """A Q8_0 file: each stage runs its projections on the file's own blocks, and turns only
    its own tensors into torch tensors."""
    from gguf import GGMLQuantizationType as Q

    from specserve.model import gguf
    from specserve.model.quant import QuantizedLinear
    from tests.model.test_gguf import write_gguf

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_gguf(tiny_target, path, Q.Q8_0)
    whole = load_model(path, dtype="float32")
    seen = []
    real = gguf.GGUFTensor.dequantize
    monkeypatch.setattr(gguf.GGUFTensor, "dequantize",
                        lambda self, dtype=torch.float32: seen.append(self.name) or real(self,
                                                                                         dtype))
    read = []
    real_tensor = gguf._tensor
    monkeypatch.setattr(gguf, "_tensor", lambda path, arch, entry, *rest: read.append(
        entry["name"]) or real_tensor(path, arch, entry, *rest))
    last = load_model(path, dtype="float32", stage=PipelineStage(1, 2))
    stage_read = list(read)  # the stage's load only, not the whole-file read below
    mine = sorted(n for n in gguf.read_gguf(path).tensors
                  if n.startswith(("model.layers.1.", "model.norm.", "lm_head.")))
    assert sorted(seen) == mine
    # not even read (unpermuted, converted): blk.1.*, the final norm, the head or tied embedding
    assert all(n.startswith(("blk.1.", "output")) or n == "token_embd.weight"
               for n in stage_read)
    assert any(n.startswith("blk.1.") for n in stage_read)
    assert isinstance(last.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert torch.equal(last.layers[0].self_attn.qkv_proj.blocks,
                       whole.layers[1].self_attn.qkv_proj.blocks)
    assert last.lm_head.file_head is not None


@pytest.fixture
def no_links(monkeypatch):
    """Stage runners in one process: nothing to pass on, the test carries the hidden states."""
    monkeypatch.setattr(runner_module.StageLink, "here",
                        classmethod(lambda cls, stage: StageLink(None, None, False, 0)))


@pytest.mark.parametrize("fixture", ["tiny_target", "tied"])
def test_stages_in_turn_give_the_whole_models_logits(fixture, request, no_links):
    """A prompt chunk, then a token tree over the cached prompt: stage 0's output fed to stage 1
    gives the whole model's logits (the KV each stage cached is the whole model's, layer by
    layer)."""
    path = request.getfixturevalue(fixture)
    whole = ModelRunner(load_model(path), num_blocks=16, block_size=4)
    stages = [ModelRunner(load_model(path, stage=PipelineStage(k, 2)), 16, 4) for k in range(2)]
    prompt = Segment(list(range(10, 30)), range(20), 0, [3, 5, 1, 7, 9, 2], [19])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = Segment([7, 8, 9], [20, 21, 21], 20, [3, 5, 1, 7, 9, 2], [0, 1, 2], mask)
    for segment in (prompt, tree):
        want = whole.forward([segment])[0]
        inputs = stages[0].prepare([segment])
        hidden = stages[0]._hidden(inputs)  # [T, H] after stage 0's layers
        got = stages[1].execute(inputs, hidden)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    layers = stages[0].kv_cache.shape[0]
    torch.testing.assert_close(torch.cat([s.kv_cache for s in stages]), whole.kv_cache)
    assert layers == stages[0].model.spec.num_layers
