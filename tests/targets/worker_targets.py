"""Stand-in kernels that tell which process ran them (for the worker-reuse tests)."""

from __future__ import annotations

import os

import torch


def scale_noting_pid(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2.0)
    with open(os.environ["KDUMP_TEST_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")


def crash_noting_pid(x: torch.Tensor, out: torch.Tensor) -> None:
    with open(os.environ["KDUMP_TEST_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
    os.abort()
