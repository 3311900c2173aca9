"""Bad checkpoint folders fail with an error naming the file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.model.loader import CheckpointError, load_model


@pytest.fixture
def ckpt(tiny_target, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_target, dst)
    return dst


def test_unsupported_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(ckpt)


def test_missing_weight_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(ckpt)


def test_truncated_weight_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|corrupt|cannot)"):
        load_model(ckpt)


def test_shape_mismatch_names_tensor(ckpt):
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = torch.zeros(7, 7)
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors.*{name}.*shape mismatch"):
        load_model(ckpt)


def test_missing_tensor_is_named(ckpt):
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.qkv_proj\.weight\[1\]"):
        load_model(ckpt)


def test_sharded_checkpoint_loads(ckpt, tiny_target):
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, ckpt / fname)
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {k: fname for fname, keys in shards.items() for k in keys}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded, single = load_model(ckpt), load_model(tiny_target)
    for (n, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters()):
        assert torch.equal(a, b), n
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        load_model(ckpt)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
