"""Load a local Hugging Face checkpoint folder, or a GGUF file, into a `DecoderLM`.

A folder: reads `config.json` and either `model.safetensors` or a sharded
`model.safetensors.index.json`. A `.gguf` file: `gguf.read_gguf` gives the config and the
tensors under their Hugging Face names, dequantized here to the model's dtype, except the
Q8_0 / Q4_0 / Q4_1 projections, which keep the file's blocks (`quant.use_file_blocks`).
Each checkpoint tensor is routed to the parameter that owns it together with a shard id (q/k/v
and gate/up are fused here), and that parameter's `weight_loader` copies its tensor-parallel
slice. Every failure names the folder, file and tensor involved.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from .architectures import ArchSpec, DecoderLM
from .quant import quantize_model, use_file_blocks

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


def _route(name: str, spec: ArchSpec) -> tuple[str, int] | None:
    """Checkpoint tensor name -> (our parameter name, shard id), or None to skip it."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", 0
    if name == "model.norm.weight":
        return "norm.weight", 0
    if name == "lm_head.weight":
        return (None if spec.tie_word_embeddings else ("lm_head.weight", 0))
    m = _LAYER.match(name)
    if m is None:
        return None
    layer, module, kind = m.groups()
    if module.endswith("rotary_emb"):
        return None
    target, shard = _FUSED.get(module, (module, 0))
    return f"layers.{layer}.{target}.{kind}", shard


def is_gguf(path: str | Path) -> bool:
    """A `.gguf` file (read by model/gguf.py) rather than a Hugging Face folder."""
    return Path(path).suffix.lower() == ".gguf"


def load_model(path: str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", quantization: str | None = None) -> DecoderLM:
    """Build the decoder for the checkpoint's architecture and load its weights (this rank's
    slice). `path` is a Hugging Face folder or a `.gguf` file (dequantized to `dtype`, except
    Q8_0 / Q4_0 / Q4_1 projections, which run on their own blocks when `quantization` is None).
    `quantization` ("int8", "int4", see quant.py) quantizes the projections at load."""
    path = Path(path)
    if is_gguf(path):
        return _load_gguf(path, dtype, device, quantization)
    config = load_hf_config(path)
    spec = ArchSpec.from_hf_config(config)
    torch_dtype = resolve_dtype(dtype, config)
    files = weight_files(path)
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)

    def tensors():
        for file, names in sorted(by_file.items()):
            handle = _open(file)
            for name in sorted(names):
                yield file, name, lambda handle=handle, name=name: handle.get_tensor(name)

    model = DecoderLM(spec, torch_dtype)
    _check_complete(model, _fill(model, tensors(), torch_dtype), path)
    return quantize_model(model, quantization).to(device).eval()


def _load_gguf(path: Path, dtype: str | torch.dtype, device: str | torch.device,
               quantization: str | None) -> DecoderLM:
    from .gguf import GGUFError, read_gguf

    try:
        ckpt = read_gguf(path)
    except GGUFError as exc:
        raise CheckpointError(str(exc)) from exc
    if dtype == "auto":  # dequantized weights: float32 only when the file is float32 throughout
        all_f32 = all(t.ggml_type.name == "F32" for t in ckpt.tensors.values())
        dtype = torch.float32 if all_f32 else torch.bfloat16
    torch_dtype = resolve_dtype(dtype, ckpt.config)
    model = DecoderLM(ckpt.spec, torch_dtype)
    tensors = ((path, name, lambda t=t: t.dequantize(torch_dtype))
               for name, t in sorted(ckpt.tensors.items()))
    _check_complete(model, _fill(model, tensors, torch_dtype), path)
    if quantization is None:
        use_file_blocks(model, ckpt.tensors)
    else:
        quantize_model(model, quantization)
    return model.to(device).eval()


def _fill(model: DecoderLM, tensors, torch_dtype: torch.dtype) -> set[tuple[str, int]]:
    """Copy checkpoint tensors into `model`; returns the (parameter, shard) pairs filled.

    `tensors` yields (file, checkpoint name, read()) per tensor; each is routed to the parameter
    that owns it and read only then."""
    spec = model.spec
    params = dict(model.named_parameters())
    owners = {name: mod for mod_name, mod in model.named_modules()
              for name in (f"{mod_name}.weight", f"{mod_name}.bias") if name in params}
    loaded: set[tuple[str, int]] = set()
    for file, name, read in tensors:
        route = _route(name, spec)
        if route is None:
            continue
        target, shard = route
        if target not in params:
            raise CheckpointError(f"{file}: unexpected tensor {name!r} for {spec.architecture}")
        try:
            tensor = read()
        except Exception as exc:
            raise CheckpointError(f"{file}: tensor {name!r} cannot be read: {exc}") from exc
        loader = getattr(owners[target], "weight_loader", None)
        try:
            with torch.no_grad():
                if loader is None:  # norms: whole tensor on every rank
                    if params[target].shape != tensor.shape:
                        raise ValueError(f"shape mismatch: expected "
                                         f"{tuple(params[target].shape)}, got "
                                         f"{tuple(tensor.shape)}")
                    params[target].data.copy_(tensor)
                else:
                    loader(params[target], tensor.to(torch_dtype), shard)
        except ValueError as exc:
            raise CheckpointError(f"{file}: tensor {name!r}: {exc}") from exc
        loaded.add((target, shard))
    return loaded


def _check_complete(model: DecoderLM, loaded: set[tuple[str, int]], path: Path) -> None:
    missing = []
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
