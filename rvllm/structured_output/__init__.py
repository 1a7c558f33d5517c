"""Structured output: a request's constraint (``SamplingParams.structured_outputs``) as a
grammar whose allowed tokens mask the logits before each sample.

``backends.py`` turns a constraint into a grammar engine's compiled grammar and a
per-sequence matcher (llguidance, the default, or xgrammar); ``manager.py`` compiles on a
thread pool with a cache, and fills one step's bitmask for the sampler.
"""

from rvllm.structured_output.backends import STRUCTURED_OUTPUT_BACKENDS
from rvllm.structured_output.manager import StructuredOutputManager

__all__ = ["STRUCTURED_OUTPUT_BACKENDS", "StructuredOutputManager"]
