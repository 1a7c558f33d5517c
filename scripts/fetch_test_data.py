"""Fetch the test data that comes from llama.cpp, once, into a cache the tests read.

llama.cpp ships the vocabularies of real models (``models/ggml-vocab-NAME.gguf``, with
the ids transformers gave on the original model for a set of texts) and its own HF ->
GGUF converter (``convert_hf_to_gguf.py`` with its ``gguf-py``). Both come from the
``llama-cpp-python`` source distribution on PyPI, pinned by version and checked by its
SHA-256; only those files are extracted. ``scripts/setup.sh test`` runs this.

    python scripts/fetch_test_data.py [--dest DIR]     # default: $RVLLM_TEST_DATA

The destination defaults to ``$RVLLM_TEST_DATA``, else ``~/.cache/rvllm-test-data``;
the tests look in the same place (``tests/llama_cpp_data.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
INDEX = f"https://pypi.org/simple/{PACKAGE}/"
WANTED = ("vendor/llama.cpp/models/ggml-vocab-", "vendor/llama.cpp/convert_hf_to_gguf.py",
          "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/")
# What a complete copy records: a copy made with another list of files is fetched again.
STAMP = f"{SDIST} {SHA256} {' '.join(WANTED)}\n"


def default_dest() -> Path:
    return Path(os.environ.get("RVLLM_TEST_DATA") or Path.home() / ".cache" / "rvllm-test-data")


def _sdist_url() -> str:
    request = urllib.request.Request(
        INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        files = json.load(reply)["files"]
    for entry in files:
        if entry["filename"] == SDIST:
            return entry["url"]
    raise SystemExit(f"{SDIST} is not on {INDEX}")


def _download() -> bytes:
    url = _sdist_url()
    for attempt in range(3):
        try:
            with urllib.request.urlopen(url, timeout=300) as reply:
                data = reply.read()
            break
        except OSError as error:
            if attempt == 2:
                raise SystemExit(f"could not download {url}: {error}") from None
            time.sleep(5 * (attempt + 1))
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{SDIST}: SHA-256 {digest}, expected {SHA256}")
    return data


def fetch(dest: Path) -> Path:
    """The llama.cpp folder under ``dest`` (``models/``, ``convert_hf_to_gguf.py`` with
    ``conversion/`` and ``gguf-py/``), fetched unless a complete copy is there."""
    root = dest / f"llama.cpp-{VERSION}"
    done = root / ".complete"
    if done.is_file() and done.read_text() == STAMP:
        return root
    data = _download()
    partial = dest / f".llama.cpp-{VERSION}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            inner = member.name.removeprefix(f"llama_cpp_python-{VERSION}/")
            if not member.isfile() or not inner.startswith(WANTED):
                continue
            target = partial / member.name.removeprefix(prefix)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    (partial / ".complete").write_text(STAMP)
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    return root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=default_dest())
    ns = parser.parse_args()
    root = fetch(ns.dest)
    print(f"llama.cpp test data ({SDIST}) in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
