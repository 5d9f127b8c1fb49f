"""Generic targets: a function, methods, a builtin, and a copy in another module."""

from __future__ import annotations

import binascii

import torch

crc = binascii.crc_hqx  # a builtin (C function) without a Python signature


def axpy(alpha: float, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y += alpha * x in place; returns a new tensor x * 2."""
    y.add_(x, alpha=alpha)
    return x * 2


def cheap(x: int) -> int:
    return x + 1


def fails(x: torch.Tensor, message: str) -> None:
    x.mul_(3)  # mutates before raising: the dump must hold the value before the call
    raise ValueError(message)


class Layer:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    @staticmethod
    def static_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y
