"""The one `speculation` option, parsed once into a `SpecMode`.

Spellings (the same for `LLM(speculation=...)`, `--speculation` and the WebSocket request):
"off"; None (off without a proposer, the engine's best mode with one); "chain:K"; "tree" or
"tree:N" (dynamic EAGLE-2-style tree of N nodes); "static:NAME" or a list of child-index paths;
"ngram:K"; "adaptive".
"""

from __future__ import annotations

from dataclasses import dataclass

from .tree import STATIC_TREES, validate_paths

DEFAULT_TREE_NODES = 24
# Dynamic tree: each level expands the best TOPK frontier nodes with TOPK children each.
DEFAULT_TREE_TOPK = 4
DEFAULT_TREE_DEPTH = 5


@dataclass(frozen=True)
class SpecMode:
    kind: str  # "off" | "chain" | "tree" | "static" | "ngram" | "adaptive"
    num_tokens: int = 0  # chain/ngram: K; tree: N nodes; static: nodes in the shape
    paths: tuple[tuple[int, ...], ...] = ()  # static: child-index paths, Medusa style
    name: str = ""

    @property
    def enabled(self) -> bool:
        return self.kind != "off"

    @property
    def needs_draft_model(self) -> bool:
        return self.kind in ("chain", "tree", "static", "adaptive")

    def __str__(self) -> str:
        if self.kind in ("chain", "ngram", "tree"):
            return f"{self.kind}:{self.num_tokens}"
        if self.kind == "static":
            return f"static:{self.name}" if self.name else "static"
        return self.kind


OFF = SpecMode("off")
ADAPTIVE = SpecMode("adaptive")


def best_mode(has_draft: bool, device: str = "cpu") -> SpecMode:
    """What `speculation=None` means.

    On a GPU verifying a tree of N nodes costs about one decode step, so the dynamic tree wins.
    On a CPU each verified row costs compute (a 25-node tree ~2x a decode step on the widened
    benchmark pair), so chains beat trees there; `adaptive` picks a chain length per request
    from measured acceptance and costs, needs no per-pair tuning and stops drafting where it
    does not pay. In bench/RESULTS.md it came within 10% of the best fixed chain (chain:4),
    ahead of it in some runs.
    """
    if not has_draft:
        return OFF
    return SpecMode("tree", DEFAULT_TREE_NODES) if device.startswith("cuda") else ADAPTIVE


def parse_speculation(value, has_draft: bool, device: str = "cpu") -> SpecMode:
    """Parse a speculation spelling; errors name the bad value."""
    if isinstance(value, SpecMode):
        mode = value
    elif value is None:
        mode = best_mode(has_draft, device)
    elif isinstance(value, (list, tuple)):
        paths = validate_paths(value)
        mode = SpecMode("static", len(paths), paths)
    elif isinstance(value, str):
        mode = _parse_string(value.strip())
    else:
        raise ValueError(f"speculation must be a string or a list of paths, got {value!r}")
    if mode.needs_draft_model and not has_draft:
        raise ValueError(f"speculation {str(mode)!r} needs a draft model; none is loaded "
                         f"(use 'off' or 'ngram:K')")
    return mode


def _parse_string(value: str) -> SpecMode:
    kind, _, arg = value.partition(":")
    if kind in ("off", "adaptive") and not arg:
        return SpecMode(kind)
    if kind == "tree" and not arg:
        return SpecMode("tree", DEFAULT_TREE_NODES)
    if kind == "static":
        if arg not in STATIC_TREES:
            raise ValueError(f"unknown static tree {arg!r}; known: {', '.join(STATIC_TREES)}")
        paths = validate_paths(STATIC_TREES[arg])
        return SpecMode("static", len(paths), paths, arg)
    if kind in ("chain", "tree", "ngram"):
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"speculation {value!r}: expected {kind}:<int>") from None
        limit = 64 if kind == "tree" else 16
        if not 1 <= k <= limit:
            raise ValueError(f"speculation {value!r}: {kind} size must be in 1..{limit}")
        return SpecMode(kind, k)
    raise ValueError(f"unknown speculation {value!r}; use off, chain:K, tree, tree:N, "
                     f"static:NAME, ngram:K or adaptive")
