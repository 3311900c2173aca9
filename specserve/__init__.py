"""specserve: a low-latency LLM chat server built around tree speculative decoding."""

from .llm import LLM
from .outputs import RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
