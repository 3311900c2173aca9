"""The one `speculation` option, parsed once into a `SpecMode`.

Spellings (the same for `LLM(speculation=...)`, `--speculation` and the WebSocket request):
"off"; None (off without a proposer, the engine's best mode with one); "chain:K"; "tree" or
"tree:N" (dynamic EAGLE-2-style tree of N nodes); "static:NAME" or a list of child-index paths;
"ngram:K"; "adaptive"; "suffix" or "suffix:K" (suffix drafting from the prompts and earlier
outputs, a tree of up to K nodes, no draft model); "suffix+MODE" or "suffix:K+MODE" (suffix
drafting where the text has occurred before, MODE, a draft-model mode, elsewhere).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .tree import STATIC_TREES, validate_paths

DEFAULT_TREE_NODES = 24
# Dynamic tree: each level expands the best TOPK frontier nodes with TOPK children each.
DEFAULT_TREE_TOPK = 4
DEFAULT_TREE_DEPTH = 5
DEFAULT_SUFFIX_NODES = 8


class SpecKind(str, enum.Enum):
    """The kinds of speculation (a str enum: compares equal to its spelling)."""

    OFF = "off"
    CHAIN = "chain"  # K draft tokens in a line
    TREE = "tree"  # dynamic EAGLE-2-style tree of N nodes
    STATIC = "static"  # a fixed Medusa-style shape
    NGRAM = "ngram"  # prompt lookup, no draft model
    ADAPTIVE = "adaptive"  # a chain length (or off) per request and step
    SUFFIX = "suffix"  # continuations of earlier text (speculation/suffix.py), no draft model


@dataclass(frozen=True)
class SpecMode:
    kind: SpecKind
    num_tokens: int = 0  # chain/ngram: K; tree: N nodes; static: nodes in the shape
    paths: tuple[tuple[int, ...], ...] = ()  # static: child-index paths, Medusa style
    name: str = ""
    # suffix: the draft-model mode of the steps whose text has not occurred before (None: off)
    fallback: SpecMode | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SpecKind(self.kind))

    @property
    def enabled(self) -> bool:
        return self.kind is not SpecKind.OFF

    @property
    def needs_draft_model(self) -> bool:
        if self.kind is SpecKind.SUFFIX:
            return self.fallback is not None
        return self.kind in (SpecKind.CHAIN, SpecKind.TREE, SpecKind.STATIC, SpecKind.ADAPTIVE)

    @property
    def is_adaptive(self) -> bool:
        """The engine resolves this mode to a chain length (or off) per request and step."""
        return self.kind is SpecKind.ADAPTIVE

    def __str__(self) -> str:
        if self.kind is SpecKind.SUFFIX:
            return f"suffix:{self.num_tokens}" + (f"+{self.fallback}" if self.fallback else "")
        if self.kind in (SpecKind.CHAIN, SpecKind.NGRAM, SpecKind.TREE):
            return f"{self.kind.value}:{self.num_tokens}"
        if self.kind is SpecKind.STATIC:
            return f"static:{self.name}" if self.name else "static"
        return self.kind.value


OFF = SpecMode(SpecKind.OFF)
ADAPTIVE = SpecMode(SpecKind.ADAPTIVE)


def best_mode(has_draft: bool, device: str = "cpu") -> SpecMode:
    """What `speculation=None` means.

    On a GPU verifying a tree of N nodes costs about one decode step, so the dynamic tree wins.
    On a CPU each verified row costs compute (a 25-node tree ~2x a decode step on the widened
    benchmark pair), so chains beat trees there; `adaptive` picks a chain length per request
    from measured acceptance and costs, needs no per-pair tuning and stops drafting where it
    does not pay. In bench/RESULTS.md it came within 10% of the best fixed chain (chain:4),
    ahead of it in some runs. Suffix drafting goes first where the text has occurred before:
    on the default model (first-generation Zen, 6 held-out questions, 64 tokens, greedy) it
    committed 1.62 tokens per target forward on second turns against adaptive's 1.04, and the
    same 1.04 on first turns, with identical tokens.
    """
    if not has_draft:
        return OFF
    if device.startswith("cuda"):
        return SpecMode(SpecKind.TREE, DEFAULT_TREE_NODES)
    return SpecMode(SpecKind.SUFFIX, DEFAULT_SUFFIX_NODES, fallback=ADAPTIVE)


def parse_speculation(value, has_draft: bool, device: str = "cpu") -> SpecMode:
    """Parse a speculation spelling; errors name the bad value."""
    if isinstance(value, SpecMode):
        mode = value
    elif value is None:
        mode = best_mode(has_draft, device)
    elif isinstance(value, (list, tuple)):
        paths = validate_paths(value)
        mode = SpecMode(SpecKind.STATIC, len(paths), paths)
    elif isinstance(value, str):
        mode = _parse_string(value.strip())
    else:
        raise ValueError(f"speculation must be a string or a list of paths, got {value!r}")
    if mode.needs_draft_model and not has_draft:
        raise ValueError(f"speculation {str(mode)!r} needs a draft model; none is loaded "
                         f"(use 'off' or 'ngram:K')")
    return mode


def _parse_string(value: str) -> SpecMode:
    if value.startswith(SpecKind.SUFFIX.value):
        return _parse_suffix(value)
    spelling, _, arg = value.partition(":")
    try:
        kind = SpecKind(spelling)
    except ValueError:
        kind = None
    if kind in (SpecKind.OFF, SpecKind.ADAPTIVE) and not arg:
        return SpecMode(kind)
    if kind is SpecKind.TREE and not arg:
        return SpecMode(kind, DEFAULT_TREE_NODES)
    if kind is SpecKind.STATIC:
        if arg not in STATIC_TREES:
            raise ValueError(f"unknown static tree {arg!r}; known: {', '.join(STATIC_TREES)}")
        paths = validate_paths(STATIC_TREES[arg])
        return SpecMode(kind, len(paths), paths, arg)
    if kind in (SpecKind.CHAIN, SpecKind.TREE, SpecKind.NGRAM):
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"speculation {value!r}: expected {spelling}:<int>") from None
        limit = 64 if kind is SpecKind.TREE else 16
        if not 1 <= k <= limit:
            raise ValueError(f"speculation {value!r}: {spelling} size must be in 1..{limit}")
        return SpecMode(kind, k)
    raise ValueError(f"unknown speculation {value!r}; use off, chain:K, tree, tree:N, "
                     f"static:NAME, ngram:K, adaptive, suffix, suffix:K or suffix+MODE")


def _parse_suffix(value: str) -> SpecMode:
    """"suffix", "suffix:K", either with "+MODE" (MODE a draft-model mode)."""
    own, plus, rest = value.partition("+")
    spelling, colon, arg = own.partition(":")
    if spelling != SpecKind.SUFFIX.value or (colon and not arg):
        raise ValueError(f"speculation {value!r}: expected suffix, suffix:K or suffix+MODE")
    k = DEFAULT_SUFFIX_NODES
    if arg:
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"speculation {value!r}: expected suffix:<int>") from None
        if not 1 <= k <= 64:
            raise ValueError(f"speculation {value!r}: suffix size must be in 1..64")
    fallback = None
    if plus:
        fallback = _parse_string(rest.strip())
        if not fallback.needs_draft_model or fallback.kind is SpecKind.SUFFIX:
            raise ValueError(f"speculation {value!r}: after suffix+ comes a draft-model mode "
                             f"(chain:K, tree, tree:N, static:NAME or adaptive)")
    return SpecMode(SpecKind.SUFFIX, k, fallback=fallback)
