"""flash-linear-attention's naive (pure PyTorch) reference implementations, imported by file path.

Importing the ``fla`` package itself pulls in its GPU kernels (and their compiler), which this CPU
environment deliberately lacks; the ``naive.py`` files need only torch and einops, so each is loaded on its
own. Tests use these as independent references; nothing in ``src/`` depends on them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


def fla_root() -> Path | None:
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def load_naive(op: str) -> ModuleType:
    """``fla/ops/<op>/naive.py`` as a module (``op`` = ``kda``, ``attnres`` ...); skip the test if absent."""
    root = fla_root()
    path = None if root is None else root / "ops" / op / "naive.py"
    if path is None or not path.is_file():
        pytest.skip(f"flash-linear-attention's ops/{op}/naive.py is not installed")
    spec = importlib.util.spec_from_file_location(f"fla_naive_{op}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
