"""Importing the package never defines a Triton kernel.

triton reads TRITON_INTERPRET when a kernel is defined, and the kernel tests set
it once collection has imported other test modules; a module outside
rvllm/kernels that imports a kernel at import time breaks their collection.
"""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "rvllm", "rvllm.cli", "rvllm.engine.llm", "rvllm.engine.async_engine",
    "rvllm.executor.model_runner", "rvllm.executor.kv_cache", "rvllm.models.loader",
    "rvllm.models.registry", "rvllm.models.gguf_loader", "rvllm.models.dequant",
    "rvllm.tokenizer", "rvllm.server.app", "rvllm.bench.engine",
]


def test_no_module_outside_kernels_imports_a_kernel_or_gguf_at_import_time() -> None:
    script = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('rvllm.kernels.', 'gguf'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"
