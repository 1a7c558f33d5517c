"""Benchmarks: the direct engine (``rvllm benchmark``), HTTP serving load (``rvllm bench
serve``), the launch-to-finished race (``rvllm bench race``), CPU-side micro-benchmarks
(``rvllm bench micro``), and the peers they are compared with.

Nothing here is imported by the engine; each command imports its own module lazily.
"""
