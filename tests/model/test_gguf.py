"""The GGUF loader: tiny GGUF files written here, as llama.cpp's converter writes them, load into
the same model as the safetensors folder they came from."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from specserve.kernels.quant_reference import dequantize
from specserve.model.gguf import GGUFError, read_gguf
from specserve.model.loader import CheckpointError, load_model, load_tokenizer
from specserve.model.runner import ModelRunner, Segment
from tests.tiny_models import CHAT_TEMPLATE, save_model

QUANTIZED = (Q.Q8_0, Q.Q4_0, Q.Q4_1)
FLOATS = (Q.F32, Q.F16, Q.BF16)
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_MODULES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
# Gemma 3's block norms, as llama.cpp's converter names them.
GEMMA3_MODULES = {**LAYER_MODULES, "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, layer, *module, kind = hf.split(".")
    modules = GEMMA3_MODULES if arch == "gemma3" else LAYER_MODULES
    return f"blk.{layer}.{modules['.'.join(module)]}.{kind}"


def converter_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (rotary halves -> interleaved rows)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def encode(values: np.ndarray, qtype: Q) -> np.ndarray:
    """What the converter stores for a float32 tensor in `qtype`."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def write_gguf(folder, path, qtype: Q, arch: str = "llama") -> None:
    """`folder`'s model as a GGUF file: matrices in `qtype`, norms and biases in F32, with the
    tokenizer and the chat template in the metadata."""
    import json

    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    w = gguf.GGUFWriter(path, arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    rope = cfg.get("rope_parameters", {})
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "gemma3":  # what llama.cpp's converter writes (the pattern: as an int)
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern(cfg["layer_types"].index("full_attention") + 1)
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in sorted(state.items()):
        values = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            values = converter_permute(values, heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            values = converter_permute(values, kv_heads)
        if arch == "gemma3" and "norm" in name:  # the converter stores Gemma's 1 + w
            values = values + np.float32(1)
        t = encode(values, qtype if values.ndim == 2 else Q.F32)
        w.add_tensor(gguf_name(name, arch), t, raw_dtype=qtype if values.ndim == 2 else Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def roundtrip_folder(folder, dst, qtype: Q):
    """A copy of `folder` whose matrices are dequantize(quantize(W)): what the GGUF holds."""
    import shutil

    shutil.copytree(folder, dst)
    state = load_file(folder / "model.safetensors")
    for name, tensor in state.items():
        if tensor.dim() == 2:
            enc = encode(tensor.float().numpy(), qtype)
            state[name] = torch.from_numpy(
                gguf.quants.dequantize(enc.view(np.uint8), qtype).copy()).reshape(tensor.shape)
    save_file(state, dst / "model.safetensors")
    return dst


def logits(model, ids):
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    return runner.forward([Segment(ids, range(len(ids)), 0, [3, 0, 5], range(len(ids)))])[0]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Tokenizers built from these files are cached under the test's own folder."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))


IDS = torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("llama"), "llama", seed=5)


@pytest.mark.parametrize("qtype", FLOATS + QUANTIZED, ids=lambda q: q.name)
def test_every_type_loads_the_weights_it_stores(llama, tmp_path, qtype):
    """Logits equal (exactly, float32) those of the folder holding the values the file stores,
    and stay near the original float32 model's. The relative L2 bounds are loose for 4 bits:
    random Gaussian weights (std 0.08, hidden 64) are 4-bit quantization's worst case, and
    measured 0.27 (Q4_1) and 0.33 (Q4_0) here; Q8_0 measured 0.018."""
    path = tmp_path / "m.gguf"
    write_gguf(llama, path, qtype)
    model = load_model(path, dtype="float32")
    # The file's Q8_0 / Q4_0 / Q4_1 projections run on their own blocks; the folder's stored
    # values, quantized at load to the same format, give those same blocks.
    quantization = qtype.name.lower() if qtype in QUANTIZED else None
    expected = load_model(roundtrip_folder(llama, tmp_path / "rt", qtype), dtype="float32",
                          quantization=quantization)
    if qtype in QUANTIZED:
        # The file's LM head computes the logits on its own blocks, which hold exactly the
        # values of the dense head (quantizing at load keeps the head dense).
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        assert torch.equal(dequantize(head.file_head.qweight), head.weight)
        (expected.embed_tokens if expected.lm_head is None
         else expected.lm_head).file_head = head.file_head
    got = logits(model, IDS)
    assert torch.equal(got, logits(expected, IDS))
    exact = logits(load_model(llama, dtype="float32"), IDS)
    rel = ((got - exact).norm() / exact.norm()).item()
    bound = {Q.F32: 0.0, Q.F16: 2e-3, Q.BF16: 1e-2, Q.Q8_0: 0.04, Q.Q4_0: 0.5, Q.Q4_1: 0.5}
    assert rel <= bound[qtype], rel


@pytest.mark.parametrize("qtype", (Q.BF16, Q.F16, Q.F32, Q.Q8_0), ids=lambda q: q.name)
def test_auto_dtype_follows_the_files_matrices(llama, tmp_path, qtype):
    """"auto" computes a BF16 file in bfloat16, with the logits of its stored values loaded as
    bfloat16; other files (whose values bfloat16 would round) compute in float32."""
    path = tmp_path / "m.gguf"
    write_gguf(llama, path, qtype)
    model = load_model(path)
    want = torch.bfloat16 if qtype == Q.BF16 else torch.float32
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {want}
    if qtype == Q.BF16:
        folder = roundtrip_folder(llama, tmp_path / "rt", qtype)
        assert torch.equal(logits(model, IDS), logits(load_model(folder, dtype="bfloat16"), IDS))


@pytest.mark.parametrize("qtype", (Q.F32, Q.Q8_0, Q.Q4_1), ids=lambda q: q.name)
def test_raw_blocks_are_unpermuted_hf_rows(llama, tmp_path, qtype):
    """`raw` holds each row's own blocks: what quantizing the Hugging Face weight gives."""
    path = tmp_path / "m.gguf"
    write_gguf(llama, path, qtype)
    ckpt = read_gguf(path)
    state = load_file(llama / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj"
                 ".weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        t = ckpt.tensors[name]
        assert t.ggml_type == qtype and t.shape == tuple(state[name].shape)
        want = encode(state[name].float().numpy(), qtype).view(np.uint8)
        assert t.raw.dtype == np.uint8 and t.raw.shape == (t.shape[0], want.size // t.shape[0])
        np.testing.assert_array_equal(t.raw, want.reshape(t.raw.shape))
    norm = ckpt.tensors["model.norm.weight"]
    assert norm.shape == (64,) and norm.ggml_type == Q.F32
    torch.testing.assert_close(norm.dequantize(), state["model.norm.weight"].float(), rtol=0,
                               atol=0)


def test_config_and_tokenizer(llama, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "m.gguf"
    write_gguf(llama, path, Q.F32)
    ckpt = read_gguf(path)
    assert (ckpt.spec.num_layers, ckpt.spec.num_heads, ckpt.spec.num_kv_heads,
            ckpt.spec.head_dim, ckpt.spec.vocab_size) == (2, 4, 2, 16, 320)
    assert not ckpt.spec.tie_word_embeddings and ckpt.file_type == "F32"
    assert ckpt.tokenizer.eos_token_id == 2 and "im_start" in ckpt.tokenizer.chat_template
    tok, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(llama)
    text = "def add(a, b):\n    return a + b  # héllo ✓"
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text,
                                                                    add_special_tokens=False)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_qwen2_biases_tied_embeddings(tmp_path):
    """qwen2 files are not permuted; q/k/v biases load; no output.weight means tied."""
    folder = save_model(tmp_path / "qwen", "qwen2", seed=2, tie_word_embeddings=True)
    path = tmp_path / "q.gguf"
    write_gguf(folder, path, Q.F32, arch="qwen2")
    model = load_model(path, dtype="float32")
    assert model.spec.qkv_bias and model.spec.tie_word_embeddings
    assert torch.equal(logits(model, IDS), logits(load_model(folder, dtype="float32"), IDS))


@pytest.mark.parametrize("qtype", (Q.F32, Q.Q8_0), ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ("qwen3", "gemma3"))
def test_qwen3_and_gemma3_files(tmp_path, arch, qtype):
    """Their q/k norms, Gemma's four block norms (stored 1 + w), sliding pattern, rotary bases
    and final soft-capping come from the file's metadata and names: logits equal the folder's
    (with the file's Q8_0 blocks, the folder holding the same values, quantized at load)."""
    # A GGUF holds no query_pre_attn_scalar: llama.cpp takes head_dim, as real checkpoints set.
    overrides = ({"final_logit_softcapping": 5.0, "query_pre_attn_scalar": 32}
                 if arch == "gemma3" else {})
    folder = save_model(tmp_path / arch, arch, seed=6, tie_word_embeddings=True, **overrides)
    path = tmp_path / "m.gguf"
    write_gguf(folder, path, qtype, arch=arch)
    model = load_model(path, dtype="float32")
    # The file holds eps as float32.
    assert replace(model.spec, rms_norm_eps=1e-6) == load_model(folder, dtype="float32").spec
    quantization = "q8_0" if qtype == Q.Q8_0 else None
    expected = load_model(roundtrip_folder(folder, tmp_path / "rt", qtype), dtype="float32",
                          quantization=quantization)
    if qtype == Q.Q8_0:  # the file's tied head computes on its blocks (see above)
        expected.embed_tokens.file_head = model.embed_tokens.file_head
    assert torch.equal(logits(model, IDS), logits(expected, IDS))


def test_unsupported_type_names_tensor_and_type(llama, tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, "llama")
    # 8 x 64 weights in IQ4_NL blocks (32 weights in 18 bytes): a type with no kernel or
    # conversion.
    w.add_tensor("token_embd.weight", np.zeros((8, 36), np.uint8), raw_dtype=Q.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"token_embd\.weight.*IQ4_NL.*supported types.*Q4_K"):
        read_gguf(path)
    with pytest.raises(CheckpointError, match=r"token_embd\.weight.*IQ4_NL"):
        load_model(path)


def test_unsupported_architecture_and_bad_files(tmp_path):
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'gpt2'"):
        read_gguf(path)
    with pytest.raises(GGUFError, match="no such GGUF file"):
        read_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(GGUFError, match="cannot be read as GGUF"):
        read_gguf(bad)


def test_truncated_tensor_data(llama, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(llama, path, Q.Q8_0)
    path.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(GGUFError, match=r"m\.gguf"):
        read_gguf(path)


def test_metadata_index_is_reused_and_follows_the_file(llama, tmp_path, monkeypatch):
    """A second read maps the file through the cached index (no GGUFReader); rewriting the file
    (new size and mtime) builds a new index."""
    import specserve.model.gguf as gguf_module

    path = tmp_path / "m.gguf"
    write_gguf(llama, path, Q.Q8_0)
    first = read_gguf(path)

    def no_reader(*args, **kwargs):
        raise AssertionError("GGUFReader used despite the index")

    with monkeypatch.context() as m:
        m.setattr(gguf_module, "GGUFReader", no_reader)
        again = read_gguf(path)
    assert again.spec == first.spec and again.tokenizer == first.tokenizer
    for name, t in first.tensors.items():
        assert again.tensors[name].ggml_type == t.ggml_type
        np.testing.assert_array_equal(again.tensors[name].raw, t.raw)
    write_gguf(llama, path, Q.Q4_1)
    assert read_gguf(path).tensors["lm_head.weight"].ggml_type == Q.Q4_1
