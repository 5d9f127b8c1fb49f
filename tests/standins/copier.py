"""Holds a copy of plainmod.axpy taken at import time."""

from __future__ import annotations

from plainmod import axpy as my_axpy

__all__ = ["my_axpy"]
