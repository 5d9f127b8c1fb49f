"""One validation pass over a parsed manifest (torch-free).

The parser (`kdump.format.parse`) has already checked every type and count; this checks how the
records fit together and with the container: blob sizes, views inside their spans, tensor
references, argument trees within their limits, and the bytes a load will allocate (before anything
is allocated: `load_bytes`, `check_load`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kdump.errors import BundleError
from kdump.errors import BundleErrorKind as K
from kdump.format import argtree
from kdump.format.records import (
    ALIGN_MOD,
    DTYPE_SIZES,
    MAX_DIM,
    MAX_NDIM,
    PREFIX_LIMIT,
    BlobRecord,
    CallEntry,
    Limits,
    Manifest,
    Source,
    StorageRecord,
    TensorRecord,
    Where,
    view_byte_extent,
)


def default_limits() -> Limits:
    """The reader's limits: the defaults, with the load cap from KDUMP_MAX_LOAD_BYTES if set."""
    from kdump import config

    raw = config.get("KDUMP_MAX_LOAD_BYTES")
    if raw is None:
        return Limits()
    from kdump.config import parse_bytes

    return replace(Limits(), max_load_bytes=parse_bytes(raw))


def load_bytes(storages: Sequence[StorageRecord], halo: int = 0, keep_prefix: bool = True) -> int:
    """Upper bound of the bytes materialising `storages` allocates (a pure function of the
    records): every storage gets its own buffer, so N storages naming one blob count N times;
    each holds its span, the re-created prefix before it (at most PREFIX_LIMIT per call
    together), alignment slack and the halo on both sides."""
    total = 0
    prefix_budget = PREFIX_LIMIT
    for st in storages:
        prefix = st.span_start if keep_prefix and st.span_start <= prefix_budget else 0
        prefix_budget -= prefix
        total += prefix + st.span_nbytes + ALIGN_MOD + 2 * halo
    return total


def check_load(
    storages: Sequence[StorageRecord],
    limits: Limits,
    what: str,
    halo: int = 0,
    keep_prefix: bool = True,
) -> None:
    """Raise BundleError (LIMIT) when materialising `storages` would allocate over the cap."""
    need = load_bytes(storages, halo, keep_prefix)
    if need > limits.max_load_bytes:
        raise BundleError(
            f"{what} would allocate {need} bytes, over the load limit of "
            f"{limits.max_load_bytes}; raise it with --max-load-bytes or KDUMP_MAX_LOAD_BYTES if "
            "the bundle is trusted",
            K.LIMIT,
        )


def validate_manifest(
    m: Manifest, inline: dict[str, tuple[int, int]], path: Path, limits: Limits | None = None
) -> None:
    """Raise BundleError (with its kind) at the first inconsistency or limit exceeded."""
    limits = limits or Limits()
    declared = sum(b.nbytes for b in m.blobs.values())  # each blob once, however often used
    if declared > limits.max_load_bytes:
        raise BundleError(
            f"{path}: its blobs add up to {declared} bytes, over the load limit of "
            f"{limits.max_load_bytes}; raise it with --max-load-bytes or KDUMP_MAX_LOAD_BYTES if "
            "the bundle is trusted",
            K.LIMIT,
        )
    for sha, blob in m.blobs.items():
        if blob.where is Where.INLINE and blob.nbytes > 0:
            span = inline.get(sha)
            if span is None or span[1] - span[0] != blob.nbytes:
                raise BundleError(
                    f"{path}: blob {sha[:12]}… is listed inline but not stored", K.MISSING_BLOB
                )
    for c in m.calls:
        try:
            _validate_call(c, m.blobs, limits)
        except BundleError as exc:
            raise BundleError(f"{path}: call {c.index}{exc}", exc.kind) from None


def _validate_call(c: CallEntry, blobs: dict[str, BlobRecord], limits: Limits) -> None:
    _validate_part(c.storages, c.tensors, blobs, "", limits)
    budget = argtree.new_budget(limits)  # the call's arguments share one node budget
    for tree in [*c.args, *c.kwargs.values()]:
        _check_tree(tree, len(c.tensors), "", budget)
    out_storages: tuple[StorageRecord, ...] = ()
    if c.outputs is not None:
        out = c.outputs
        out_storages = out.storages
        _validate_part(out.storages, out.tensors, blobs, " outputs", limits)
        if not all(0 <= i < len(c.tensors) and 0 <= k < len(out.tensors) for i, k in out.inplace):
            raise BundleError(": outputs.inplace is malformed", K.SCHEMA)
        _check_tree(out.returned, len(out.tensors), " outputs", argtree.new_budget(limits))
    # A replay materialises the inputs and the recorded outputs of a call together.
    need = load_bytes(c.storages) + load_bytes(out_storages)
    if need > limits.max_load_bytes:
        raise BundleError(
            f": its storages would allocate {need} bytes when loaded, over the load limit of "
            f"{limits.max_load_bytes}; raise it with --max-load-bytes or KDUMP_MAX_LOAD_BYTES if "
            "the bundle is trusted",
            K.LIMIT,
        )


def _check_tree(tree: object, n_tensors: int, where: str, budget: object) -> None:
    try:
        argtree.check(tree, n_tensors, budget)  # type: ignore[arg-type]
    except BundleError as exc:
        raise BundleError(f"{where}: {exc}", exc.kind) from None


def _validate_part(
    storages: Sequence[StorageRecord],
    tensors: Sequence[TensorRecord],
    blobs: dict[str, BlobRecord],
    where: str,
    limits: Limits,
) -> None:
    for j, st in enumerate(storages):
        if st.source is Source.PIECES:
            for k, (sha, n) in enumerate(st.pieces):
                blob = blobs.get(sha)
                if blob is None or blob.nbytes != n:
                    raise BundleError(
                        f"{where}: storage {j} piece {k} needs {n} bytes from blob {sha[:12]}…, "
                        "which the bundle does not hold",
                        K.MISSING_BLOB,
                    )
            continue
        if st.source not in (Source.BLOB, Source.SPARSE):
            continue  # no bytes: a replay re-creates it (stats, generator)
        blob = blobs.get(st.blob)
        if blob is None or blob.nbytes != st.held_nbytes:
            raise BundleError(
                f"{where}: storage {j} needs {st.held_nbytes} bytes from blob {st.blob[:12]}…, "
                "which the bundle does not hold",
                K.MISSING_BLOB,
            )
    try:
        validate_records(storages, tensors, limits)
    except BundleError as exc:
        raise BundleError(f"{where}: {exc}", exc.kind) from None


def validate_records(
    storages: Sequence[StorageRecord],
    tensors: Sequence[TensorRecord],
    limits: Limits | None = None,
) -> None:
    """Reject views that reach outside their stored span, absurd shapes, unknown dtypes, and
    views whose dense size (elements × itemsize; what a copy of the view allocates) is over the
    load limit. A view may cover more elements than its span holds (a broadcast view has
    stride 0), but never more than the limit."""
    limits = limits or Limits()
    for i, rec in enumerate(tensors):
        if not 0 <= rec.storage < len(storages):
            raise BundleError(
                f"tensor {i} refers to storage {rec.storage}, which does not exist", K.SCHEMA
            )
        itemsize = DTYPE_SIZES.get(rec.dtype)
        if itemsize is None:
            raise BundleError(
                f"unknown dtype {rec.dtype[:40]!r} in bundle "
                f"(this kdump knows {sorted(DTYPE_SIZES)})",
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
        dense = itemsize
        for n in rec.shape:  # stops growing once over the limit: 16 dims of 2^48 stay cheap
            dense = min(dense * n, limits.max_load_bytes + 1)
        if dense > limits.max_load_bytes:
            raise BundleError(
                f"tensor {i}: shape {rec.shape} of {rec.dtype} is over the load limit of "
                f"{limits.max_load_bytes} bytes",
                K.LIMIT,
            )
        lo, hi = view_byte_extent(rec.shape, rec.stride, rec.storage_offset, itemsize)
        st = storages[rec.storage]
        if hi > lo and (lo < st.span_start or hi > st.span_start + st.span_nbytes):
            raise BundleError(
                f"tensor {i} reaches bytes [{lo}, {hi}) of its storage, outside the stored span "
                f"[{st.span_start}, {st.span_start + st.span_nbytes})",
                K.SCHEMA,
            )
