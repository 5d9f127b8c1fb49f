"""User kernels without a kdump spec, each with one planted bug of a class kdump exists for, in
torch and in C (through ctypes): what a user records with `kdump record -t mod:fn` and replays.

`KDUMP_TEST_BUG` (read at each call) turns a correct function into a subtly wrong one at replay
time, as a regression would: `lastrow` leaves the last row of `out` unwritten, `offset` adds
0.001. The C library is the one `KDUMP_TEST_CLIB` names (built by the tests from C_SOURCE).
"""

from __future__ import annotations

import ctypes
import os

import torch

C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

/* out[i] = 2 x[i] for i < n + over: `over` elements past the end of out. */
void scale(const float *x, float *out, int64_t n, int64_t over) {
    for (int64_t i = 0; i < n + over; i++) out[i] = 2.0f * (i < n ? x[i] : 1.0f);
}

/* Caches its input pointer at the first call (per size) and reads it at every later call. */
static const float *cached = 0;
static int64_t cached_n = -1;
void stale_scale(const float *x, float *out, int64_t n) {
    if (cached_n != n) { cached = x; cached_n = n; }
    for (int64_t i = 0; i < n; i++) out[i] = 2.0f * cached[i];
}

/* A different result at every call: a counter stands in for an unordered reduction. */
static int64_t calls = 0;
void drifting_sum(const float *x, float *out, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += x[i];
    out[0] = acc + 1e-3f * (float)(++calls);
}
"""


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(os.environ["KDUMP_TEST_CLIB"])
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.scale.argtypes = [p, p, i64, i64]
    lib.stale_scale.argtypes = [p, p, i64]
    lib.drifting_sum.argtypes = [p, p, i64]
    return lib


def _bug() -> str:
    return os.environ.get("KDUMP_TEST_BUG", "")


def torch_scale(x: torch.Tensor, out: torch.Tensor) -> None:
    """out = 2 x (the clean one; KDUMP_TEST_BUG makes it subtly wrong)."""
    if _bug() == "lastrow":
        out[:-1].copy_(x[:-1] * 2)
        return
    out.copy_(x * 2 + (1e-3 if _bug() == "offset" else 0.0))


def torch_accumulate(x: torch.Tensor, acc: torch.Tensor) -> None:
    """acc += x: an argument both read and written."""
    acc.add_(x)


_rows: dict[int, torch.Tensor] = {}


def torch_workspace(x: torch.Tensor, labels: torch.Tensor, out: torch.Tensor) -> None:
    """Keeps the rows of its FIRST call per output buffer (capture-unsafe state)."""
    rows = _rows.setdefault(out.data_ptr(), torch.nonzero(labels >= 0).flatten())
    out.zero_()
    out.index_copy_(0, rows, x.index_select(0, rows) * 2)


def torch_noisy(x: torch.Tensor, out: torch.Tensor) -> None:
    """A different result at every run."""
    out.copy_(x + torch.rand(()))


def c_scale(x: torch.Tensor, out: torch.Tensor) -> None:
    """The clean C kernel."""
    _lib().scale(x.data_ptr(), out.data_ptr(), out.numel(), 0)


def c_overrun(x: torch.Tensor, out: torch.Tensor) -> None:
    """The C kernel writing 16 floats past the end of `out`."""
    _lib().scale(x.data_ptr(), out.data_ptr(), out.numel(), 16)


def c_stale(x: torch.Tensor, out: torch.Tensor) -> None:
    _lib().stale_scale(x.data_ptr(), out.data_ptr(), out.numel())


def c_drifting(x: torch.Tensor, out: torch.Tensor) -> None:
    _lib().drifting_sum(x.data_ptr(), out.data_ptr(), x.numel())
