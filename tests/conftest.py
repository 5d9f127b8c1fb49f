from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


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
def bench_import(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Imports a module of bench/ by name (its scripts import each other so, from that folder)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module
