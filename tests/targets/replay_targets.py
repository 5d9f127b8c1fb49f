"""Small stand-in kernels for replay tests (imported by the replay child process)."""

from __future__ import annotations

import os
import time

import torch


def scale_into(x: torch.Tensor, out: torch.Tensor, factor: float = 2.0) -> None:
    out.copy_(x * factor)


def crash(x: torch.Tensor, out: torch.Tensor) -> None:
    os.abort()  # what a kernel fault does to the process, as far as the parent can tell


def hang(x: torch.Tensor, out: torch.Tensor) -> None:
    time.sleep(3600)


def noisy(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x + torch.rand_like(x))  # different on every run


def raises(x: torch.Tensor, out: torch.Tensor) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def overread(x: torch.Tensor, out: torch.Tensor) -> None:
    """Reads one row past the end of x (through a raw pointer, as a TMA descriptor that claims
    too many rows would)."""
    import ctypes

    n = x.numel() + x.shape[1]
    raw = torch.frombuffer((ctypes.c_float * n).from_address(x.data_ptr()), dtype=torch.float32)
    out.copy_(raw[x.shape[1] :].view(x.shape) * 2.0)


def exits(x: torch.Tensor, out: torch.Tensor) -> None:
    os._exit(3)  # a library that ends the process without a signal
