"""Run test modules with pytest, or, where pytest is not installed (a bare GPU box with
only PyTorch, Triton and transformers), with a minimal stand-in for the parts of
pytest our kernel and CUDA-graph tests use: parametrize, skipif, autouse fixtures,
monkeypatch, raises, importorskip.

    python scripts/run_tests.py tests/test_kernels.py tests/test_cuda_graphs.py [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import itertools
import json
import re
import sys
import time
import traceback
import types
from pathlib import Path


class Skipped(Exception):
    pass


class _Mark:
    def parametrize(self, names, values, ids=None):
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)

        def wrap(fn):
            rows = [v if len(names) > 1 else (v,) for v in values]
            fn.__dict__.setdefault("params", []).insert(0, [dict(zip(names, r)) for r in rows])
            return fn
        return wrap

    def skipif(self, condition, reason=""):
        def wrap(fn):
            if condition:
                fn.skip_reason = reason
            return fn
        return wrap


class MonkeyPatch:
    def __init__(self) -> None:
        self._undo: list = []

    def setitem(self, mapping, key, value) -> None:
        old = mapping.get(key, MonkeyPatch)
        self._undo.append((mapping, key, old))
        mapping[key] = value

    def undo(self) -> None:
        for mapping, key, old in reversed(self._undo):
            if old is MonkeyPatch:
                del mapping[key]
            else:
                mapping[key] = old


@contextlib.contextmanager
def raises(exc_type, match=None):
    try:
        yield
    except exc_type as exc:
        if match and not re.search(match, str(exc)):
            raise AssertionError(f"{exc!r} does not match {match!r}") from exc
    else:
        raise AssertionError(f"did not raise {exc_type.__name__}")


def importorskip(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise Skipped(f"{name} not importable") from exc


def fixture(fn=None, *, autouse=False):
    def wrap(f):
        f.autouse = autouse
        return f
    return wrap(fn) if fn is not None else wrap


def _install_stand_in() -> None:
    mod = types.ModuleType("pytest")
    mod.mark, mod.raises, mod.importorskip, mod.fixture = _Mark(), raises, importorskip, fixture
    mod.skip = lambda reason="": (_ for _ in ()).throw(Skipped(reason))
    sys.modules["pytest"] = mod


def _run_module(path: Path, results: list[dict]) -> None:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Skipped as exc:
        results.append({"test": str(path), "outcome": "skipped", "detail": str(exc)})
        return
    autouse = [f for f in vars(module).values() if getattr(f, "autouse", False)]
    for name, fn in vars(module).items():
        if not (name.startswith("test_") and callable(fn)):
            continue
        combos = itertools.product(*getattr(fn, "params", [])) if hasattr(fn, "params") else [()]
        for combo in combos:
            kwargs = {k: v for part in combo for k, v in part.items()}
            test_id = f"{path.name}::{name}[{'-'.join(map(str, kwargs.values()))}]"
            results.append(_run_one(fn, kwargs, autouse, test_id))


def _run_one(fn, kwargs: dict, autouse: list, test_id: str) -> dict:
    if getattr(fn, "skip_reason", None):
        return {"test": test_id, "outcome": "skipped", "detail": fn.skip_reason}
    patch = MonkeyPatch()
    if "monkeypatch" in inspect.signature(fn).parameters:
        kwargs["monkeypatch"] = patch
    start = time.perf_counter()
    try:
        for f in autouse:
            f()
        fn(**kwargs)
        outcome, detail = "passed", ""
    except Skipped as exc:
        outcome, detail = "skipped", str(exc)
    except Exception:
        outcome, detail = "failed", traceback.format_exc(limit=4)
    finally:
        patch.undo()
    return {"test": test_id, "outcome": outcome, "detail": detail,
            "seconds": round(time.perf_counter() - start, 3)}


class _Collect:
    """pytest plugin: the same per-test records as the stand-in runner."""

    def __init__(self, results: list[dict]) -> None:
        self.results = results

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.results.append({"test": report.nodeid, "outcome": report.outcome,
                                 "detail": str(report.longrepr) if report.failed else "",
                                 "seconds": round(report.duration, 3)})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="write the per-test results here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    results: list[dict] = []
    try:
        import pytest
    except ImportError:
        pytest = None
    if pytest is not None:  # pytest prints its own report
        pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *map(str, args.paths)],
                    plugins=[_Collect(results)])
    else:
        _install_stand_in()
        for path in args.paths:
            _run_module(path, results)
        for r in results:
            if r["outcome"] == "failed":
                print(f"FAILED {r['test']}\n{r['detail']}")
    counts = {k: sum(r["outcome"] == k for r in results) for k in ("passed", "failed", "skipped")}
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if args.json:
        args.json.write_text(json.dumps({"runner": "pytest" if pytest else "stand-in",
                                         "counts": counts, "results": results}, indent=1))
    return 1 if counts["failed"] or not results else 0


if __name__ == "__main__":
    sys.exit(main())
