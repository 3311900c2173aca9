"""docs/ARCHITECTURE.md names modules, classes and methods: each one must exist, so the page
cannot drift from the code unnoticed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"


def backticked_names(text: str) -> list[str]:
    """Dotted Python names in backticks (a name may wrap onto the next line after a dot)."""
    spans = re.findall(r"`([^`]+)`", text.replace("\n", " "))
    names = [re.sub(r"\s+", "", s) for s in spans]
    return [n for n in names if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+|[A-Z]\w+", n)]


def resolve(name: str, modules: list) -> object:
    """`specserve.a.b.Name.attr`, or `Name.attr` / `Name` found in one of `modules`."""
    parts = name.split(".")
    if parts[0] == "specserve":
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return obj
    for module in modules:
        if hasattr(module, parts[0]):
            obj = module
            for attr in parts:
                obj = getattr(obj, attr)
            return obj
    raise LookupError(name)


def test_every_name_in_the_architecture_page_exists():
    names = backticked_names(DOC.read_text())
    modules = []
    for name in names:
        if name.startswith("specserve."):
            parts = name.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    modules.append(importlib.import_module(".".join(parts[:cut])))
                    break
                except ModuleNotFoundError:
                    continue
    # Protocol event names (`response.done`) are not code: names start at a package or class.
    code_names = [n for n in names if n.startswith("specserve.") or n[0].isupper()]
    assert len(code_names) > 15
    missing = []
    for name in code_names:
        try:
            resolve(name, modules)
        except (LookupError, AttributeError):
            missing.append(name)
    assert not missing, f"named in {DOC.name} but not in the code: {missing}"


def test_the_check_finds_a_missing_name():
    modules = [importlib.import_module("specserve.engine.core")]
    with pytest.raises(AttributeError):
        resolve("EngineCore.no_such_method", modules)
    with pytest.raises(LookupError):
        resolve("NoSuchClass.method", modules)
