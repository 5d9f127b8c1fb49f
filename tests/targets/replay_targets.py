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


def _raw_floats(x: torch.Tensor, before: int, count: int) -> torch.Tensor:
    """`count` float32 starting `before` elements ahead of x's first one, through a raw pointer
    (no bounds: what a kernel with a wrong extent sees)."""
    import ctypes

    ptr = x.data_ptr() - 4 * before
    return torch.frombuffer((ctypes.c_float * count).from_address(ptr), dtype=torch.float32)


def tail_overread(x: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = 2 * x[i + 4]: the last 4 elements come from the 16 bytes past the end of x."""
    out.copy_(_raw_floats(x, 0, x.numel() + 4)[4:].view(x.shape) * 2.0)


def tail_inbounds(x: torch.Tensor, out: torch.Tensor) -> None:
    """tail_overread's shapes, in bounds: the last 4 elements wrap round to x's first ones."""
    flat = x.reshape(-1)
    out.copy_(torch.cat([flat[4:], flat[:4]]).view(x.shape) * 2.0)


def head_overread(x: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = 2 * x[i - 2]: the first 2 elements come from the 8 bytes before the start of x."""
    out.copy_(_raw_floats(x, 2, x.numel())[: x.numel()].view(x.shape) * 2.0)


def scripted_noise(x: torch.Tensor, out: torch.Tensor) -> None:
    """out = x, except on the calls (counted in this process) that KDUMP_TEST_FLIPS lists
    ("1,3,4"): there the last element is off by 1000. Each call appends its number to the
    file KDUMP_TEST_CALLS names."""
    global _scripted_calls
    n, _scripted_calls = _scripted_calls, _scripted_calls + 1
    with open(os.environ["KDUMP_TEST_CALLS"], "a") as f:
        f.write(f"{n}\n")
    out.copy_(x)
    if str(n) in os.environ.get("KDUMP_TEST_FLIPS", "").split(","):
        out.view(-1)[-1] += 1000.0


_scripted_calls = 0


def row_lottery(x: torch.Tensor, out: torch.Tensor) -> None:
    """out = x, except that each row comes out off by 1000 with odds of one half on every call
    (seeded by the call's number in this process, so a test sees the same draws every time):
    what atomics deciding which rows a kernel writes look like, whatever the halos hold."""
    global _lottery_calls
    n, _lottery_calls = _lottery_calls, _lottery_calls + 1
    gen = torch.Generator().manual_seed(1000 + n)
    flip = torch.rand(x.shape[0], generator=gen) < 0.5
    out.copy_(x)
    out[flip] += 1000.0


_lottery_calls = 0
