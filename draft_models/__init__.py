"""Draft models for specserve: the bundled demo target/draft pair and the recipe that builds it.

Modules: ``data`` (stdlib corpus and training windows), ``tokenizer`` (byte-level BPE + ChatML),
``train`` (pre-training loop and checkpoint export), ``distill`` (distil a draft toward any HF
target; also a CLI), ``evaluate`` (validation loss, acceptance length, sample replies) and
``recipe`` (the one command that rebuilds ``demo/``).
"""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_TARGET_DIR = DEMO_DIR / "target"
DEMO_DRAFT_DIR = DEMO_DIR / "draft"

__all__ = ["DEMO_DIR", "DEMO_DRAFT_DIR", "DEMO_TARGET_DIR"]
