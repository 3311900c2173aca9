"""Structured output: what a request's output must match (`spec.py`), compiling it for this
tokenizer with xgrammar under size and time caps (`compiler.py`), and the per-request matcher
that masks the draft's and the target's distributions at every tree node (`matcher.py`)."""

from .spec import StructuredOutput

__all__ = ["StructuredOutput"]
