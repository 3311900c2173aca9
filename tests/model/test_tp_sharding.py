"""Tensor-parallel sharding rules and sharded loading, in one process (no process group needed:
loading a rank's slice only reads the checkpoint)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specserve.distributed import TPShard
from specserve.model import loader
from specserve.model.loader import load_model
from specserve.model.parallel import QUANT_BLOCK, check_split, kv_head_range
from tests.tiny_models import save_model

D = 16  # head_dim of the tiny models (hidden 64 / 4 heads)


@pytest.fixture(scope="module")
def one_kv_tied(model_dir):
    """Qwen2 (q/k/v biases), 1 KV head for 4 query heads, LM head tied to the embedding."""
    return save_model(model_dir / "tp_one_kv_tied", "qwen2", seed=2, num_key_value_heads=1,
                      tie_word_embeddings=True)


def _whole_and_shards(path, world=2):
    whole = dict(load_model(path).named_parameters())
    shards = [dict(load_model(path, shard=TPShard(r, world)).named_parameters())
              for r in range(world)]
    return whole, shards


def _qkv(params, name, heads, kv_heads):
    w = params[name]
    return w.split([heads * D, kv_heads * D, kv_heads * D])


def test_shards_concatenate_to_the_whole_model(tiny_target):
    """4 query / 2 KV heads over 2 ranks: 2 query heads and 1 KV head each; untied head."""
    whole, shards = _whole_and_shards(tiny_target)
    for layer in range(2):
        pre = f"layers.{layer}"
        q, k, v = _qkv(whole, f"{pre}.self_attn.qkv_proj.weight", 4, 2)
        parts = [_qkv(s, f"{pre}.self_attn.qkv_proj.weight", 2, 1) for s in shards]
        for i, full in enumerate((q, k, v)):
            assert torch.equal(torch.cat([p[i] for p in parts]), full)
        o = f"{pre}.self_attn.o_proj.weight"
        assert shards[0][o].shape == (64, 32)
        assert torch.equal(torch.cat([s[o] for s in shards], dim=1), whole[o])
        gate, up = whole[f"{pre}.mlp.gate_up_proj.weight"].chunk(2)
        halves = [s[f"{pre}.mlp.gate_up_proj.weight"].chunk(2) for s in shards]
        assert torch.equal(torch.cat([h[0] for h in halves]), gate)
        assert torch.equal(torch.cat([h[1] for h in halves]), up)
        down = f"{pre}.mlp.down_proj.weight"
        assert torch.equal(torch.cat([s[down] for s in shards], dim=1), whole[down])
        norm = f"{pre}.input_layernorm.weight"
        assert all(torch.equal(s[norm], whole[norm]) for s in shards)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        assert shards[0][name].shape == (160, 64)
        assert torch.equal(torch.cat([s[name] for s in shards]), whole[name])


def test_single_kv_head_is_replicated_and_biases_split(one_kv_tied):
    whole, shards = _whole_and_shards(one_kv_tied)
    assert "lm_head.weight" not in whole  # tied: the embedding is the head
    for s in shards:
        q, k, v = _qkv(s, "layers.0.self_attn.qkv_proj.weight", 2, 1)
        _, wk, wv = _qkv(whole, "layers.0.self_attn.qkv_proj.weight", 4, 1)
        assert torch.equal(k, wk) and torch.equal(v, wv)
    bias = whole["layers.0.self_attn.qkv_proj.bias"]
    qb, kb, vb = bias.split([4 * D, D, D])
    for r, s in enumerate(shards):
        assert torch.equal(s["layers.0.self_attn.qkv_proj.bias"],
                           torch.cat([qb[r * 2 * D:(r + 1) * 2 * D], kb, vb]))


def test_each_rank_reads_only_its_slices(tiny_target, monkeypatch):
    """Bytes read from the file per rank: half of every split tensor, all of every norm."""
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

        def get_tensor(self, name):
            t = self.inner.get_tensor(name)
            reads.append(t.numel() * t.element_size())
            return t

    monkeypatch.setattr(loader, "safe_open", CountingHandle)
    tensors = load_file(tiny_target / "model.safetensors")
    nbytes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    norms = sum(b for n, b in nbytes.items() if n.endswith("norm.weight"))
    expected = norms + (sum(nbytes.values()) - norms) // 2
    for rank in range(2):
        reads.clear()
        load_model(tiny_target, shard=TPShard(rank, 2))
        assert sum(reads) == expected
    reads.clear()
    load_model(tiny_target)
    assert sum(reads) == sum(nbytes.values())


def test_kv_head_ranges():
    assert [kv_head_range(8, TPShard(r, 4)) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [kv_head_range(2, TPShard(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_range(1, TPShard(r, 2)) for r in range(2)] == [(0, 1), (0, 1)]


@pytest.mark.parametrize("heads, kv_heads, inter, world, match", [
    (6, 2, 128, 4, "6 attention heads do not split evenly over tp=4"),
    (4, 3, 128, 2, "3 key/value heads do not split evenly over tp=2"),
    (12, 4, 144, 6, "4 key/value heads cannot be replicated evenly over tp=6"),
    (8, 2, 128, 8, None),
    (4, 2, 100, 8, "attention heads do not split"),
    (4, 2, 101, 2, "intermediate size \\(101\\) does not split evenly over tp=2"),
])
def test_check_split_errors(heads, kv_heads, inter, world, match):
    if match is None:
        check_split(heads, kv_heads, D, inter, TPShard(0, world))
        return
    with pytest.raises(ValueError, match=match):
        check_split(heads, kv_heads, D, inter, TPShard(0, world))


def test_quantized_row_parallel_split_needs_whole_blocks():
    check_split(4, 2, D, 128, TPShard(0, 2), quant_block=QUANT_BLOCK)  # 32 and 64 features
    with pytest.raises(ValueError, match="o_proj input.*16 features.*32-weight scale block"):
        check_split(4, 2, D, 256, TPShard(0, 4), quant_block=QUANT_BLOCK)
    with pytest.raises(ValueError, match="down_proj input.*48 features"):
        check_split(4, 4, 32, 96, TPShard(0, 2), quant_block=QUANT_BLOCK)


def test_unsplittable_model_is_a_clear_error(tiny_target):
    with pytest.raises(ValueError, match="4 attention heads do not split evenly over tp=3"):
        load_model(tiny_target, shard=TPShard(0, 3))


def test_quantized_split_inside_a_block_is_a_clear_error(tiny_target):
    """tp=4: a rank's o_proj input is one 16-wide head, half a scale block."""
    load_model(tiny_target, shard=TPShard(0, 4))  # unquantized it splits
    with pytest.raises(ValueError, match="quantized weights cannot be split over tp=4.*o_proj"):
        load_model(tiny_target, quantization="int8", shard=TPShard(0, 4))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_gguf_file_blocks_split_like_quantizing_the_slice(tiny_target, fmt):
    """A rank's part of a GGUF's blocks (rows of q/k/v and gate/up, whole blocks of o/down input
    columns) is exactly what quantizing that rank's slice gives."""
    from specserve.model.quant import QuantizedLinear, use_file_blocks
    from tests.model.test_quant import _gguf_like_tensors

    tensors = _gguf_like_tensors(tiny_target, fmt)
    for rank in range(2):
        shard = TPShard(rank, 2)
        model = load_model(tiny_target, dtype="float32", shard=shard)
        assert len(use_file_blocks(model, tensors)) == 2 * 4
        want = load_model(tiny_target, dtype="float32", quantization=fmt.lower(), shard=shard)
        for name, module in model.named_modules():
            if isinstance(module, QuantizedLinear):
                other = want.get_submodule(name)
                assert module.qweight.shape == other.qweight.shape, name
                assert torch.equal(module.blocks, other.blocks), name
                assert module.shard == other.shard, name
