"""Tests of draft_models/widen.py: a widened checkpoint computes the same function as its source.

Tiny random Llama (tied head; or biases everywhere) and Qwen2 (q/k/v biases, untied head, sharded
files) checkpoints are widened and loaded with transformers: logits match to float32 rounding and
greedy `generate` agrees, from float32 and from bfloat16 files. The tiny models use a large RMSNorm
epsilon and random norm weights and biases, so a wrong epsilon or norm rescale, a misplaced head
or bias shows far above the tolerance; negative controls check that the extra heads, MLP channels
and layers really compute something that only the zero write-back hides.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specserve.draft_models import widen as widen_mod
from specserve.draft_models.widen import (
    WidenSpec,
    ensure_widened,
    ensure_widened_demo,
    main,
    plan_widening,
    query_head_positions,
    widen_checkpoint,
)
from specserve.model.loader import load_model
from specserve.model.runner import ModelRunner, Segment

VOCAB = 300
PROMPT_LEN, NEW_TOKENS = 12, 16
# float32 logits are O(1); reordered reductions over exact zeros move them by ~1e-6.
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These models are tiny: one thread is fastest, and on a busy machine two OpenMP threads
    fighting other processes for the cores made the module ~5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(arch: str) -> PreTrainedModel:
    """Random-init tiny model: hidden 64, head_dim 16, 4 q / 2 kv heads, 2 layers."""
    torch.manual_seed(0)
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        # A large eps: forgetting to divide it by k changes the logits by far more than TOL.
        "rms_norm_eps": 1e-2,
        "initializer_range": 0.1,
        "bos_token_id": None,
        "eos_token_id": None,  # greedy generate always runs NEW_TOKENS steps
    }
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(head_dim=16, tie_word_embeddings=True, **common))
    elif arch == "llama-biases":  # every projection has a bias, o_proj and down_proj included
        config = LlamaConfig(
            attention_bias=True, mlp_bias=True, tie_word_embeddings=False, **common
        )
        model = LlamaForCausalLM(config)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
    with torch.no_grad():
        # transformers initialises norms to 1 and biases to 0: randomise them so their placement
        # and rescaling are tested too.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Saved tiny checkpoints: ``{arch}`` in float32 and ``{arch}-bf16`` in bfloat16."""
    root = tmp_path_factory.mktemp("widen-src")
    out: dict[str, Path] = {}
    for arch in ("llama", "llama-biases", "qwen2"):
        model = _tiny(arch)
        # Qwen2 is saved in shards so the index path of the loader is exercised.
        shard = "40KB" if arch == "qwen2" else "100MB"
        model.save_pretrained(root / arch, max_shard_size=shard)
        model.to(torch.bfloat16).save_pretrained(root / f"{arch}-bf16", max_shard_size=shard)
        out[arch], out[f"{arch}-bf16"] = root / arch, root / f"{arch}-bf16"
    assert (out["qwen2"] / "model.safetensors.index.json").is_file()
    assert (out["llama"] / "model.safetensors").is_file()
    return out


def _load(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _greedy(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
    )
    return out[:, ids.shape[1] :]  # [2, NEW_TOKENS]


def _assert_same_function(src: PreTrainedModel, wide: PreTrainedModel) -> None:
    ids = _prompt()  # [2, PROMPT_LEN]
    with torch.no_grad():
        a = src(ids, output_hidden_states=True)
        b = wide(ids, output_hidden_states=True)
    torch.testing.assert_close(b.logits, a.logits, **TOL)
    # Not a degenerate model whose logits agree because they are all alike.
    assert a.logits.std() > 0.3
    h = src.config.hidden_size
    # The stream invariant itself: extra channels exactly zero after every layer, original channels
    # equal layer by layer (the last entry is after the final norm in both models).
    for i, hs in enumerate(b.hidden_states):
        assert torch.count_nonzero(hs[..., h:]) == 0, f"extra channels non-zero at layer {i}"
    for i in range(src.config.num_hidden_layers):
        torch.testing.assert_close(b.hidden_states[i][..., :h], a.hidden_states[i], **TOL)
    torch.testing.assert_close(b.hidden_states[-1][..., :h], a.hidden_states[-1], **TOL)
    assert torch.equal(_greedy(wide, ids), _greedy(src, ids))


CASES = {
    # name: (source, spec)
    "llama-x4": ("llama", WidenSpec(hidden_size=256, num_layers=4, intermediate_size=256)),
    "llama-x16": ("llama", WidenSpec(hidden_size=1024, num_layers=3, intermediate_size=128)),
    # 32 heads x 16 = 512 attention channels: wider than the 256-channel stream.
    "llama-biases-x4": (
        "llama-biases",
        WidenSpec(256, num_layers=3, intermediate_size=128, num_heads=32, num_kv_heads=4),
    ),
    "qwen2-x4": (
        "qwen2",
        WidenSpec(256, num_layers=3, intermediate_size=200, num_heads=16, num_kv_heads=4),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_widened_float32_computes_the_same_function(
    case: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    arch, spec = CASES[case]
    dst = widen_checkpoint(sources[arch], tmp_path / "wide", spec)
    src, wide = _load(sources[arch]), _load(dst)

    cfg = wide.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (
        spec.hidden_size,
        spec.num_layers,
        spec.intermediate_size,
    )
    assert cfg.num_attention_heads == (spec.num_heads or spec.hidden_size // 16)
    assert cfg.num_key_value_heads == (spec.num_kv_heads or 2)
    assert cfg.head_dim == 16 and cfg.vocab_size == VOCAB
    assert cfg.tie_word_embeddings == src.config.tie_word_embeddings
    assert wide.num_parameters() > 4 * src.num_parameters()
    _assert_layout(load_file(dst / "model.safetensors"), h=64, layers=2)
    _assert_same_function(src, wide)


def _assert_layout(tensors: dict[str, torch.Tensor], h: int, layers: int) -> None:
    """Zero where the stream is written (and in the head), non-zero everywhere it is read."""
    for name, t in tensors.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if name.endswith(("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")):
            extra = t if layer >= layers else t[h:]  # identity layers write nothing at all
            assert torch.count_nonzero(extra) == 0, name
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            assert torch.count_nonzero(t[:, h:]) == 0, name
        elif "norm" in name:
            assert torch.count_nonzero(t[h:]) == 0, name
        else:  # q/k/v/gate/up: random (a normal sample is exactly 0 about once in 10**7)
            assert torch.count_nonzero(t) > 0.999 * t.numel(), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("from_bf16", [False, True], ids=["f32-to-bf16", "bf16-to-auto"])
def test_widened_bfloat16_computes_the_same_function(
    arch: str, from_bf16: bool, sources: dict[str, Path], tmp_path: Path
) -> None:
    """bf16 files, run in float32: widening must round nothing beyond the plain bf16 cast."""
    src_dir = sources[f"{arch}-bf16"] if from_bf16 else sources[arch]
    dst = tmp_path / "wide"
    argv = [str(src_dir), str(dst), "--hidden-size", "256", "--num-layers", "4"]
    argv += ["--intermediate-size", "160"] + ([] if from_bf16 else ["--dtype", "bfloat16"])
    assert main(argv) == 0

    assert {t.dtype for t in load_file(dst / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    _assert_same_function(_load(sources[f"{arch}-bf16"]), _load(dst))


@torch.no_grad()
def _ours(path: Path, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """specserve's loader and runner in float32: prompt logits [len, V] and NEW_TOKENS greedy."""
    runner = ModelRunner(load_model(path, dtype="float32"), num_blocks=8, block_size=16)
    table = [3, 0, 5, 1]
    logits = runner.forward([Segment(ids, range(len(ids)), 0, table, range(len(ids)))])[0]
    tokens = [int(logits[-1].argmax())]
    for pos in range(len(ids), len(ids) + NEW_TOKENS - 1):
        row = runner.forward([Segment([tokens[-1]], [pos], pos, table, [0])])[0]
        tokens.append(int(row[0].argmax()))
    return logits, tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_widened_bfloat16_through_our_loader(
    arch: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """From bf16 files, specserve's loader sees the source's function and transformers' logits."""
    src_dir = sources[f"{arch}-bf16"]
    dst = widen_checkpoint(src_dir, tmp_path / "wide", WidenSpec(256, num_layers=4,
                                                                 intermediate_size=160))
    ids = _prompt()[0].tolist()
    src_logits, src_tokens = _ours(src_dir, ids)
    wide_logits, wide_tokens = _ours(dst, ids)
    torch.testing.assert_close(wide_logits, src_logits, **TOL)
    assert wide_tokens == src_tokens
    with torch.no_grad():
        hf = _load(dst)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(wide_logits, hf, **TOL)
    assert wide_tokens == _greedy(_load(dst), torch.tensor([ids]))[0].tolist()


def test_extra_parts_compute_but_write_nothing(sources: dict[str, Path], tmp_path: Path) -> None:
    """Negative controls: extra heads, MLP channels and layers carry non-zero activations, so
    giving their write-back a non-zero weight changes the logits. This is also what shows that
    the logit comparison above is sensitive at all."""
    spec = WidenSpec(hidden_size=256, num_layers=3, intermediate_size=128)
    dst = widen_checkpoint(sources["llama"], tmp_path / "wide", spec)
    ids = _prompt()
    plan = plan_widening(json.loads((sources["llama"] / "config.json").read_text()), spec)
    extra_head = next(h for h in range(plan.new_num_heads) if h not in plan.query_positions)
    write_backs = {  # module: its write-back columns fed by extra parts only
        "extra head": (
            "model.layers.0.self_attn.o_proj",
            slice(16 * extra_head, 16 * extra_head + 16),
        ),
        "extra MLP channels": ("model.layers.1.mlp.down_proj", slice(96, 128)),
        "extra layer attention": ("model.layers.2.self_attn.o_proj", slice(None)),
        "extra layer MLP": ("model.layers.2.mlp.down_proj", slice(None)),
    }
    for what, (name, cols) in write_backs.items():
        wide = _load(dst)
        proj = wide.get_submodule(name)
        with torch.no_grad():
            base = wide(ids).logits
            assert torch.count_nonzero(proj.weight[:, cols]) == 0, what
            proj.weight[:64, cols] = 0.5
            changed = wide(ids).logits
        assert (changed - base).abs().max() > 100 * TOL["atol"], f"{what} computes nothing"


def test_gqa_placement() -> None:
    assert query_head_positions(4, 2, 16, 2) == (0, 1, 8, 9)
    assert query_head_positions(4, 2, 16, 4) == (0, 1, 4, 5)
    assert query_head_positions(4, 4, 8, 4) == (0, 2, 4, 6)
    assert query_head_positions(4, 2, 4, 2) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="groups of 1"):
        query_head_positions(4, 2, 8, 8)
    with pytest.raises(ValueError, match="kv heads cannot shrink"):
        query_head_positions(4, 2, 4, 1)


@pytest.mark.parametrize("hidden", [128, 192, 512, 100])
def test_growth_must_be_a_power_of_4(
    hidden: int, sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = WidenSpec(hidden_size=hidden, num_layers=2, intermediate_size=96)
    match = "whole factor" if hidden == 100 else "power of 4"
    with pytest.raises(ValueError, match=match):
        widen_checkpoint(sources["llama"], tmp_path / "wide", spec)
    assert not (tmp_path / "wide").exists()
    # The CLI turns it into a usage error (exit status 2) with the same message.
    argv = [str(sources["llama"]), str(tmp_path / "wide"), "--hidden-size", str(hidden)]
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--num-layers", "2", "--intermediate-size", "96"])
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_shrinking_is_rejected(sources: dict[str, Path], tmp_path: Path) -> None:
    for spec, match in (
        (WidenSpec(256, num_layers=1, intermediate_size=96), "num_layers cannot shrink"),
        (WidenSpec(256, num_layers=2, intermediate_size=64), "intermediate_size cannot shrink"),
        (WidenSpec(256, num_layers=2, intermediate_size=96, num_heads=2), "query heads"),
    ):
        with pytest.raises(ValueError, match=match):
            widen_checkpoint(sources["llama"], tmp_path / "wide", spec)


def test_ensure_widened_builds_once_and_rebuilds_on_change(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in sources["llama"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    spec = WidenSpec(hidden_size=256, num_layers=3, intermediate_size=128, dtype="bfloat16")
    cache = tmp_path / "cache" / "widened"

    out = ensure_widened(src, cache, spec)
    assert out == cache
    card = (cache / "README.md").read_text()
    assert "synthetic" in card and "equal" in card and "256" in card
    first = (cache / "model.safetensors").stat()
    assert not any(p.name.startswith(".") for p in cache.parent.iterdir())  # no leftover tmp

    ensure_widened(src, cache, spec)  # same source and spec: reused, not rewritten
    again = (cache / "model.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

    (src / "generation_config.json").write_text('{"do_sample": false}')  # the source changed
    ensure_widened(src, cache, spec)
    assert (cache / "model.safetensors").stat().st_ino != first.st_ino
    assert json.loads((cache / "generation_config.json").read_text()) == {"do_sample": False}

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError):
        ensure_widened(src, foreign, spec)
    assert (foreign / "notes.txt").exists()  # never deletes a folder it did not build


def test_ensure_widened_demo_refuses_the_repository(tmp_path: Path) -> None:
    inside = Path(widen_mod.__file__).resolve().parent / "widened-demo-target"
    with pytest.raises(ValueError, match="inside the repository"):
        ensure_widened_demo(inside)
    assert not inside.exists()


@pytest.mark.slow
@pytest.mark.skipif(
    not (widen_mod.DEMO_TARGET_DIR / "config.json").is_file(), reason="demo target not built yet"
)
def test_widened_demo_matches_demo_target(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The real fixture (~750 MB bf16): same greedy tokens and close logits as the demo target."""
    cache = ensure_widened_demo(tmp_path_factory.mktemp("demo") / "widened-demo-target")
    src = AutoModelForCausalLM.from_pretrained(widen_mod.DEMO_TARGET_DIR, dtype=torch.bfloat16)
    src = src.float().eval()
    wide = _load(cache)
    assert wide.config.hidden_size == 1024 and wide.config.num_hidden_layers == 24
    ids = torch.randint(
        0, src.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(wide(ids).logits, src(ids).logits, rtol=1e-3, atol=1e-3)
    assert torch.equal(_greedy(wide, ids), _greedy(src, ids))
    ours_logits, ours_tokens = _ours(cache, ids[0].tolist())
    with torch.no_grad():
        torch.testing.assert_close(ours_logits, src(ids).logits[0], rtol=1e-3, atol=1e-3)
    assert ours_tokens == _greedy(src, ids)[0].tolist()
