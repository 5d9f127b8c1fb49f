"""Equality of large byte ranges split over the hashing pool (kdump.bundle.bytecmp)."""

from __future__ import annotations

import pytest
import torch

from kdump.bundle import bytecmp
from kdump.bundle.store import pool


def _pair(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    return a, a.clone()


@pytest.mark.parametrize(
    "n", [0, 1, bytecmp.PIECE, bytecmp.SPLIT_MIN - 1, bytecmp.SPLIT_MIN + 12345]
)
def test_equal_ranges_and_a_difference_anywhere(n):
    a, b = _pair(n)
    assert bytecmp.same(a.data_ptr(), b.data_ptr(), n)
    for at in sorted({0, n // 2, bytecmp.PIECE, n - bytecmp.PIECE // 3, n - 1}):
        if not 0 <= at < n:
            continue
        b[at] ^= 0x40
        assert not bytecmp.same(a.data_ptr(), b.data_ptr(), n), f"a difference at {at} of {n}"
        b[at] ^= 0x40
    assert bytecmp.same(a.data_ptr(), b.data_ptr(), n)


def test_on_a_pool_thread_it_does_not_wait_for_the_pool():
    n = bytecmp.SPLIT_MIN * 2
    a, b = _pair(n)
    b[-1] ^= 1
    # every pool thread busy in a comparison that would need the pool itself
    jobs = [pool().submit(bytecmp.same, a.data_ptr(), b.data_ptr(), n) for _ in range(16)]
    assert not any(j.result(timeout=60) for j in jobs)
