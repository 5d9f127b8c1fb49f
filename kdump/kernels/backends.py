"""Backend lookup by name, kept for older importers; kdump.kernels.registry is the one place."""

from __future__ import annotations

from kdump.kernels.registry import backend_names, choose_backend, get_backend

BACKEND_NAMES = backend_names()

__all__ = ["BACKEND_NAMES", "backend_names", "choose_backend", "get_backend"]
