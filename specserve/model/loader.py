"""Load a local Hugging Face checkpoint folder, or a GGUF file, into a `DecoderLM`.

A folder: reads `config.json` and either `model.safetensors` or a sharded
`model.safetensors.index.json`. A `.gguf` file: `gguf.read_gguf` gives the config and the
tensors under their Hugging Face names (k-quants, Q5_0 and Q5_1 converted into Q8_0 / Q4_1:
gguf_convert.py), dequantized here to the model's dtype, except the Q8_0 / Q4_0 / Q4_1
projections, which keep the file's (or the converted) blocks (`quant.use_file_blocks`).
Each checkpoint tensor is routed to the parameter that owns it together with a shard id (q/k/v
and gate/up are fused here), and that parameter's `weight_loader` reads its tensor-parallel
slice from the file (a lazy safetensors slice: a rank reads only its own part). A pipeline
stage (`pipeline.stage_model.StageLM`) routes only its own layers (renumbered from 0), the
embedding on the first stage, the final norm and LM head on the last; the other tensors are
never read. Every failure names the folder, file and tensor involved.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..distributed import WHOLE_MODEL, PipelineStage, TPShard, shard_for_checkpoint
from ..kernels.quant_reference import FORMATS
from .architectures import ArchSpec, DecoderLM, bad_feature_layers
from .huge_pages import move_to_huge_pages
from .parallel import QUANT_BLOCK, check_split
from .quant import quantize_model, resolve_quantization, use_file_blocks

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# checkpoint name suffix -> (our parameter suffix, shard id within a fused weight)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and tensor."""


def load_hf_config(path: str | Path):
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad config
        raise CheckpointError(f"{path / 'config.json'}: cannot be read: {exc}") from exc


def resolve_dtype(dtype: str | torch.dtype, config) -> torch.dtype:
    """"auto" takes the checkpoint's own dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        name = str(name).removeprefix("torch.") if name is not None else "float32"
        return _DTYPES.get(name, torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def weight_files(path: Path) -> dict[str, Path]:
    """Map each checkpoint tensor name to the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index: {exc}") from exc
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{f}: weight file listed in {index.name} is missing")
        return files
    if single.is_file():
        names = _open(single).keys()
        return dict.fromkeys(names, single)
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises on truncated or corrupt headers
        raise CheckpointError(f"{file}: cannot be read as safetensors (truncated or corrupt?): "
                              f"{exc}") from exc


def _route(name: str, spec: ArchSpec, stage: PipelineStage = WHOLE_MODEL,
           layers: range | None = None) -> tuple[str, int] | None:
    """Checkpoint tensor name -> (our parameter name, shard id), or None to skip it.

    `stage`/`layers`: a pipeline stage and its global layer indices (None: every layer)."""
    if name == "model.embed_tokens.weight":
        if stage.is_first:
            return "embed_tokens.weight", 0
        # A later stage reads the embedding only as the last stage's tied LM head.
        return ("lm_head.weight", 0) if stage.is_last and spec.tie_word_embeddings else None
    if name == "model.norm.weight":
        return ("norm.weight", 0) if stage.is_last else None
    if name in ("model.fc.weight", "model.fc.bias") and spec.reads_target_hidden:
        return name.removeprefix("model."), 0
    if name == "model.fuse.weight" and spec.target_feature_layers:
        return "fuse.weight", 0
    if name == "lm_head.weight":
        return (None if spec.tie_word_embeddings or not stage.is_last
                else ("lm_head.weight", 0))
    m = _LAYER.match(name)
    if m is None:
        return None
    layer, module, kind = m.groups()
    if module.endswith("rotary_emb"):
        return None
    if layers is not None:
        if int(layer) not in layers:
            return None
        layer = int(layer) - layers.start
    target, shard = _FUSED.get(module, (module, 0))
    return f"layers.{layer}.{target}.{kind}", shard


def is_gguf(path: str | Path) -> bool:
    """A `.gguf` file (read by model/gguf.py) rather than a Hugging Face folder."""
    return Path(path).suffix.lower() == ".gguf"


def load_model(path: str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", quantization: str | None = None,
               shard: TPShard | None = None, target: DecoderLM | None = None,
               stage: PipelineStage | None = None) -> DecoderLM:
    """Build the decoder for the checkpoint's architecture and load its weights (this rank's
    slice). `path` is a Hugging Face folder or a `.gguf` file (dequantized to `dtype`, except
    Q8_0 / Q4_0 / Q4_1 projections, which run on their own blocks when `quantization` is None).
    `quantization` ("int8", "int4", see quant.py) quantizes the projections at load.

    `shard`, `stage`: the tensor-parallel slice and pipeline stage to hold (a stage gives a
    `StageLM`); by default what the launcher registered for this checkpoint
    (`distributed.shard_for_checkpoint`), else the whole model.
    `target`: the loaded target, when `path` is its draft: a draft that shares its embeddings
    (config.json's `shares_target_embeddings`) then holds the target's own tensor, not a copy,
    and a quantized draft's LM head is quantized too (quant.quantize_model).
    """
    path = Path(path)
    registered_shard, registered_stage = shard_for_checkpoint(path)
    if shard is None:
        shard, stage = registered_shard, stage or registered_stage
    stage = stage or WHOLE_MODEL
    if is_gguf(path):
        model = _load_gguf(path, dtype, device, quantization, shard, stage,
                           quantize_head=target is not None)
    else:
        model = _load_hf(path, dtype, device, quantization, shard, target, stage)
    move_to_huge_pages(model)  # a CPU model's weights: see huge_pages.py
    return model


def _build(spec: ArchSpec, dtype: torch.dtype, shard: TPShard,
           stage: PipelineStage) -> DecoderLM:
    """The whole decoder, or one pipeline stage of it."""
    if not stage.is_split:
        return DecoderLM(spec, dtype, shard)
    from ..pipeline.stage_model import StageLM

    return StageLM(spec, dtype, stage, shard)


def _load_hf(path: Path, dtype: str | torch.dtype, device: str | torch.device,
             quantization: str | None, shard: TPShard, target: DecoderLM | None,
             stage: PipelineStage) -> DecoderLM:
    config = load_hf_config(path)
    spec = ArchSpec.from_hf_config(config)
    if spec.shared_embeddings and target is None:
        raise CheckpointError(f"{path}: this draft uses its target's embeddings; load it "
                              f"together with its target")
    if spec.reads_target_hidden:
        _check_reads_target_hidden(spec, target, shard, path)
    torch_dtype = resolve_dtype(dtype, config)
    files = weight_files(path)
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)

    def tensors():
        for file, names in sorted(by_file.items()):
            handle = _open(file)
            for name in sorted(names):  # a lazy slice: a rank reads only its own part
                yield file, name, lambda handle=handle, name=name: handle.get_slice(name)

    if resolve_quantization(quantization) is not None:
        _check_quantized_split(spec, shard)
    model = _build(spec, torch_dtype, shard, stage)
    loaded = _fill(model, tensors(), spec.norm_weight_offset)
    if spec.shared_embeddings:
        _share_embeddings(model, target, path)
        loaded.add(("embed_tokens.weight", 0))
    _check_complete(model, loaded, path)
    return quantize_model(model, quantization, head=target is not None).to(device).eval()


def _check_reads_target_hidden(spec: ArchSpec, target: DecoderLM | None, shard: TPShard,
                               path: Path) -> None:
    if target is None:
        raise CheckpointError(f"{path}: this draft reads its target's hidden states; load it "
                              f"together with its target")
    if spec.hidden_size != target.spec.hidden_size:
        raise CheckpointError(f"{path}: this draft reads hidden states of size "
                              f"{spec.hidden_size}; the target's are {target.spec.hidden_size} "
                              f"(a draft made for another model?)")
    if shard.is_split:
        raise CheckpointError(f"{path}: a draft that reads the target's hidden states runs "
                              f"whole on rank 0 (draft_tp=1)")
    layers = spec.target_feature_layers
    if bad_feature_layers(layers, target.spec.num_layers):
        raise CheckpointError(f"{path}: this draft reads target layers {list(layers)}; the "
                              f"target has {target.spec.num_layers} (distinct, ascending "
                              f"indices below that)")


def _share_embeddings(draft: DecoderLM, target: DecoderLM, path: Path) -> None:
    weight = target.embed_tokens.weight
    want = tuple(draft.embed_tokens.weight.shape)
    if tuple(weight.shape) != want:
        raise CheckpointError(f"{path}: this draft needs target embeddings of shape {want}; the "
                              f"target's are {tuple(weight.shape)} (a draft made for another "
                              f"model?)")
    # One tensor for both models, in the target's dtype (the draft casts the rows it reads).
    draft.embed_tokens.weight = weight


def _load_gguf(path: Path, dtype: str | torch.dtype, device: str | torch.device,
               quantization: str | None, shard: TPShard, stage: PipelineStage,
               quantize_head: bool) -> DecoderLM:
    """A GGUF's tensors are read whole and dequantized, then each rank keeps its slice (the
    file's blocks have no lazy slicing); Q8_0 / Q4_0 / Q4_1 projections then take this rank's
    rows or block columns of the file's blocks. A pipeline stage reads only its own tensors."""
    from .gguf import GGUFError, read_gguf

    try:
        ckpt = read_gguf(path, keep=_stage_reads(stage) if stage.is_split else None)
    except GGUFError as exc:
        raise CheckpointError(str(exc)) from exc
    if dtype == "auto":
        dtype = gguf_auto_dtype(ckpt.file_type)
    torch_dtype = resolve_dtype(dtype, ckpt.config)
    file_blocks = quantization is None and any(t.ggml_type.name in FORMATS
                                               for t in ckpt.tensors.values())
    if file_blocks or resolve_quantization(quantization) is not None:
        _check_quantized_split(ckpt.spec, shard)
    model = _build(ckpt.spec, torch_dtype, shard, stage)
    tensors = ((path, name, lambda t=t: t.dequantize(torch_dtype))
               for name, t in sorted(ckpt.tensors.items()))
    _check_complete(model, _fill(model, tensors), path)
    if file_blocks:
        use_file_blocks(model, _stage_tensors(ckpt.tensors, model) if stage.is_split
                        else ckpt.tensors)
    else:
        quantize_model(model, quantization, head=quantize_head)
    return model.to(device).eval()


def gguf_auto_dtype(file_type: str) -> torch.dtype:
    """What "auto" computes in for a GGUF whose most common matrix type is `file_type`.

    A BF16 file computes in bfloat16, as a bfloat16 safetensors checkpoint does: its weights
    are exact in it, and the bf16 CPU kernels read half the bytes (widened 369M target on a
    first-generation Zen, two threads: 23.9 vs 7.5 tok/s at one chat). Every other file
    computes in float32: quantized blocks dequantized to bfloat16 lose more (SmolLM2-135M Q4_1
    answered "What is the capital of France?" with "L'Étoile, la Marseillaise, ..." where
    float32 and llama.cpp say "The capital of France is Paris."), and F16 weights are exact in
    float32 but not in bfloat16."""
    return torch.bfloat16 if file_type == "BF16" else torch.float32


def _stage_reads(stage: PipelineStage):
    """keep(name, config) for read_gguf: the tensors a pipeline stage holds (its layers; the
    embedding on the first stage; the final norm and LM head, the embedding when tied, on the
    last)."""
    def keep(name: str, config) -> bool:
        m = _LAYER.match(name)
        if m is not None:
            return int(m[1]) in stage.layers(config.num_hidden_layers)
        if name == "model.embed_tokens.weight":
            return stage.is_first or (stage.is_last and config.tie_word_embeddings)
        return stage.is_last  # model.norm.weight, lm_head.weight

    return keep


def _stage_tensors(tensors: dict, model: DecoderLM) -> dict:
    """A stage's GGUF tensors under the names `use_file_blocks` looks for: its layers at their
    local indices, and on the last stage its LM head (the embedding when tied) as
    lm_head.weight; nothing else, so no other stage's blocks are touched."""
    layers = model.layer_range
    view = {}
    for name, tensor in tensors.items():
        m = _LAYER.match(name)
        if m is not None and int(m[1]) in layers:
            view[f"model.layers.{int(m[1]) - layers.start}.{m[2]}.{m[3]}"] = tensor
    if model.stage.is_last:
        head = ("model.embed_tokens.weight" if model.spec.tie_word_embeddings
                else "lm_head.weight")
        view["lm_head.weight"] = tensors[head]
    return view


def load_gguf_dequantized(path: str | Path, dtype: str | torch.dtype = "float32") -> DecoderLM:
    """A GGUF file's model with every tensor dequantized from the file's own blocks (no
    conversion, no quantized kernels): the reference the quantized runtime is measured
    against (tests, benchmarks)."""
    from .gguf import GGUFError, read_gguf

    path = Path(path)
    try:
        ckpt = read_gguf(path, convert=False)
    except GGUFError as exc:
        raise CheckpointError(str(exc)) from exc
    torch_dtype = resolve_dtype(dtype, ckpt.config)
    model = DecoderLM(ckpt.spec, torch_dtype)
    tensors = ((path, name, lambda t=t: t.dequantize(torch_dtype))
               for name, t in sorted(ckpt.tensors.items()))
    _check_complete(model, _fill(model, tensors), path)
    return model.eval()


def _check_quantized_split(spec: ArchSpec, shard: TPShard) -> None:
    """Quantized weights split on whole scale blocks: a rank's row-parallel input must not end
    inside one (its blocks would differ from the whole model's)."""
    check_split(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size, shard,
                quant_block=QUANT_BLOCK)


def _fill(model: DecoderLM, tensors, norm_offset: float = 0.0) -> set[tuple[str, int]]:
    """Copy this rank's part of each checkpoint tensor into `model`; returns the (parameter,
    shard) pairs filled. `norm_offset` is added to every norm weight, in float32 before the
    cast (Gemma's checkpoints store w for a multiplier of 1 + w; its GGUF files store 1 + w).

    `tensors` yields (file, checkpoint name, open()) per tensor; open() gives the tensor or a
    lazy safetensors slice, and is called only once the tensor is routed to a parameter. Each
    parameter's `weight_loader` reads its tensor-parallel part (copy_ converts the dtype)."""
    spec = model.spec
    stage, layers = getattr(model, "stage", WHOLE_MODEL), getattr(model, "layer_range", None)
    params = dict(model.named_parameters())
    owners = {name: mod for mod_name, mod in model.named_modules()
              for name in (f"{mod_name}.weight", f"{mod_name}.bias") if name in params}
    loaded: set[tuple[str, int]] = set()
    for file, name, open_tensor in tensors:
        if name == "lm_head.token_ids" and model.head_token_ids is not None:
            ids = open_tensor()[:]  # a lazy slice or a tensor: the whole of it
            if tuple(ids.shape) != tuple(model.head_token_ids.shape) or \
                    not 0 <= int(ids.min()) <= int(ids.max()) < spec.vocab_size:
                raise CheckpointError(f"{file}: tensor {name!r}: expected "
                                      f"{spec.head_vocab_size} token ids in [0, "
                                      f"{spec.vocab_size}), got shape {tuple(ids.shape)}")
            model.head_token_ids.copy_(ids)
            loaded.add(("head_token_ids", 0))
            continue
        route = _route(name, spec, stage, layers)
        if route is None:
            continue
        target, shard = route
        if target not in params:
            raise CheckpointError(f"{file}: unexpected tensor {name!r} for {spec.architecture}")
        loader = getattr(owners[target], "weight_loader", None)
        try:
            with torch.no_grad():
                source = open_tensor()
                if loader is None:  # norms: whole tensor on every rank
                    tensor = source if isinstance(source, torch.Tensor) else source[:]
                    if params[target].shape != tensor.shape:
                        raise ValueError(f"shape mismatch: expected "
                                         f"{tuple(params[target].shape)}, got "
                                         f"{tuple(tensor.shape)}")
                    if norm_offset:
                        tensor = tensor.float() + norm_offset
                    params[target].data.copy_(tensor)
                else:
                    loader(params[target], source, shard)
        except ValueError as exc:
            raise CheckpointError(f"{file}: tensor {name!r}: {exc}") from exc
        except Exception as exc:  # safetensors and gguf raise their own types on a bad tensor
            raise CheckpointError(f"{file}: tensor {name!r} cannot be read: {exc}") from exc
        loaded.add((target, shard))
    return loaded


def _check_complete(model: DecoderLM, loaded: set[tuple[str, int]], path: Path) -> None:
    missing = ([] if model.head_token_ids is None or ("head_token_ids", 0) in loaded
               else ["lm_head.token_ids"])
    for name, _ in model.named_parameters():
        shards = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 1
        missing += [f"{name}[{s}]" if shards > 1 else name
                    for s in range(shards) if (name, s) not in loaded]
    if missing:
        raise CheckpointError(f"{path}: checkpoint is missing tensors for: {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    if is_gguf(path):
        from .gguf import GGUFError, load_gguf_tokenizer

        try:
            return load_gguf_tokenizer(path)
        except GGUFError as exc:
            raise CheckpointError(str(exc)) from exc
    try:
        return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: tokenizer cannot be loaded: {exc}") from exc
