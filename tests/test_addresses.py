"""Mapping sanitizer addresses back to arguments and elements (kdump.replay.addresses)."""

from __future__ import annotations

import torch
from tensor_data import random_bits

from kdump.bundle.capture import capture
from kdump.format.records import StorageRecord, TensorRecord
from kdump.replay.addresses import describe_element, locate_address

GEN = torch.Generator().manual_seed(4321)


def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return random_bits(shape, dtype, generator=GEN)


def test_locate_address_inside_and_past_the_end() -> None:
    x = rand((4, 8), torch.float32)
    w = rand((6, 3), torch.bfloat16).t()
    cap = capture([x, w])
    names = ["x", "w"]
    px, pw = x.data_ptr(), w.data_ptr()
    where = locate_address(px + (2 * 8 + 3) * 4, cap.storages, cap.tensors, names)
    assert where == "x[2, 3]"
    assert locate_address(px + (2 * 8 + 3) * 4 + 2, cap.storages, cap.tensors, names) == "x[2, 3]"
    assert locate_address(px, cap.storages, cap.tensors, names) == "x[0, 0]"
    assert locate_address(px + 32 * 4 - 1, cap.storages, cap.tensors, names) == "x[3, 7]"
    # w is transposed: element [i, j] lives at (j * 3 + i) * 2 bytes
    assert locate_address(pw + (4 * 3 + 2) * 2, cap.storages, cap.tensors, names) == "w[2, 4]"
    assert locate_address(1, cap.storages, cap.tensors, []) is None


def test_locate_address_with_recorded_addresses() -> None:
    # Fixed recorded addresses make the answer independent of where the test's tensors live.
    st = StorageRecord("cuda:0", 0x7F0000000000, 4096, 0, 4096, "")
    a = TensorRecord(0, "float32", (16, 16), (16, 1), 0, data_ptr=0x7F0000000000)
    b = TensorRecord(0, "float32", (16, 16), (1, 16), 256 + 16, data_ptr=0x7F0000000440)
    names = ["a", "b"]
    base = 0x7F0000000000
    assert locate_address(base + (3 * 16 + 5) * 4, [st], [a, b], names) == "a[3, 5]"
    assert locate_address(base + 1024 + 9, [st], [a], names[:1]) == "10 bytes past the end of a"
    assert locate_address(base - 4, [st], [a], names[:1]) == "4 bytes before a"
    assert describe_element("b", b, (2 * 16 + 7) * 4) == "b[7, 2]"
