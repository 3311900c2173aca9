"""The decoder's layers as one C call (model/cpu_stack.py, kernels/cpu_decoder.c) give the same
bits as the layers run one by one on the same kernels, on every C path of this CPU: every
family's block (Qwen3's q/k norms; Gemma 3's norms, GeGLU, attention scale and sliding windows,
the prompt already past the tiny model's window of 8), dense or quantized weights, fused
projections of several block formats."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels import cpu_decoder, cpu_linear
from specserve.kernels.cpu_decoder import DecoderStack
from specserve.model.loader import load_model
from specserve.model.runner import ModelRunner, Segment
from tests.tiny_models import k_quant_tensors, save_model

PROMPT = list(range(3, 23))  # 20 tokens: within cpu_decoder.MAX_ROWS, so the stack takes it
TREE = torch.tensor([[1, 0, 0, 0, 0],  # a root and two branches of two nodes
                     [1, 1, 0, 0, 0],
                     [1, 1, 1, 0, 0],
                     [1, 1, 0, 1, 0],
                     [1, 1, 0, 1, 1]], dtype=torch.bool)


def _steps(model) -> list[torch.Tensor]:
    """Logits of a prompt, three decode steps, a batch of two requests (one decoding, one a
    prompt chunk) and a tree-masked verify step."""
    runner = ModelRunner(model, num_blocks=12, block_size=8)
    out = runner.forward([Segment(PROMPT, range(20), 0, [0, 1, 2], [19])])
    for i, token in enumerate([7, 8, 9]):
        out += runner.forward([Segment([token], [20 + i], 20 + i, [0, 1, 2, 3], [0])])
    out += runner.forward([Segment([11], [23], 23, [0, 1, 2, 3], [0]),
                           Segment(list(range(40, 52)), range(12), 0, [5, 6], [10, 11])])
    out += runner.forward([Segment([12, 13, 14, 15, 16], [24, 25, 26, 25, 26], 24,
                                   [0, 1, 2, 3, 4], range(5), mask=TREE)])
    return out


def _compare(model, monkeypatch) -> None:
    calls = []
    real = DecoderStack.run
    monkeypatch.setattr(DecoderStack, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    stacked = _steps(model)
    assert len(calls) == 6, "every forward of at most MAX_ROWS rows runs the stack"
    monkeypatch.setenv("SPECSERVE_CPU_STACK", "0")
    layered = _steps(model)
    assert len(calls) == 6
    for got, want in zip(stacked, layered, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("arch,dtype,quantization", [
    ("llama", "bfloat16", None),
    ("qwen2", "bfloat16", None),  # q/k/v biases
    ("llama", "float32", "int8"),
    ("qwen2", "float32", "int4"),
    ("llama", "bfloat16", "q4_0"),
    ("qwen3", "bfloat16", None),  # q/k norms
    ("qwen3", "float32", "int8"),
    ("gemma3", "bfloat16", None),  # sandwich norms, GeGLU, scale, windows, local rotary
    ("gemma3", "float32", "int4"),
    ("gemma3", "bfloat16", "q8_0"),
])
def test_stack_equals_the_layers_one_by_one(cpu_isa, tmp_path, monkeypatch,
                                            arch, dtype, quantization):
    path = save_model(tmp_path / arch, arch, seed=3, num_hidden_layers=3)
    _compare(load_model(path, dtype=dtype, quantization=quantization), monkeypatch)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("act", ["q8", "fp32"])
def test_stack_takes_each_activation_format(cpu_isa, tmp_path, monkeypatch, act, arch):
    monkeypatch.setenv("SPECSERVE_QUANT_ACT", act)
    path = save_model(tmp_path / "m", arch, seed=4)
    _compare(load_model(path, dtype="float32", quantization="int8"), monkeypatch)


# A Q4_K_M-like mix with a part per format: q/k/v as three products (q Q4_K, k Q6_K, v Q4_K
# again), gate/up as two; o and down one each.
MIXED = {"k_proj": "Q6_K", "up_proj": "Q6_K", "down_proj": "Q6_K"}


@pytest.mark.parametrize("arch,dtype,act", [
    ("llama", "bfloat16", "q16"),
    ("qwen2", "float32", "q8"),  # q/k/v biases, cut at the parts' rows
    ("llama", "float32", "fp32"),
])
def test_stack_runs_projections_of_several_formats(cpu_isa, tmp_path, monkeypatch, arch, dtype,
                                                   act):
    from specserve.model.quant import QuantizedParts, use_file_blocks

    monkeypatch.setenv("SPECSERVE_QUANT_ACT", act)
    path = save_model(tmp_path / arch, arch, seed=5, hidden_size=256, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2)
    model = load_model(path, dtype=dtype)
    use_file_blocks(model, k_quant_tensors(path, MIXED))
    qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    assert isinstance(qkv, QuantizedParts) and len(qkv.parts) == 3
    assert isinstance(gate_up, QuantizedParts) and len(gate_up.parts) == 2
    _compare(model, monkeypatch)


def test_fp32_dense_weights_go_layer_by_layer(tiny_target, monkeypatch):
    model = load_model(tiny_target, dtype="float32")
    calls = []
    monkeypatch.setattr(DecoderStack, "run", lambda *a, **k: calls.append(1))
    _steps(model)
    assert calls == []


@pytest.mark.parametrize("dtype,quantization", [("float32", "int4"), ("bfloat16", None)])
def test_many_rows_run_the_stack_where_the_layers_take_its_kernels(cpu_isa, dtype, quantization,
                                                                   tmp_path, monkeypatch):
    """Past MAX_ROWS (a long prompt chunk, many chats in one batch) the stack still runs, and
    gives the layers' bits, when every projection is quantized, or bf16 on a path whose C
    kernels take every bf16 product (avx2, portable); where the layers hand many bf16 rows to
    F.linear (amx, avx512) those forwards go layer by layer."""
    path = save_model(tmp_path / "m", "llama", seed=6, num_hidden_layers=2)
    model = load_model(path, dtype=dtype, quantization=quantization)
    rows = 2 * cpu_decoder.MAX_ROWS + 3

    def forwards() -> list[torch.Tensor]:
        runner = ModelRunner(model, num_blocks=24, block_size=8)
        out = runner.forward([Segment(list(range(3, 3 + rows)), range(rows), 0, range(12),
                                      range(rows))])
        return out + runner.forward([Segment([5], [rows], rows, range(12), [0])])

    calls = []
    real = DecoderStack.run
    monkeypatch.setattr(DecoderStack, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    stacked = forwards()
    takes_many = quantization is not None or cpu_isa not in cpu_linear.MAX_ROWS
    assert len(calls) == (2 if takes_many else 1)  # the decode step runs the stack on any path
    monkeypatch.setenv("SPECSERVE_CPU_STACK", "0")
    for got, want in zip(stacked, forwards(), strict=True):
        assert torch.equal(got, want)


def test_moving_the_model_rebuilds_the_stack(tiny_target):
    model = load_model(tiny_target, dtype="bfloat16")
    want = _steps(model)
    assert "_cpu_stacks" in model.__dict__ or cpu_decoder.library() is None
    model._apply(torch.clone)  # what .to() does: every weight in new storage
    assert "_cpu_stacks" not in model.__dict__
    for got, expected in zip(_steps(model), want, strict=True):
        assert torch.equal(got, expected)


def test_bad_positions_and_settings_are_clear_errors(tiny_target, monkeypatch):
    if cpu_decoder.library() is None:
        pytest.skip("no C kernel build on this machine")
    model = load_model(tiny_target, dtype="bfloat16")
    runner = ModelRunner(model, num_blocks=4, block_size=8)
    before = runner.kv_cache.clone()
    with pytest.raises(IndexError, match="rotary positions"):
        runner.forward([Segment([5], [model.spec.max_position_embeddings], 0, [0], [0])])
    with pytest.raises(IndexError, match="slot is past the cache"):
        runner.forward([Segment([5], [0], 0, [4], [0])])  # block 4 of a 4-block cache
    assert torch.equal(runner.kv_cache, before)  # nothing written before either error
    monkeypatch.setenv("SPECSERVE_CPU_STACK", "yes")
    with pytest.raises(ValueError, match="SPECSERVE_CPU_STACK"):
        runner.forward([Segment([5], [0], 0, [0], [0])])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_matches_torch(cpu_isa, dtype):
    gate_up = (torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    got = cpu_decoder.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.dtype == dtype and got.shape == want.shape
    # expf and torch's vectorised exp may differ in the last bit, which bf16 rounding hides
    # almost always and fp32 shows as a few ulp.
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)
        assert (got == want).float().mean() > 0.99
    else:
        torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_tanh_mul_matches_torch(cpu_isa, dtype):
    """GeGLU: within a few fp32 ulp of torch's where torch's 1 + tanh keeps its bits (g > -1);
    below, where it cancels (every bit at g < -6), within 2^-7 relative or 1e-6 absolute."""
    gate_up = (torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    got = cpu_decoder.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    assert got.dtype == dtype and got.shape == want.shape
    near = gate > -1
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got[near], want[near], rtol=2 ** -7, atol=0)
        assert (got == want)[near].float().mean() > 0.99
    else:
        torch.testing.assert_close(got[near], want[near], rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    special = torch.tensor([float("nan"), float("inf"), 0.0, -0.0, 20.0, -20.0, 1e-30, -1e-30])
    got = cpu_decoder.gelu_tanh_mul(torch.cat([special, torch.ones_like(special)])[None])[0]
    torch.testing.assert_close(got, F.gelu(special, approximate="tanh"), rtol=0, atol=0,
                               equal_nan=True)


def test_silu_mul_is_the_same_on_any_thread_count(cpu_isa):
    gate_up = torch.randn(5, 2 * 4099, generator=torch.Generator().manual_seed(1)).to(
        torch.bfloat16)  # rows of 4099: chunks split inside rows, a ragged last one
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_decoder.silu_mul(gate_up)
        torch.set_num_threads(2)
        assert torch.equal(cpu_decoder.silu_mul(gate_up), alone)
    finally:
        torch.set_num_threads(threads)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(alone, F.silu(gate) * up, rtol=2 ** -7, atol=0)


def test_silu_mul_exponential_range_and_special_values(cpu_isa):
    """The kernel's own exponential: within 2 ulp of the true silu over [-88.5, 100] in fp32,
    where e^-g is finite (torch's own is within 1.5), and torch's results at NaN, infinities,
    zeros and where e^-g overflows or underflows."""
    gate = torch.linspace(-88.5, 100, 400_001)
    got = cpu_decoder.silu_mul(torch.cat([gate, torch.ones_like(gate)])[None])[0]
    truth = gate.double() / (1 + torch.exp(-gate.double()))
    ulps = (got.double() - truth).abs() / (truth.abs() * torch.finfo(torch.float32).eps)
    assert ulps[truth != 0].max() <= 2
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.0, -88.0,
                            89.0, -89.0, 100.0, -100.0, 1e-30, -1e-30])
    got = cpu_decoder.silu_mul(torch.cat([special, torch.ones_like(special)])[None])[0]
    torch.testing.assert_close(got, F.silu(special), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.signbit(), F.silu(special).signbit())


def test_stack_is_dropped_for_unsupported_weights():
    norm = torch.ones(16, dtype=torch.bfloat16)
    dense = cpu_decoder.Projection([cpu_decoder.Part(torch.zeros(16, 16), None)])  # fp32
    layer = cpu_decoder.LayerWeights(norm, norm, dense, dense, dense, dense, torch.ones(4, 8),
                                     torch.zeros(4, 8))
    assert "bf16" in DecoderStack.unsupported([layer], torch.bfloat16, 16)
    with pytest.raises(ValueError, match="DecoderStack"):
        DecoderStack([layer], num_heads=1, num_kv_heads=1, head_dim=16, eps=1e-6,
                     dtype=torch.bfloat16)
