"""Read a llama.cpp GGUF file into the project's checkpoint vocabulary.

`read_gguf(path)` returns a `GGUFCheckpoint`: a transformers config and `ArchSpec` built from the
file's metadata (architectures `llama`, `qwen2`, `qwen3` and `gemma3`), the tokenizer's
metadata, and every tensor as a `GGUFTensor` keyed by its Hugging Face parameter name
(`model.layers.0.self_attn.q_proj.weight`, ...), so `loader.py` routes them exactly as it routes
safetensors.

Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks are kept as stored (the kernels run them); the other
block types (Q5_K, Q3_K, Q2_K, Q5_0, Q5_1) are converted while reading into the nearest one the
kernels run (gguf_convert.py); `read_gguf(path, convert=False)` keeps the file's own types, for
a reference dequantized from them. Gemma 3's norm weights are read as stored:
llama.cpp's converter stores 1 + w, the multiplier our RMSNorm applies.

A `GGUFTensor` keeps the file's own blocks (`raw`, uint8 `[rows, bytes_per_row]`, rows = output
features as in Hugging Face) so a quantized runtime can use them as they are; `dequantize`
turns them into a torch tensor through `gguf.quants.dequantize`. llama.cpp's converter permutes
the rows of `attn_q` / `attn_k` of llama-architecture models for its rotary layout (pairs of
interleaved rows instead of two halves); the rows are put back here, once, so every consumer sees
Hugging Face's layout. A block never spans rows, so permuting rows of raw blocks is exact.

Two things are slow enough to be done once per file and kept in the cache folder
(`$SPECSERVE_CACHE`, default ~/.cache/specserve), keyed by the file's path, size and mtime:
`GGUFReader`'s parse of all metadata (an index of the scalar metadata and the tensors' offsets is
kept, and later reads memory-map the file directly), and the tokenizer transformers builds from
the GGUF (`gguf_file=`; ~15 s for a 49k vocabulary), kept as a tokenizer folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from ..kernels.quant_reference import FORMATS, QuantizedWeight
from ..kernels.quant_reference import dequantize as dequantize_blocks
from .architectures import ArchSpec
from .gguf_convert import CONVERSIONS, convert

NATIVE_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K,
})
SUPPORTED_TYPES = NATIVE_TYPES | frozenset(CONVERSIONS)
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# llama.cpp's converter permutes q/k rows only for these architectures.
_PERMUTED_ARCHITECTURES = frozenset({"llama"})

# GGUF tensor name -> Hugging Face parameter name.
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_MODULES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3 names its four block norms after their place; its ffn_norm is the norm before the MLP.
_GEMMA3_BLOCK_MODULES = {
    **_BLOCK_MODULES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's Gemma 3 defaults where the file's metadata has no value: one global layer in 6,
# a rotary base of 10000 on the sliding layers.
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Metadata arrays longer than this (the tokenizer's vocabulary, merges, scores) stay out of the
# index: the tokenizer is built from the file itself, once (load_gguf_tokenizer).
_MAX_INDEXED_ITEMS = 1024
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded; the message names the file and, where one, the tensor."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored in the file, in Hugging Face orientation.

    shape: `(rows, cols)` = (output features, input features) for matrices, `(n,)` for vectors.
    raw: uint8 `[rows, bytes_per_row]` of the file's blocks (`[1, bytes]` for a vector).
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray
    file_type: GGMLQuantizationType | None = None  # the file's own type, when converted

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor's values as `dtype`, shape `self.shape`."""
        fmt = FORMATS.get(self.ggml_type.name)
        if fmt is not None and len(self.shape) == 2:
            # The kernels' own dequantization: the same fp32 products as gguf's, in torch
            # (several times faster on a 262k-row embedding).
            blocks = torch.from_numpy(np.array(self.raw))  # [rows, bytes], off the read-only map
            return dequantize_blocks(QuantizedWeight(fmt, blocks, self.shape), dtype)
        values = gguf_dequantize(self.raw, self.ggml_type)  # float32 [rows, cols]
        if not values.flags.writeable:  # a float32 view of the read-only memory map
            values = values.copy()
        return torch.from_numpy(values.reshape(self.shape)).to(dtype)


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """The tokenizer metadata of the file (the tokenizer itself: `load_gguf_tokenizer`)."""

    model: str  # "gpt2" (byte-level BPE), "llama" (sentencepiece), ...
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path
    architecture: str  # the file's general.architecture: "llama" | "qwen2"
    config: object  # transformers PretrainedConfig equivalent to the model's config.json
    spec: ArchSpec
    tokenizer: GGUFTokenizerInfo
    tensors: dict[str, GGUFTensor]

    @property
    def file_type(self) -> str:
        """The most common matrix type, e.g. "Q4_1" (what llama.cpp calls the file's type)."""
        types = [t.ggml_type.name for t in self.tensors.values() if len(t.shape) == 2]
        return max(set(types), key=types.count) if types else "F32"


def read_gguf(path: str | Path, convert: bool = True,
              keep: Callable[[str, object], bool] | None = None) -> GGUFCheckpoint:
    """Parse `path`: metadata into a config, tensors into `GGUFTensor`s (memory-mapped; a type
    the kernels do not run converted into one they do, unless `convert` is False). With `keep`,
    only the tensors for which keep(Hugging Face name, config) holds are read (unpermuted,
    converted): a pipeline stage touches no other stage's tensors.

    `GGUFReader` parses every metadata value in Python, the tokenizer's ~100k strings included
    (~5 s for SmolLM2, far longer on a busy machine), so what this loader needs from it (the
    scalar metadata and each tensor's type, shape and file offset) is kept in a small JSON index
    in the cache folder, keyed by the file's identity; later reads map the file directly.
    """
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    index_file = cache_dir() / "gguf-index" / f"{path.stem}-{file_key(path)}.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = _build_index(path)
        _write_atomically(index_file, json.dumps(index))
    return _checkpoint(path, index, convert, keep)


def _build_index(path: Path) -> dict:
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError/struct.error/... on a bad file
        raise GGUFError(f"{path}: cannot be read as GGUF (truncated or corrupt?): {exc}") from exc
    metadata = {}
    for key, field in reader.fields.items():
        if len(field.data) <= _MAX_INDEXED_ITEMS:  # skips the token, merge and score lists
            metadata[key] = _plain(field.contents())
    tensors = [{"name": t.name, "type": int(t.tensor_type), "dims": [int(d) for d in t.shape],
                "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in reader.tensors]
    return {"metadata": metadata, "tensors": tensors}


def _plain(value):
    """A metadata value as JSON-ready Python (numpy scalars and arrays become numbers, lists)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _checkpoint(path: Path, index: dict, convert: bool,
                keep: Callable[[str, object], bool] | None) -> GGUFCheckpoint:
    meta = index["metadata"]
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                        f"{', '.join(_ARCHITECTURES)}")
    entries = {_hf_name(path, arch, entry["name"]): entry for entry in index["tensors"]}
    for entry in entries.values():  # a type no loader reads is named first, whatever is kept
        _qtype(path, entry)
    config = _hf_config(path, arch, meta, {name: tuple(reversed(entry["dims"]))
                                           for name, entry in entries.items()})
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {name: _tensor(path, arch, entry, data, meta, convert)
               for name, entry in entries.items() if keep is None or keep(name, config)}
    tokenizer = GGUFTokenizerInfo(
        model=meta.get("tokenizer.ggml.model", ""),
        vocab_size=config.vocab_size,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
    )
    try:
        spec = ArchSpec.from_hf_config(config)
    except ValueError as exc:
        raise GGUFError(f"{path}: {exc}") from exc
    return GGUFCheckpoint(path, arch, config, spec, tokenizer, tensors)


def _hf_name(path: Path, arch: str, gguf_name: str) -> str:
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    modules = _GEMMA3_BLOCK_MODULES if arch == "gemma3" else _BLOCK_MODULES
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in modules:
        raise GGUFError(f"{path}: unsupported tensor {gguf_name!r} (not part of a "
                        f"{'/'.join(_ARCHITECTURES)} decoder this loader knows)")
    layer, module, kind = m.groups()
    return f"model.layers.{layer}.{modules[module]}.{kind}"


def _qtype(path: Path, entry: dict) -> GGMLQuantizationType:
    qtype = GGMLQuantizationType(entry["type"])
    if qtype not in SUPPORTED_TYPES:
        raise GGUFError(f"{path}: tensor {entry['name']!r} has type {qtype.name}; supported "
                        f"types: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))}")
    return qtype


def _tensor(path: Path, arch: str, entry: dict, data: np.ndarray, meta: dict,
            convert_blocks: bool) -> GGUFTensor:
    qtype = _qtype(path, entry)
    gguf_name = entry["name"]
    name = _hf_name(path, arch, gguf_name)
    dims = entry["dims"]  # GGUF order: fastest-varying (input features) first
    if len(dims) not in (1, 2):
        raise GGUFError(f"{path}: tensor {gguf_name!r} has {len(dims)} dimensions; expected 1 "
                        f"or 2")
    shape = tuple(reversed(dims))
    rows = shape[0] if len(shape) == 2 else 1
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    cols = shape[-1]
    if cols % block:
        raise GGUFError(f"{path}: tensor {gguf_name!r}: {cols} columns is not a multiple of the "
                        f"{qtype.name} block of {block}")
    start, nbytes = entry["offset"], entry["nbytes"]
    if nbytes != rows * cols // block * block_bytes or start + nbytes > data.size:
        raise GGUFError(f"{path}: tensor {gguf_name!r}: data past the end of the file "
                        f"(truncated?)")
    raw = data[start:start + nbytes].reshape(rows, cols // block * block_bytes)
    if arch in _PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "k_proj.weight",
                                                          "q_proj.bias", "k_proj.bias")):
        heads = meta.get(f"{arch}.attention.head_count")
        if "k_proj" in name:  # k is permuted per KV head
            heads = meta.get(f"{arch}.attention.head_count_kv", heads)
        raw = _unpermute_rows(raw, shape, qtype, heads)
    if convert_blocks and qtype in CONVERSIONS:
        converted, native = convert(raw, qtype)
        return GGUFTensor(name, native, shape, converted, file_type=qtype)
    return GGUFTensor(name, qtype, shape, raw)


def _unpermute_rows(raw: np.ndarray, shape: tuple[int, ...], qtype: GGMLQuantizationType,
                    heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q or k projection.

    The converter maps each head's rows [first half | second half] to interleaved pairs
    (row 2i = first-half row i, row 2i + 1 = second-half row i). Weights permute whole rows; a
    bias (a vector) permutes its elements, which only float types store one by one.
    """
    if len(shape) == 1:
        if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                         GGMLQuantizationType.BF16):
            raise GGUFError(f"a {qtype.name} q/k bias cannot be un-permuted; expected a float type")
        n = shape[0]
        return _unpermute_rows(raw.reshape(n, -1), (n, 1), qtype, heads).reshape(1, -1)
    rows = shape[0]
    half = rows // heads // 2
    out = raw.reshape(heads, half, 2, -1).swapaxes(1, 2)  # [heads, 2, half, bytes]
    return np.ascontiguousarray(out).reshape(rows, -1)


def _hf_config(path: Path, arch: str, meta: dict, shapes: dict[str, tuple[int, ...]]):
    """The transformers config of the file (shapes: every tensor's, by Hugging Face name)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    embed = shapes.get("model.embed_tokens.weight")
    if embed is None:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    if heads is None or hidden is None or get("block_count") is None:
        raise GGUFError(f"{path}: metadata lacks {arch}.attention.head_count, "
                        f"{arch}.embedding_length or {arch}.block_count")
    scaling = get("rope.scaling.type", "none")
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling != "none":
        raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported")
    extra = {}
    if arch == "gemma3":
        extra = _gemma3_config(path, meta, get("block_count"), rope)
        rope = extra.pop("rope_parameters")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma3": Gemma3TextConfig}[arch]
    return cls(
        architectures=[_ARCHITECTURES[arch]],
        vocab_size=embed[0],
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length", hidden // heads),
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="lm_head.weight" not in shapes,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        **extra,
    )


def _gemma3_config(path: Path, meta: dict, layers: int, rope: dict) -> dict:
    """Gemma 3's settings beyond the common ones, as llama.cpp reads them: the sliding window
    and its pattern, the local rotary base, the attention scale (head_dim, except the 27B
    model's hidden / heads, which llama.cpp picks by its 62 layers), final soft-capping."""
    def get(key: str, default=None):
        return meta.get(f"gemma3.{key}", default)

    heads, hidden = get("attention.head_count"), get("embedding_length")
    head_dim = get("attention.key_length", hidden // heads)
    pattern = get("attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        if len(pattern) != layers:
            raise GGUFError(f"{path}: gemma3.attention.sliding_window_pattern has "
                            f"{len(pattern)} flags for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    local = {"rope_type": "default",
             "rope_theta": float(meta.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE))}
    return {
        "sliding_window": get("attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {"full_attention": rope, "sliding_attention": local},
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "final_logit_softcapping": get("final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
    }


def cache_dir() -> Path:
    """Where derived files live: $SPECSERVE_CACHE, else ~/.cache/specserve."""
    return Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))


def file_key(path: str | Path) -> str:
    """A short key for a file's identity (resolved path, size, modification time)."""
    p = Path(path).resolve()
    st = p.stat()
    return hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _write_atomically(file: Path, text: str) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, file)


def load_gguf_tokenizer(path: str | Path):
    """The file's tokenizer as a transformers fast tokenizer, cached after the first build."""
    from transformers import AutoTokenizer

    path = Path(path)
    cached = cache_dir() / "gguf-tokenizers" / f"{path.stem}-{file_key(path)}"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name,
                                                  local_files_only=True)
    except Exception as exc:  # transformers raises many types for an unreadable tokenizer
        raise GGUFError(f"{path}: tokenizer cannot be built from the GGUF: {exc}") from exc
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")  # complete before visible
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, cached)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
