"""bench/_timing.py's helpers that run without a GPU: the new tensor objects a serving step
passes (same memory and layout, other objects; the weights the same)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.fixture
def timing(bench_import: Any) -> Any:
    return bench_import("_timing")


def test_new_step_objects_keep_the_memory_and_the_weights(timing):
    a, sfa = torch.zeros(8, 4), torch.zeros(4, 8).t()
    b, sfb = torch.zeros(2, 4, 4), torch.zeros(2, 1, 1)
    d, labels = torch.zeros(8, 4), torch.zeros(8, dtype=torch.int32)
    args = ((a, sfa), (b, sfb), d, labels)
    new = timing.new_step_objects(args)
    assert new[1] is args[1]  # the weights: the same objects
    olds = [a, sfa, d, labels]
    news = [*new[0], new[2], new[3]]
    for old, t in zip(olds, news):
        assert t is not old
        assert (t.data_ptr(), t.shape, t.stride(), t.dtype, t.storage_offset()) == (
            old.data_ptr(),
            old.shape,
            old.stride(),
            old.dtype,
            old.storage_offset(),
        )
