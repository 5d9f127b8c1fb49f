"""One validation pass over a parsed manifest (torch-free).

The parser (`kdump.bundle.parse`) has already checked every type; this checks how the records fit
together and with the container: blob sizes, views inside their spans, tensor references.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kdump.bundle import argtree
from kdump.bundle.format import (
    DTYPE_SIZES,
    MAX_DIM,
    MAX_NDIM,
    BlobRecord,
    CallEntry,
    Manifest,
    Source,
    StorageRecord,
    TensorRecord,
    Where,
    view_byte_extent,
)
from kdump.errors import BundleError
from kdump.errors import BundleErrorKind as K


def validate_manifest(m: Manifest, inline: dict[str, tuple[int, int]], path: Path) -> None:
    """Raise BundleError (with its kind) at the first inconsistency."""
    for sha, blob in m.blobs.items():
        if blob.where is Where.INLINE and blob.nbytes > 0:
            span = inline.get(sha)
            if span is None or span[1] - span[0] != blob.nbytes:
                raise BundleError(
                    f"{path}: blob {sha[:12]}… is listed inline but not stored", K.MISSING_BLOB
                )
    for c in m.calls:
        try:
            _validate_call(c, m.blobs)
        except BundleError as exc:
            raise BundleError(f"{path}: call {c.index}{exc}", exc.kind) from None


def _validate_call(c: CallEntry, blobs: dict[str, BlobRecord]) -> None:
    _validate_part(c.storages, c.tensors, blobs, "")
    for tree in [*c.args, *c.kwargs.values()]:
        _check_tree(tree, len(c.tensors), "")
    if c.outputs is None:
        return
    out = c.outputs
    _validate_part(out.storages, out.tensors, blobs, " outputs")
    if not all(0 <= i < len(c.tensors) and 0 <= k < len(out.tensors) for i, k in out.inplace):
        raise BundleError(": outputs.inplace is malformed", K.SCHEMA)
    _check_tree(out.returned, len(out.tensors), " outputs")


def _check_tree(tree: object, n_tensors: int, where: str) -> None:
    try:
        argtree.check(tree, n_tensors)
    except BundleError as exc:
        raise BundleError(f"{where}: {exc}", exc.kind) from None


def _validate_part(
    storages: Sequence[StorageRecord],
    tensors: Sequence[TensorRecord],
    blobs: dict[str, BlobRecord],
    where: str,
) -> None:
    for j, st in enumerate(storages):
        if st.source is not Source.BLOB:
            continue  # no bytes: a replay re-creates it from its stats
        blob = blobs.get(st.blob)
        if blob is None or blob.nbytes != st.span_nbytes:
            raise BundleError(
                f"{where}: storage {j} needs {st.span_nbytes} bytes from blob {st.blob[:12]}…, "
                "which the bundle does not hold",
                K.MISSING_BLOB,
            )
    try:
        validate_records(storages, tensors)
    except BundleError as exc:
        raise BundleError(f"{where}: {exc}", exc.kind) from None


def validate_records(storages: Sequence[StorageRecord], tensors: Sequence[TensorRecord]) -> None:
    """Reject views that reach outside their stored span, absurd shapes and unknown dtypes."""
    for i, rec in enumerate(tensors):
        if not 0 <= rec.storage < len(storages):
            raise BundleError(
                f"tensor {i} refers to storage {rec.storage}, which does not exist", K.SCHEMA
            )
        itemsize = DTYPE_SIZES.get(rec.dtype)
        if itemsize is None:
            raise BundleError(
                f"unknown dtype {rec.dtype!r} in bundle (this kdump knows {sorted(DTYPE_SIZES)})",
                K.SCHEMA,
            )
        if len(rec.shape) != len(rec.stride) or len(rec.shape) > MAX_NDIM:
            raise BundleError(
                f"tensor {i}: shape {rec.shape} and stride {rec.stride} do not match", K.SCHEMA
            )
        if any(not 0 <= n <= MAX_DIM for n in rec.shape) or any(
            not 0 <= s <= MAX_DIM for s in rec.stride
        ):
            raise BundleError(
                f"tensor {i}: negative or absurd shape {rec.shape} / {rec.stride}", K.LIMIT
            )
        if not 0 <= rec.storage_offset <= MAX_DIM:
            raise BundleError(f"tensor {i}: invalid storage offset {rec.storage_offset}", K.SCHEMA)
        lo, hi = view_byte_extent(rec.shape, rec.stride, rec.storage_offset, itemsize)
        st = storages[rec.storage]
        if hi > lo and (lo < st.span_start or hi > st.span_start + st.span_nbytes):
            raise BundleError(
                f"tensor {i} reaches bytes [{lo}, {hi}) of its storage, outside the stored span "
                f"[{st.span_start}, {st.span_start + st.span_nbytes})",
                K.SCHEMA,
            )
