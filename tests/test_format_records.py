"""The storage and tensor records' one JSON schema (kdump.format.records): what the manifest,
the journal slot and the strict parser share."""

from __future__ import annotations

from pathlib import Path

from kdump.format.parse import _Parser
from kdump.format.records import (
    STORAGE_LAYOUT_FIELDS,
    TENSOR_FIELDS,
    GeneratorRecord,
    Limits,
    Source,
    Stats,
    StorageRecord,
    TensorRecord,
    storage_from_json,
    storage_json,
    storage_layout_json,
    tensor_from_json,
    tensor_json,
)

SHA = "ab" * 32
STORAGES = [
    StorageRecord("cuda:0", 4096, 1024, 128, 512, blob=SHA),
    StorageRecord(
        "cpu", 0, 64, 0, 64, source=Source.MISSING, stats=Stats("float32", -1.0, 2.0, 0.5, 0.1)
    ),
    StorageRecord("cuda:1", 8192, 256, 0, 256, blob=SHA, source=Source.SPARSE, ranges=((0, 16),)),
    StorageRecord(
        "cuda:0",
        0,
        32,
        0,
        32,
        source=Source.SYNTHETIC,
        stats=Stats("float32", 0.0, 1.0, 0.5, 0.2, checksum="x"),
        generator=GeneratorRecord("normal", 1, 7),
    ),
    StorageRecord("cpu", 0, 48, 0, 48, source=Source.PIECES, pieces=((SHA, 16), (SHA, 32))),
]
TENSOR = TensorRecord(0, "bfloat16", (4, 8), (8, 1), 3, requires_grad=True, data_ptr=4102)


def test_storage_round_trip() -> None:
    for st in STORAGES:
        d = storage_json(st)
        assert tuple(d)[: len(STORAGE_LAYOUT_FIELDS)] == STORAGE_LAYOUT_FIELDS
        assert storage_from_json(d) == st


def test_storage_layout_is_the_first_fields() -> None:
    st = STORAGES[0]
    layout = storage_layout_json(st)
    assert tuple(layout) == STORAGE_LAYOUT_FIELDS
    assert storage_from_json(layout) == StorageRecord("cuda:0", 4096, 1024, 128, 512)


def test_tensor_round_trip_with_and_without_nbytes() -> None:
    plain = tensor_json(TENSOR)
    assert tuple(plain) == TENSOR_FIELDS
    journal = tensor_json(TENSOR, nbytes=True)
    assert journal == {**plain, "nbytes": 4 * 8 * 2}
    assert tensor_from_json(plain) == TENSOR == tensor_from_json(journal)


def test_strict_parser_reads_what_the_records_write() -> None:
    p = _Parser(Path("x"), Limits())
    parsed = p.storages([storage_json(st) for st in STORAGES[:3]], "call 0", 5)
    assert parsed == tuple(STORAGES[:3])
    assert p.tensors([tensor_json(TENSOR)], "call 0") == (TENSOR,)
