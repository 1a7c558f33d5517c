"""What every benchmark writes beside its numbers: the machine, the JSON file, the table."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    """The machine the numbers came from; absolute numbers mean nothing without it."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kb = int(f.readline().split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def lscpu() -> dict[str, Any]:
    """The CPU as ``lscpu`` describes it (empty where there is no lscpu): model, CPUs,
    threads per core, cores per socket, and whether it has AVX-512."""
    import subprocess

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return {"model_name": fields.get("Model name"), "cpus": fields.get("CPU(s)"),
            "threads_per_core": fields.get("Thread(s) per core"),
            "cores_per_socket": fields.get("Core(s) per socket"),
            "flags_avx512f": "avx512f" in fields.get("Flags", "")}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    """Write ``result`` (stamped with the time and the machine) as indented JSON."""
    result = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **result}
    result.setdefault("machine", machine_info())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=_nan_safe) + "\n", encoding="utf-8")


def _nan_safe(value: Any) -> Any:
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A plain-text table: ``columns`` are (key, header) pairs; floats get 1 decimal."""
    header = [h for _, h in columns]
    body = [[_cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)
