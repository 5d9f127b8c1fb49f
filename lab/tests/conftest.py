"""The lab's tests (run them with `python -m pytest lab/tests`; the product's `pytest -q` collects
tests/ only). Lab scripts import each other and bench/'s helpers by module name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def lab_import(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Imports a module of lab/ by name (bench/ on the path too: lab scripts use its helpers)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.syspath_prepend(str(ROOT / "lab"))
    return importlib.import_module
