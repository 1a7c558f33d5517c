"""numba's on-disk cache for the CPU kernels, checked against every kernel's source.

numba checks a cached function against the modification time and size of its own file
only. A kernel that inlines functions of another module (the decoder step, the GEMV's
dot products; the batch step, the decode attention) kept its stale machine code when
only that other module changed, say by a ``git pull``, and ran the old code. Importing
this module (every kernel module here does, before its first ``njit``) makes numba check the
kernels' cached code against a digest of all of those sources instead: any change to
any of them compiles every kernel afresh (minutes, once: ``scripts/setup.sh``). Where
the cache lives is numba's choice as before (``NUMBA_CACHE_DIR``, else beside the
sources, else the user's cache directory); other functions' caching is left alone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from numba.core import caching

_KERNELS = Path(__file__).resolve().parent
_SOURCES = sorted(_KERNELS.glob("*.py"))


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in _SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


_DIGEST = _sources_digest()


class _KernelSources:
    """A locator mixin: only the kernels' functions, stamped with the sources' digest."""

    def get_source_stamp(self) -> str:
        return _DIGEST

    @classmethod
    def from_function(cls, py_func, py_file):  # noqa: ANN001, ANN206 - numba's signature
        if Path(py_file).resolve().parent != _KERNELS:
            return None
        return super().from_function(py_func, py_file)


# numba tries its locators in order: the same three places, for the kernels first.
_LOCATORS = [type(f"Kernels{base.__name__}", (_KernelSources, base), {})
             for base in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                          caching.UserWideCacheLocator)]
if not any(issubclass(c, _KernelSources) for c in caching.CacheImpl._locator_classes):
    caching.CacheImpl._locator_classes[:0] = _LOCATORS
