"""Weight-only quantized models (specserve/model/quant.py) against their unquantized selves."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.kernels import quant_cpu
from specserve.model.loader import load_model
from specserve.model.quant import QuantizedLinear, resolve_quantization
from specserve.model.runner import ModelRunner, Segment
from tests.tiny_models import k_quant_tensors, save_model

# (mean, max) |logit difference| relative to the unquantized logits' standard deviation, on tiny
# random models (hidden 64, Gaussian weights): int8 rounds each weight within 1/254 of its
# block's largest, int4 within 1/30 of its block's range. Measured: int8 0.012 / 0.078, int4
# 0.17 / 0.92 (the worst of the three models).
REL_TOL = {"int8": (0.02, 0.12), "int4": (0.25, 1.4)}


def _logits(model, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    return runner.forward([Segment(ids, range(len(ids)), 0, [0, 1, 2, 3], range(len(ids)))])[0]


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}),
                                            ("llama", {"tie_word_embeddings": True})],
                         ids=["llama", "qwen2-bias", "llama-tied"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_logits_close_to_unquantized(tmp_path, arch, overrides, quantization):
    path = save_model(tmp_path / arch, arch, seed=5, **overrides)
    ids = torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    want = _logits(load_model(path, dtype="float32"), ids)  # [37, vocab]
    model = load_model(path, dtype="float32", quantization=quantization)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * 2  # qkv, o, gate_up, down per layer
    got = _logits(model, ids)
    diff = (got - want).abs() / want.std()
    mean_tol, max_tol = REL_TOL[quantization]
    assert 0 < float(diff.mean()) < mean_tol and float(diff.max()) < max_tol, diff


def test_bf16_model_quantizes_too(tmp_path):
    path = save_model(tmp_path / "bf16", "llama", seed=6, dtype=torch.bfloat16)
    ids = list(range(3, 40))
    want = _logits(load_model(path, dtype="bfloat16"), ids)
    got = _logits(load_model(path, dtype="bfloat16", quantization="int8"), ids)
    diff = (got - want).abs() / want.std()
    mean_tol, max_tol = REL_TOL["int8"]
    assert 0 < float(diff.mean()) < mean_tol and float(diff.max()) < max_tol, diff


def _cpu_order(linear) -> int:
    """The row order the CPU kernel takes for this layer (the default integer activations):
    tiled when its rows fill whole tiles, else grouped."""
    from specserve.kernels.quant_reference import ROW_GROUP, TILE_ROWS

    return TILE_ROWS if linear.qweight.shape[0] % TILE_ROWS == 0 else ROW_GROUP


def test_cpu_blocks_are_kept_in_the_cpu_kernels_row_order(tiny_target, monkeypatch):
    """On the CPU, the C kernel's tiled or grouped row order; moved off it, GGUF's own again
    (the Triton kernel's), with the same weight either way."""
    from specserve.kernels.quant_reference import ROW_GROUP, TILE_ROWS, dequantize

    monkeypatch.delenv("SPECSERVE_QUANT_ACT", raising=False)
    model = load_model(tiny_target, dtype="float32", quantization="int8")
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.qweight.row_group for m in linears} == {_cpu_order(m) for m in linears}
    assert TILE_ROWS in {m.qweight.row_group for m in linears}  # the tiny model has whole tiles
    linear = linears[0]
    assert linear.qweight.row_group == _cpu_order(linear) and linear.qweight.blocks is linear.blocks
    weight = dequantize(linear.qweight)
    linear.to("meta")  # any other device
    assert linear.qweight.row_group == 1 and linear.blocks.device.type == "meta"
    assert linear.qweight.blocks is linear.blocks
    model = load_model(tiny_target, dtype="float32", quantization="int8")
    linear = next(m for m in model.modules() if isinstance(m, QuantizedLinear))
    moved = linear.qweight.with_row_group(1)
    linear.blocks = moved.blocks  # as if it came back from a GPU in GGUF's order
    linear.qweight = moved
    linear.to("cpu")
    assert linear.qweight.row_group == _cpu_order(linear)
    assert torch.equal(dequantize(linear.qweight), weight)
    monkeypatch.setenv("SPECSERVE_QUANT_ACT", "fp32")  # the tiled order is the integer kernel's
    model = load_model(tiny_target, dtype="float32", quantization="int8")
    assert {m.qweight.row_group for m in model.modules() if isinstance(m, QuantizedLinear)} \
        == {ROW_GROUP}


def test_decode_rows_take_the_cpu_kernel(tiny_target, monkeypatch):
    """Layer by layer (the whole stack in C calls the same kernel from C: test_cpu_stack)."""
    if quant_cpu.library() is None:
        pytest.skip("no C kernel build on this machine")
    monkeypatch.setenv("SPECSERVE_CPU_STACK", "0")
    calls = []
    real = quant_cpu.run_quant_matmul  # the C call, after quant_linear's checks
    monkeypatch.setattr(quant_cpu, "run_quant_matmul",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    model = load_model(tiny_target, dtype="float32", quantization="int8")
    _logits(model, [5, 6, 7])
    assert len(calls) == 2 * 4


@pytest.fixture(scope="module")
def int8_expected(tiny_target):
    llm = LLM(tiny_target, speculation="off", quantization="int8")
    prompts = [[7, 8, 9, 10] * 3, [40, 41, 42] * 5, list(range(100, 130))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return prompts, params, [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("mode", ["chain:4", "tree:12", "adaptive"])
def test_greedy_speculation_equals_plain_quantized_target(tiny_target, tiny_draft,
                                                          int8_expected, mode):
    prompts, params, want = int8_expected
    llm = LLM(tiny_target, tiny_draft, quantization="int8", num_blocks=160, block_size=8)
    assert [o.token_ids for o in llm.generate(prompts, params, speculation=mode)] == want
    # One request at a time too: different row counts per forward, the same tokens.
    assert llm.generate([prompts[1]], params, speculation=mode)[0].token_ids == want[1]


def test_draft_quantization_defaults_to_the_targets(tiny_target, tiny_draft):
    def formats(model):
        return {m.qweight.fmt.name for m in model.modules() if isinstance(m, QuantizedLinear)}

    llm = LLM(tiny_target, tiny_draft, quantization="int4", num_blocks=64)
    assert formats(llm.engine.target) == formats(llm.engine.draft) == {"Q4_1"}
    llm = LLM(tiny_target, tiny_draft, quantization="int8", draft_quantization="none",
              num_blocks=64)
    assert formats(llm.engine.target) == {"Q8_0"} and formats(llm.engine.draft) == set()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_drafts_head_computes_on_blocks(tiny_target, tiny_draft, quantization):
    """A draft loaded for its target quantizes its LM head too (the target keeps its own dense:
    its logits decide the output): the logits are the quantized kernel's product with the
    head's blocks, within quantization's tolerance of the dense head's."""
    from specserve.kernels.quant import quant_linear
    from specserve.kernels.quant_reference import quantize

    target = load_model(tiny_target, dtype="float32", quantization=quantization)
    assert target.embed_tokens.file_head is None and target.lm_head.file_head is None
    dense = load_model(tiny_draft, dtype="float32")
    draft = load_model(tiny_draft, dtype="float32", quantization=quantization, target=target)
    fmt = resolve_quantization(quantization)
    assert draft.lm_head.file_head.qweight.fmt.name == fmt
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    got = draft.compute_logits(hidden)  # [5, vocab]
    assert torch.equal(got, quant_linear(hidden, quantize(dense.lm_head.weight.data, fmt)))
    want = dense.compute_logits(hidden)
    diff = (got - want).abs() / want.std()
    mean_tol, max_tol = REL_TOL[quantization]
    assert 0 < float(diff.mean()) < mean_tol and float(diff.max()) < max_tol, diff


def test_a_draft_of_a_target_on_gguf_blocks_defaults_to_int8(tiny_target, tiny_draft):
    """Nothing asked: a draft follows its target's quantization, and runs in int8 (head
    included) beside a target on a GGUF's quantized blocks; "none" keeps it dense, and a
    named quantization is kept as named."""
    from specserve.model.quant import draft_quantization, use_file_blocks

    dense_target = load_model(tiny_target, dtype="float32")
    assert draft_quantization(dense_target, None) is None
    on_blocks = load_model(tiny_target, dtype="float32")
    use_file_blocks(on_blocks, _gguf_like_tensors(tiny_target, "Q4_1"))
    assert draft_quantization(on_blocks, None) == "int8"
    assert draft_quantization(on_blocks, "none") == "none"
    assert draft_quantization(on_blocks, "int4") == "int4"
    draft = load_model(tiny_draft, dtype="float32",
                       quantization=draft_quantization(on_blocks, None), target=on_blocks)
    formats = {m.qweight.fmt.name for m in draft.modules() if isinstance(m, QuantizedLinear)}
    assert formats == {"Q8_0"} and draft.lm_head.file_head is not None


def test_unknown_quantization_is_named(tiny_target):
    with pytest.raises(ValueError, match="'int3'"):
        LLM(tiny_target, quantization="int3")
    with pytest.raises(ValueError, match="'fp8'"):
        LLM(tiny_target, quantization="int8", draft_quantization="fp8")
    assert resolve_quantization("INT8") == "Q8_0" and resolve_quantization("none") is None


def test_cli_flag_errors_cleanly(tiny_target, capsys):
    from specserve.cli import main

    assert main(["generate", "--target", str(tiny_target), "--prompt", "hi",
                 "--quantization", "int5"]) == 2
    assert "'int5'" in capsys.readouterr().err


def _gguf_like_tensors(path, fmt: str, mixed_layer: int | None = None) -> dict:
    """The checkpoint's linear weights as GGUF tensors of type fmt (one F16 part in layer
    mixed_layer's q/k/v)."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType
    from safetensors.torch import load_file

    from specserve.kernels.quant_reference import quantize

    tensors = {}
    for name, w in load_file(str(path / "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            continue
        mixed = f"model.layers.{mixed_layer}.self_attn.v_proj.weight"
        qtype = "F16" if name == mixed else fmt
        raw = (quantize(w, fmt).blocks.numpy() if qtype != "F16"
               else w.to(torch.float16).view(torch.uint8).numpy())
        tensors[name] = SimpleNamespace(ggml_type=GGMLQuantizationType[qtype],
                                        shape=tuple(w.shape), raw=raw)
    return tensors


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_run_as_stored(tiny_target, fmt):
    """A GGUF file's quantized blocks give exactly what quantizing the same weights at load does."""
    from specserve.model.quant import use_file_blocks

    ids = list(range(3, 30))
    want = _logits(load_model(tiny_target, dtype="float32", quantization=fmt.lower()), ids)
    model = load_model(tiny_target, dtype="float32")
    replaced = use_file_blocks(model, _gguf_like_tensors(tiny_target, fmt))
    assert len(replaced) == 2 * 4
    assert torch.equal(_logits(model, ids), want)


def test_gguf_mixed_types_keep_the_loaded_weight(tiny_target):
    from specserve.model.quant import use_file_blocks

    model = load_model(tiny_target, dtype="float32")
    replaced = use_file_blocks(model, _gguf_like_tensors(tiny_target, "Q8_0", mixed_layer=1))
    assert "layers.1.self_attn.qkv_proj" not in replaced and len(replaced) == 2 * 4 - 1
    assert not isinstance(model.get_submodule("layers.1.self_attn.qkv_proj"), QuantizedLinear)


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_gguf_head_computes_logits_on_the_file_blocks(tmp_path, tied, fmt):
    """A GGUF's quantized LM head (the embedding when tied) computes the logits on its blocks:
    the quantized kernel's product with them, within its rounding of the dense product with
    their dequantization (what the head's weight holds), and each tensor-parallel rank holds
    its vocabulary rows of the blocks."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType

    from specserve.distributed import TPShard
    from specserve.kernels.quant import quant_linear
    from specserve.kernels.quant_reference import dequantize, quantize
    from specserve.model.quant import use_file_blocks

    path = save_model(tmp_path / "m", "llama", seed=7, tie_word_embeddings=tied)
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    for shard in (None, TPShard(0, 2), TPShard(1, 2)):
        model = load_model(path, dtype="float32", **({} if shard is None else {"shard": shard}))
        head = model.embed_tokens if tied else model.lm_head
        whole = head.weight if shard is None else load_model(path, dtype="float32").get_submodule(
            "embed_tokens" if tied else "lm_head").weight
        qw = quantize(whole.data, fmt)
        tensors = {name: SimpleNamespace(ggml_type=GGMLQuantizationType[fmt],
                                         shape=qw.shape, raw=qw.blocks.numpy())}
        replaced = use_file_blocks(model, tensors)
        assert replaced == ["embed_tokens" if tied else "lm_head"]
        rows = head.file_head.qweight.block_rows().flatten(1)  # [shard_size, bytes], by row
        end = min(head.vocab_start + head.shard_size, qw.shape[0])
        assert torch.equal(rows[:end - head.vocab_start], qw.blocks[head.vocab_start:end])
        assert not rows[end - head.vocab_start:].any()  # padding rows: zero weights
        if shard is not None:
            continue
        head.weight.data.copy_(dequantize(qw))  # as the GGUF loader fills it
        hidden = torch.randn(5, whole.shape[1], generator=torch.Generator().manual_seed(1))
        got = model.compute_logits(hidden)  # [5, vocab]
        assert torch.equal(got, quant_linear(hidden, qw))
        torch.testing.assert_close(got, hidden @ dequantize(qw).T, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory):
    """A tiny llama whose widths are whole k-quant super-blocks (256)."""
    return save_model(tmp_path_factory.mktemp("wide"), "llama", seed=8, hidden_size=256,
                      intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def test_gguf_k_quants_and_mixed_parts_run_on_their_blocks(wide_target, monkeypatch):
    """A Q4_K_M-like file (Q4_K projections, v and down in Q6_K): every projection runs on the
    file's blocks, q/k/v as one product per format (QuantizedParts), and with fp32 activations
    the logits are those of the dequantized weights but for the order of fp32 sums."""
    from specserve.kernels.quant import quant_linear
    from specserve.kernels.quant_reference import dequantize
    from specserve.model.quant import QuantizedParts, use_file_blocks

    monkeypatch.setenv("SPECSERVE_QUANT_ACT", "fp32")
    tensors = k_quant_tensors(wide_target, {"v_proj": "Q6_K", "down_proj": "Q6_K"})
    ids = list(range(3, 30))
    model = load_model(wide_target, dtype="float32")
    replaced = use_file_blocks(model, tensors)
    assert len(replaced) == 2 * 4
    qkv = model.get_submodule("layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, QuantizedParts)
    assert [p.qweight.fmt.name for p in qkv.parts] == ["Q4_K", "Q6_K"]  # q and k fused: one product
    assert model.get_submodule("layers.1.mlp.down_proj").qweight.fmt.name == "Q6_K"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    assert torch.equal(qkv(x), torch.cat([quant_linear(x, p.qweight) for p in qkv.parts], -1))
    # The same model with dense weights holding the blocks' exact values, in the fused rows'
    # order (q, k, v): what the parts' concatenated outputs must match.
    dense = load_model(wide_target, dtype="float32")
    for name in replaced:
        module = model.get_submodule(name)
        parts = module.parts if isinstance(module, QuantizedParts) else [module]
        dense.get_submodule(name).weight.data.copy_(torch.cat([dequantize(p.qweight)
                                                                for p in parts]))
    torch.testing.assert_close(_logits(model, ids), _logits(dense, ids), rtol=1e-4, atol=1e-4)


def test_gguf_k_quant_split_inside_a_super_block_keeps_the_loaded_weight(wide_target):
    """Tensor parallelism at 2 ranks gives o_proj's rank 128 input columns: a Q4_K super-block
    (256) would be cut, so that linear keeps its dequantized weight; the others (down_proj: 256
    columns a rank) run on blocks."""
    from specserve.distributed import TPShard
    from specserve.model.parallel import RowParallelLinear
    from specserve.model.quant import use_file_blocks

    model = load_model(wide_target, dtype="float32", shard=TPShard(1, 2))
    replaced = use_file_blocks(model, k_quant_tensors(wide_target, {}))
    assert "layers.0.self_attn.o_proj" not in replaced
    assert isinstance(model.get_submodule("layers.0.self_attn.o_proj"), RowParallelLinear)
    assert "layers.0.self_attn.qkv_proj" in replaced and "layers.0.mlp.down_proj" in replaced
