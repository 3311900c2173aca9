"""Widen a Llama / Qwen2 checkpoint into a larger one that computes exactly the same function.

Benchmarks need a target whose decode step is bound by memory bandwidth, paired with a draft that
has real acceptance. We cannot download a big model, so we grow the small trained demo target:
more hidden channels, more heads, more MLP channels and more layers, all of them real dense
weights that every forward reads and multiplies, arranged so that the logits do not change.

Notation: the source has hidden size ``H``, ``L`` layers, MLP width ``I``, ``nh`` query heads and
``nkv`` kv heads of size ``hd``; the widened model has ``H' = k*H``, ``L'``, ``I'``, ``nh'``,
``nkv'`` and the same ``hd``.

Construction and why the function is preserved
-----------------------------------------------
**Stream invariant.** The residual stream of the widened model is ``x' = [x, 0]``: its first ``H``
channels equal the source's stream and its ``H' - H`` extra channels are exactly zero, after the
embedding and after every block. Everything that *writes* into the stream keeps it so: the
embedding's extra columns, the extra rows of ``o_proj`` / ``down_proj`` (and of their biases,
when the model has them) are zero.

**RMSNorm.** ``RMSNorm(x) = w * x / sqrt(mean(x**2) + eps)``. Over ``H'`` channels of which only
``H`` are non-zero, ``mean'(x'**2) = mean(x**2) / k``. With ``eps' = eps / k``::

    1 / sqrt(mean/k + eps/k) = sqrt(k) / sqrt(mean + eps)

so the original channels come out ``sqrt(k)`` times too large, and storing ``w' = w / sqrt(k)``
on them gives back exactly ``w * x / sqrt(mean + eps)``. The extra channels come out as
``w'_extra * 0 / ... = 0`` whatever ``w'_extra`` is; we store zero there, which also keeps any
stray value in those channels from reaching a projection. ``k`` must be a power of 4: then
``sqrt(k)`` is a power of two, and ``w / sqrt(k)``, ``eps / k`` and the rescaled ``rsqrt`` are
exact in every binary float format, bfloat16 included (barring subnormals).

**Attention.** ``q/k/v_proj`` read the normalised stream, whose extra channels are zero, so their
columns for those channels contribute nothing (they hold random values, multiplied by zero). Each
original head keeps its original rows (and bias), so it computes the same ``q``, ``k``, ``v``;
``hd`` and the rope settings are unchanged, so scores, the ``1/sqrt(hd)`` scaling and the softmax
are the same. Grouped-query attention maps query head ``h`` to kv head ``h // (nh / nkv)``; the
original kv heads keep positions ``0 .. nkv-1`` and original query head ``h`` moves to
``(h // g) * g' + h % g`` (``g = nh/nkv``, ``g' = nh'/nkv'``, so ``g' >= g`` is required), which
still maps to its own kv head: 4 q / 2 kv heads widened to 16 / 2 puts q heads 0,1 at 0,1 and
2,3 at 8,9. Extra heads (and extra kv heads, which only extra query heads use) have random input
weights and really attend, but ``o_proj`` has zero columns for them, so they write nothing back.

**MLP.** The same argument: ``gate/up_proj`` rows for the extra ``I' - I`` channels are random,
``down_proj`` has zero columns for them and zero rows for the extra stream channels.

**Extra layers** are identity residual blocks: random ``q/k/v/gate/up`` weights, but ``o_proj``
and ``down_proj`` (and their biases) all zero, so each adds exactly zero to the stream. They are
*appended* after the original layers. The function is the same wherever they go; appending keeps
layer ``i`` of the widened model equal to layer ``i`` of the source (its hidden state is the
source's, zero-padded), so per-layer comparisons and anything keyed by a layer index (hidden-state
taps for a draft, a debugging hook) carry over without a remapping table.

**Head.** The final norm follows the RMSNorm rule; the LM head has zero columns for the extra
channels. A tied head is the embedding, whose extra columns are zero as well, so it stays tied.

Floating point: every original product is computed from the same operands; what changes is that
reductions are longer (they now add exact zeros) and may be blocked differently, so logits agree
to rounding, not bit for bit. The random weights are small (``std = 0.02``) and seeded per tensor
name, so the output is reproducible and cannot overflow.

Usage::

    python -m draft_models.widen SRC DST --hidden-size 1024 --num-layers 24 \
        --intermediate-size 4096 [--num-heads N --num-kv-heads M] [--dtype bfloat16] [--seed 0]

``ensure_widened_demo()`` builds (once, cached outside the repository) the benchmark fixture: the
bundled demo target widened to hidden 1024, 24 layers, MLP 4096, in bfloat16.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Bump when the construction changes, so cached fixtures are rebuilt.
WIDEN_FORMAT_VERSION = 1
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Files copied verbatim from the source folder (when present): tokenizer and generation settings.
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
STAMP_FILE = "widening.json"
# The package's DEMO_TARGET_DIR, computed here rather than imported so that this module also works
# when ``specserve.draft_models`` resolves as a namespace package (a stale editable install).
DEMO_TARGET_DIR = Path(__file__).resolve().parent / "demo" / "target"


@dataclass(frozen=True)
class WidenSpec:
    """The sizes to widen to. ``None`` head counts take the defaults (see ``plan_widening``)."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    dtype: str | None = None  # "float32" | "float16" | "bfloat16"; None keeps the source's
    seed: int = 0


# The benchmark fixture of issue 14: memory-bound at decode, same outputs as the demo target.
DEMO_WIDEN_SPEC = WidenSpec(
    hidden_size=1024, num_layers=24, intermediate_size=4096, dtype="bfloat16"
)


@dataclass(frozen=True)
class WidenPlan:
    """Source and widened shapes, validated; derived index maps are properties."""

    hidden_size: int
    new_hidden_size: int
    num_layers: int
    new_num_layers: int
    intermediate_size: int
    new_intermediate_size: int
    num_heads: int
    new_num_heads: int
    num_kv_heads: int
    new_num_kv_heads: int
    head_dim: int

    @property
    def growth(self) -> int:
        """k = H' / H, a power of 4."""
        return self.new_hidden_size // self.hidden_size

    @property
    def norm_scale(self) -> float:
        """1 / sqrt(k): a power of two, so multiplying by it is exact."""
        return 1.0 / (1 << ((self.growth.bit_length() - 1) // 2))

    @property
    def query_positions(self) -> tuple[int, ...]:
        """Where each original query head sits among the widened heads."""
        return query_head_positions(
            self.num_heads, self.num_kv_heads, self.new_num_heads, self.new_num_kv_heads
        )


def query_head_positions(
    num_heads: int, num_kv_heads: int, new_num_heads: int, new_num_kv_heads: int
) -> tuple[int, ...]:
    """New index of each original query head, such that it still reads its original kv head.

    Query head ``h`` uses kv head ``h // g`` with ``g = num_heads // num_kv_heads`` (the GQA
    group size). Original kv heads keep their indices, so original query head ``h`` goes to slot
    ``h % g`` of group ``h // g`` of the widened model: ``(h // g) * g' + h % g``.
    """
    if num_heads % num_kv_heads or new_num_heads % new_num_kv_heads:
        raise ValueError(
            f"query heads must be a multiple of kv heads: {num_heads}/{num_kv_heads} -> "
            f"{new_num_heads}/{new_num_kv_heads}"
        )
    if new_num_kv_heads < num_kv_heads:
        raise ValueError(f"kv heads cannot shrink: {num_kv_heads} -> {new_num_kv_heads}")
    group, new_group = num_heads // num_kv_heads, new_num_heads // new_num_kv_heads
    if new_group < group:
        raise ValueError(
            f"each kv head must keep room for its {group} original query heads, but "
            f"{new_num_heads} query / {new_num_kv_heads} kv heads gives groups of {new_group}; "
            "use more query heads or fewer kv heads"
        )
    return tuple((h // group) * new_group + h % group for h in range(num_heads))


def plan_widening(config: Mapping, spec: WidenSpec) -> WidenPlan:
    """Check that ``spec`` can widen the model of ``config`` (a config.json dict) exactly.

    Defaults: ``hidden_size // head_dim`` query heads and the source's kv head count.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)

    new_hidden = spec.hidden_size
    if new_hidden % hidden:
        raise ValueError(f"hidden size must grow by a whole factor: {hidden} -> {new_hidden}")
    growth = new_hidden // hidden
    # Powers of 4 have a single set bit at an even position (1, 4, 16, 64, ...).
    if growth & (growth - 1) or (growth.bit_length() - 1) % 2:
        raise ValueError(
            f"hidden size must grow by a power of 4 (x1, x4, x16, ...), got {hidden} -> "
            f"{new_hidden} (x{growth}): RMSNorm weights are divided by sqrt(growth), which is "
            "exact in bfloat16 only when sqrt(growth) is a power of two"
        )
    for name, old, new in (
        ("num_layers", int(config["num_hidden_layers"]), spec.num_layers),
        ("intermediate_size", int(config["intermediate_size"]), spec.intermediate_size),
    ):
        if new < old:
            raise ValueError(f"{name} cannot shrink: {old} -> {new}")

    if spec.num_heads is not None:
        new_heads = spec.num_heads
    elif new_hidden % head_dim == 0:
        new_heads = new_hidden // head_dim
    else:
        raise ValueError(
            f"hidden size {new_hidden} is not a multiple of head_dim {head_dim}; pass num_heads"
        )
    new_kv_heads = spec.num_kv_heads if spec.num_kv_heads is not None else kv_heads
    if new_heads < heads:
        raise ValueError(f"query heads cannot shrink: {heads} -> {new_heads}")
    query_head_positions(heads, kv_heads, new_heads, new_kv_heads)  # raises on a bad GQA layout
    return WidenPlan(
        hidden_size=hidden,
        new_hidden_size=new_hidden,
        num_layers=int(config["num_hidden_layers"]),
        new_num_layers=spec.num_layers,
        intermediate_size=int(config["intermediate_size"]),
        new_intermediate_size=spec.intermediate_size,
        num_heads=heads,
        new_num_heads=new_heads,
        num_kv_heads=kv_heads,
        new_num_kv_heads=new_kv_heads,
        head_dim=head_dim,
    )


def widened_config(config: Mapping, plan: WidenPlan, dtype: str) -> dict:
    """The source config with the new sizes; vocab, rope, tying and everything else kept."""
    new = dict(config)
    new.update(
        hidden_size=plan.new_hidden_size,
        num_hidden_layers=plan.new_num_layers,
        intermediate_size=plan.new_intermediate_size,
        num_attention_heads=plan.new_num_heads,
        num_key_value_heads=plan.new_num_kv_heads,
        # Explicit: hd is no longer hidden_size // num_heads in general.
        head_dim=plan.head_dim,
        # Extra channels are zero, so mean(x**2) shrinks by k; eps must shrink with it.
        rms_norm_eps=float(config["rms_norm_eps"]) / plan.growth,
    )
    if isinstance(config.get("layer_types"), list):
        # Qwen2 lists an attention type per layer; an identity layer's type does not matter.
        types = list(config["layer_types"])
        new["layer_types"] = types + [types[-1]] * (plan.new_num_layers - len(types))
    # transformers 5 writes "dtype", 4.x "torch_dtype": keep the source's spelling.
    dtype_keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    new.update(dict.fromkeys(dtype_keys, dtype))
    return new


# Per-layer tensors, by name after "model.layers.{i}.", and what each one does to the stream.
_READS_STREAM = {
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
}
_WRITES_STREAM = {"self_attn.o_proj", "mlp.down_proj"}
_NORMS = {"input_layernorm", "post_attention_layernorm"}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Non-persistent rope caches that some old checkpoints carry; transformers recomputes them.
_DROPPED = re.compile(r"(.*\.)?rotary_emb\.inv_freq")


def _random(name: str, shape: tuple[int, ...], seed: int, std: float = 0.02) -> torch.Tensor:
    """Small normal weights, seeded by (seed, name) so each tensor is reproducible on its own."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.empty(shape).normal_(0.0, std, generator=gen)  # one pass, no temporary


class _Widener:
    """Builds each widened tensor (float32) from its source tensor, or from nothing for new layers.

    Shape names: ``H, H2`` old/new hidden size, ``I2`` new MLP width, ``nh2`` new query heads.
    """

    def __init__(self, plan: WidenPlan, seed: int) -> None:
        self.p, self.seed = plan, seed
        self.q_pos = torch.tensor(plan.query_positions)  # [nh]

    def norm(self, w: torch.Tensor | None) -> torch.Tensor:
        p = self.p
        out = torch.zeros(p.new_hidden_size)  # [H2]; extra channels are zero in, zero out
        # Identity layers get a plain unit norm (scaled the same way) so their inputs are sane.
        out[: p.hidden_size] = (w if w is not None else 1.0) * p.norm_scale
        return out

    def reads_stream(
        self, name: str, module: str, kind: str, t: torch.Tensor | None
    ) -> torch.Tensor:
        """q/k/v/gate/up: random rows for new outputs, original block kept, any input columns."""
        p, hd = self.p, self.p.head_dim
        rows = {
            "self_attn.q_proj": p.new_num_heads * hd,
            "self_attn.k_proj": p.new_num_kv_heads * hd,
            "self_attn.v_proj": p.new_num_kv_heads * hd,
            "mlp.gate_proj": p.new_intermediate_size,
            "mlp.up_proj": p.new_intermediate_size,
        }[module]
        shape = (rows, p.new_hidden_size) if kind == "weight" else (rows,)
        out = _random(name, shape, self.seed)  # [rows, H2] or [rows]
        if t is None:
            return out
        if module == "self_attn.q_proj":
            # [nh2, hd, H2] view: original head h goes to slot q_pos[h]; its extra input columns
            # keep their random values, which only ever multiply zeros.
            view = out.view(p.new_num_heads, hd, *shape[1:])  # [nh2, hd, H2] or [nh2, hd]
            src = t.reshape(p.num_heads, hd, *t.shape[1:])  # [nh, hd, H] or [nh, hd]
            if kind == "weight":
                view[self.q_pos, :, : p.hidden_size] = src
            else:
                view[self.q_pos] = src
        else:
            # Original kv heads keep indices 0..nkv-1; original MLP channels keep 0..I-1.
            if kind == "weight":
                out[: t.shape[0], : p.hidden_size] = t
            else:
                out[: t.shape[0]] = t
        return out

    def writes_stream(self, module: str, kind: str, t: torch.Tensor | None) -> torch.Tensor:
        """o_proj/down: zero except the original block, so nothing new reaches the stream."""
        p, hd = self.p, self.p.head_dim
        cols = p.new_num_heads * hd if module == "self_attn.o_proj" else p.new_intermediate_size
        if kind == "bias":
            out = torch.zeros(p.new_hidden_size)  # [H2]
            if t is not None:
                out[: p.hidden_size] = t
            return out
        out = torch.zeros(p.new_hidden_size, cols)  # [H2, nh2*hd] or [H2, I2]
        if t is None:
            return out  # identity layer: writes nothing at all
        if module == "self_attn.o_proj":
            view = out.view(p.new_hidden_size, p.new_num_heads, hd)  # [H2, nh2, hd]
            view[: p.hidden_size, self.q_pos] = t.reshape(p.hidden_size, p.num_heads, hd)
        else:
            out[: p.hidden_size, : t.shape[1]] = t
        return out

    def layer_tensor(self, name: str, suffix: str, t: torch.Tensor | None) -> torch.Tensor:
        module, _, kind = suffix.rpartition(".")
        if module in _NORMS and kind == "weight":
            return self.norm(t)
        if module in _READS_STREAM and kind in ("weight", "bias"):
            return self.reads_stream(name, module, kind, t)
        if module in _WRITES_STREAM and kind in ("weight", "bias"):
            return self.writes_stream(module, kind, t)
        raise ValueError(f"don't know how to widen {name!r}")

    def stream_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Embedding / LM head [V, H] -> [V, H2] with zero extra columns."""
        out = torch.zeros(t.shape[0], self.p.new_hidden_size)  # [V, H2]
        out[:, : self.p.hidden_size] = t
        return out


def widen_state_dict(
    tensors: Mapping[str, torch.Tensor], plan: WidenPlan, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Widen a Llama/Qwen2 ``*ForCausalLM`` state dict (HF names) as the module docstring says."""
    w = _Widener(plan, seed)
    out: dict[str, torch.Tensor] = {}
    layer_suffixes: set[str] = set()

    def put(name: str, t: torch.Tensor) -> None:
        # Built in float32, rounded once: the original blocks match a plain cast of the source.
        out[name] = t.to(dtype).contiguous()

    for name, t in tensors.items():
        if _DROPPED.fullmatch(name):
            continue
        t = t.float()
        if m := _LAYER_KEY.fullmatch(name):
            layer_suffixes.add(m[2])
            put(name, w.layer_tensor(name, m[2], t))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            put(name, w.stream_rows(t))
        elif name == "model.norm.weight":
            put(name, w.norm(t))
        else:
            raise ValueError(f"don't know how to widen {name!r}")

    # Identity layers have the same tensors (biases included) as the source layers.
    for i in range(plan.num_layers, plan.new_num_layers):
        for suffix in sorted(layer_suffixes):
            name = f"model.layers.{i}.{suffix}"
            put(name, w.layer_tensor(name, suffix, None))
    return out


def _load_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{src} has no config.json; expected a Hugging Face checkpoint folder"
        )
    return json.loads(path.read_text())


def load_safetensors(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in its index."""
    single, index = src / "model.safetensors", src / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [src / f for f in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(
            f"{src} has neither model.safetensors nor model.safetensors.index.json"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def source_digest(src: Path) -> str:
    """sha256 over the names and bytes of the files in ``src`` (not recursive)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(src).iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def widen_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    spec: WidenSpec,
    *,
    overwrite: bool = False,
) -> Path:
    """Write the widened checkpoint of ``src`` into ``dst`` and return ``dst``.

    ``dst`` gets config.json, model.safetensors (in ``spec.dtype``, or the source's dtype), the
    tokenizer / generation files of ``src``, and ``widening.json`` (source hash, spec, version).
    """
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("destination must differ from the source")
    if not overwrite and ((dst / "model.safetensors").exists() or (dst / "config.json").exists()):
        raise FileExistsError(
            f"{dst} already holds a checkpoint; pass overwrite=True / --overwrite"
        )
    config = _load_config(src)
    plan = plan_widening(config, spec)
    tensors = load_safetensors(src)
    if spec.dtype is None:
        dtype = tensors["model.embed_tokens.weight"].dtype
        dtype_name = next((k for k, v in DTYPES.items() if v == dtype), None)
        if dtype_name is None:
            raise ValueError(f"source dtype {dtype} is not one of {list(DTYPES)}; pass dtype")
    elif spec.dtype in DTYPES:
        dtype_name, dtype = spec.dtype, DTYPES[spec.dtype]
    else:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {spec.dtype!r}")

    widened = widen_state_dict(tensors, plan, dtype, spec.seed)
    del tensors
    dst.mkdir(parents=True, exist_ok=True)
    save_file(widened, str(dst / "model.safetensors"), metadata={"format": "pt"})
    del widened
    (dst / "config.json").write_text(json.dumps(widened_config(config, plan, dtype_name), indent=2))
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    stamp = {
        "format_version": WIDEN_FORMAT_VERSION,
        "source": str(src.resolve()),
        "source_sha256": source_digest(src),
        "spec": asdict(spec),
        "plan": asdict(plan),
    }
    (dst / STAMP_FILE).write_text(json.dumps(stamp, indent=2))
    return dst


def _model_card(plan: WidenPlan, spec: WidenSpec, source_name: str, digest: str) -> str:
    def grow(old: int, new: int) -> str:
        return f"{old} -> {new}"

    return f"""# Widened target (synthetic benchmark fixture)

This is **not a trained model**. It is a synthetic fixture that specserve builds on demand so that
benchmarks have a target whose decode step is bound by memory bandwidth.

## How it is made

`specserve.draft_models.widen` grows {source_name} (source files sha256 `{digest[:16]}`):

- hidden size {grow(plan.hidden_size, plan.new_hidden_size)}
- layers {grow(plan.num_layers, plan.new_num_layers)} (the extra layers are appended)
- MLP width {grow(plan.intermediate_size, plan.new_intermediate_size)}
- query heads {grow(plan.num_heads, plan.new_num_heads)}, kv heads \
{grow(plan.num_kv_heads, plan.new_num_kv_heads)}, head size {plan.head_dim}
- weights stored in {spec.dtype or "the source's dtype"}; extra weights random with seed {spec.seed}

The extra residual channels stay zero. The extra heads, MLP channels and layers have random
weights that are read and multiplied at every step, but they write nothing back into the residual
stream. RMSNorm weights and epsilon are rescaled exactly for the wider stream.

## Its outputs equal the source's

Same logits up to floating-point rounding, same greedy tokens: a draft made for the source has the
same acceptance against this model. It knows nothing the source does not; use it only for
benchmarks. Delete this folder to rebuild it; `widening.json` records how it was built.
"""


def ensure_widened(
    src: str | os.PathLike,
    cache_dir: str | os.PathLike,
    spec: WidenSpec,
    source_name: str | None = None,
) -> Path:
    """Return ``cache_dir`` holding ``src`` widened by ``spec``, building it only when needed.

    ``source_name`` names the source in the README.md model card (default: its path).

    Reused when its ``widening.json`` records the same source hash, spec and format version.
    Built in a temporary sibling folder and renamed into place, so an interrupted build never
    leaves a half-written fixture behind.
    """
    src, cache_dir = Path(src), Path(cache_dir).expanduser()
    if not src.is_dir():
        raise FileNotFoundError(f"source checkpoint {src} does not exist")
    digest = source_digest(src)
    want = {"format_version": WIDEN_FORMAT_VERSION, "source_sha256": digest, "spec": asdict(spec)}
    stamp_path = cache_dir / STAMP_FILE

    def is_current() -> bool:
        if not stamp_path.is_file() or not (cache_dir / "model.safetensors").is_file():
            return False
        stamp = json.loads(stamp_path.read_text())
        return all(stamp.get(k) == v for k, v in want.items())

    if is_current():
        return cache_dir
    if cache_dir.exists() and any(cache_dir.iterdir()) and not stamp_path.is_file():
        # Not ours: never delete a folder this function did not build.
        raise FileExistsError(f"{cache_dir} exists and is not a widened checkpoint; choose another")

    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir.parent / f".{cache_dir.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        widen_checkpoint(src, tmp, spec)
        plan = plan_widening(_load_config(src), spec)
        card = _model_card(plan, spec, source_name or f"`{src}`", digest)
        (tmp / "README.md").write_text(card)
        if is_current():  # another process finished first: keep theirs
            return cache_dir
        if cache_dir.exists():
            shutil.rmtree(cache_dir)  # a stale fixture of ours (it has a stamp)
        tmp.rename(cache_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cache_dir


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/specserve/widened-demo-target`` (``~/.cache/...`` by default)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "specserve" / "widened-demo-target"


def ensure_widened_demo(cache_dir: Path | None = None) -> Path:
    """The benchmark fixture: the demo target widened by ``DEMO_WIDEN_SPEC``, built once and cached.

    ``cache_dir`` defaults to ``~/.cache/specserve/widened-demo-target``; it may not be inside the
    repository (the fixture is ~700 MiB). Rebuilt when the demo target's files change.
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    repo = Path(__file__).resolve().parents[1]
    if cache_dir.resolve().is_relative_to(repo):
        raise ValueError(
            f"cache_dir {cache_dir} is inside the repository {repo}; use a cache folder"
        )
    if not (DEMO_TARGET_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the bundled demo target is missing: {DEMO_TARGET_DIR}")
    name = "the bundled demo target (`draft_models/demo/target`)"
    return ensure_widened(DEMO_TARGET_DIR, cache_dir, DEMO_WIDEN_SPEC, source_name=name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m draft_models.widen",
        description="Widen a Llama/Qwen2 checkpoint into a larger one with the same outputs.",
    )
    parser.add_argument(
        "src", type=Path, help="source checkpoint folder (config.json + safetensors)"
    )
    parser.add_argument("dst", type=Path, help="output folder")
    parser.add_argument(
        "--hidden-size", type=int, required=True, help="a power-of-4 multiple of the source's"
    )
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--intermediate-size", type=int, required=True)
    parser.add_argument("--num-heads", type=int, help="default: hidden_size // head_dim")
    parser.add_argument("--num-kv-heads", type=int, help="default: the source's")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the source's")
    parser.add_argument("--seed", type=int, default=0, help="seed of the extra (random) weights")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint in DST")
    args = parser.parse_args(argv)
    spec = WidenSpec(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        intermediate_size=args.intermediate_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        dtype=args.dtype,
        seed=args.seed,
    )
    start = time.perf_counter()
    try:
        dst = widen_checkpoint(args.src, args.dst, spec, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        parser.error(str(e))
    size_mb = (dst / "model.safetensors").stat().st_size / 2**20
    print(
        f"wrote {dst} ({size_mb:.0f} MiB) in {time.perf_counter() - start:.1f} s", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
