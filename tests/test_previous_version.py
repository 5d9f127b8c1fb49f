"""A 2 GB bundle of format version 4 (each storage one blob, as the writers before pieces wrote
them) still loads, verifies and materialises with this reader. The bundle is written here by a
format-level writer of version 4 (docs/FORMAT.md §2-§5), streamed in chunks, never kept."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from kdump.bundle import load_bundle
from kdump.format.records import Source

try:
    import xxhash
except ImportError:  # the bundle then names SHA-256 as every blob's check
    xxhash = None

CHUNK = 8 << 20
STORAGES = 4
SPAN = 500 * 1000 * 1000  # 4 × 500 MB = 2 GB
BASE = 0x7F0000000000  # recorded addresses: 1024-aligned, so the reader maps the file


def _chunk(storage: int, k: int, n: int) -> np.ndarray:
    """Bytes [k·CHUNK, k·CHUNK + n) of storage `storage`: distinct per chunk, cheap to make."""
    words = np.arange(n // 8 + 1, dtype=np.uint64)
    words ^= np.uint64((storage << 40) + (k << 20) + 0x9E3779B97F4A7C15)
    words *= np.uint64(0xBF58476D1CE4E5B9)
    return words.view(np.uint8)[:n]


def _write_v4(path: Path) -> list[str]:
    """Write the bundle; the SHA-256 names of its storages' blobs."""
    shas, fasts = [], []
    for s in range(STORAGES):  # the names first: they are in the header, before the data
        h = hashlib.sha256()
        f = xxhash.xxh3_128() if xxhash is not None else None
        for k, lo in enumerate(range(0, SPAN, CHUNK)):
            part = _chunk(s, k, min(CHUNK, SPAN - lo))
            h.update(part)
            if f is not None:
                f.update(part)
        shas.append(h.hexdigest())
        fasts.append(f.hexdigest() if f is not None else "")
    blobs = {}
    for sha, fast in zip(shas, fasts):
        entry = {"nbytes": SPAN, "where": "inline", "checksum": "sha256"}
        if fast:
            entry = {**entry, "checksum": "xxh3-128", "digest": fast}
        blobs[sha] = entry
    storages, tensors, args = [], [], []
    for s, sha in enumerate(shas):
        ptr = BASE + s * (1 << 32)
        storages.append(
            {
                "device": "cpu",
                "base_ptr": ptr,
                "storage_nbytes": SPAN,
                "span_start": 0,
                "span_nbytes": SPAN,
                "blob": sha,
                "source": "blob",
            }
        )
        tensors.append(
            {
                "storage": s,
                "dtype": "int32",
                "shape": [SPAN // 4],
                "stride": [1],
                "storage_offset": 0,
                "requires_grad": False,
                "data_ptr": ptr,
            }
        )
        args.append({"$tensor": s})
    manifest = {
        "format": "kdump",
        "version": 4,
        "writer": "format-level writer of version 4 (test)",
        "created": "2026-12-02T00:00:00Z",
        "env": {},
        "info": {},
        "blobs": blobs,
        "calls": [
            {
                "index": 0,
                "target": "m:f",
                "called_as": "f",
                "names": None,
                "args": args,
                "kwargs": {},
                "storages": storages,
                "tensors": tensors,
                "outputs": None,
                "meta": {},
            }
        ],
    }
    # Blobs back to back from a data section at a multiple of 1024, each padded to its alignment
    # (0 here): §2.1.
    layout, pads, pos = {}, [], 0
    for sha in shas:
        start = pos + (-pos) % 1024
        if start > pos:
            pads.append((pos, start))
        layout[sha] = (start, start + SPAN)
        pos = start + SPAN
    entries = {
        sha: {"dtype": "U8", "shape": [SPAN], "data_offsets": list(o)} for sha, o in layout.items()
    }
    for i, (b, e) in enumerate(pads):
        entries[f"kdump.pad.{i}"] = {"dtype": "U8", "shape": [e - b], "data_offsets": [b, e]}
    entries["__metadata__"] = {"kdump.manifest": json.dumps(manifest)}
    text = json.dumps(entries).encode()
    text += b" " * ((-(8 + len(text))) % 1024)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for s, sha in enumerate(shas):
            f.seek(8 + len(text) + layout[sha][0])
            for k, lo in enumerate(range(0, SPAN, CHUNK)):
                f.write(_chunk(s, k, min(CHUNK, SPAN - lo)).tobytes())
        f.truncate(8 + len(text) + pos)
    return shas


@pytest.mark.slow
def test_2gb_bundle_of_version_4_loads_and_verifies(tmp_path: Path) -> None:
    path = tmp_path / "v4.kdump"
    shas = _write_v4(path)
    assert path.stat().st_size > 2_000_000_000
    b = load_bundle(path)
    assert b.version == 4 and set(b.blobs) == set(shas)
    assert all(st.source is Source.BLOB for st in b.calls[0].storages)
    b.verify()
    mat = b.calls[0].materialize("cpu")
    for s, t in enumerate(mat.tensors):
        assert t.numel() * 4 == SPAN
        for k in (0, SPAN // CHUNK // 2, SPAN // CHUNK):  # first, middle and last chunk
            lo = k * CHUNK
            n = min(CHUNK, SPAN - lo)
            got = t.view(torch.uint8)[lo : lo + n].numpy()
            assert np.array_equal(got, _chunk(s, k, n))
    path.unlink()
