"""A bundle's contents as plain data (for `kdump info` and bug reports)."""

from __future__ import annotations

from typing import Any

from kdump.bundle import Bundle, Call
from kdump.bundle.format import ALIGN_MOD, Where


def aliasing_groups(call: Call) -> list[list[str]]:
    """Argument paths that share one storage (only groups of two or more)."""
    names = call.tensor_names
    groups: dict[int, list[str]] = {}
    for i, rec in enumerate(call.tensors):
        groups.setdefault(rec.storage, []).append(names[i])
    return [g for g in groups.values() if len(g) > 1]


def recorded_outputs(call: Call) -> list[str]:
    """What the bundle holds from after the call: argument paths snapshotted after it, and
    "return value" when the call returned something; empty for a bundle of inputs only."""
    if not call.has_outputs:
        return []
    names = call.tensor_names
    out = [names[i] for i, _ in call.inplace]
    returned = call.entry.outputs.returned if call.entry.outputs is not None else None
    if returned is not None:
        out.append("return value")
    return out


def describe_call(call: Call) -> dict[str, Any]:
    names = call.tensor_names
    tensors = []
    for i, rec in enumerate(call.tensors):
        st = call.storages[rec.storage]
        lo, hi = rec.byte_extent()
        tensors.append(
            {
                "name": names[i],
                "dtype": rec.dtype,
                "shape": list(rec.shape),
                "stride": list(rec.stride),
                "storage_offset": rec.storage_offset,
                "device": st.device,
                "data_ptr": hex(rec.data_ptr),
                "alignment": rec.data_ptr % ALIGN_MOD,
                "bytes": hi - lo,
                "storage": rec.storage,
                "storage_span": [st.span_start, st.span_start + st.span_nbytes],
                "storage_nbytes": st.storage_nbytes,
            }
        )
    return {
        "index": call.index,
        "target": call.target,
        "called_as": call.called_as,
        "tensors": tensors,
        "aliasing": aliasing_groups(call),
        "outputs_recorded": call.has_outputs,
        "outputs": recorded_outputs(call),
        "stored_bytes": call.nbytes,
        "meta": call.meta,
    }


def describe_bundle(bundle: Bundle) -> dict[str, Any]:
    return {
        "path": str(bundle.path),
        "format_version": bundle.version,
        "file_bytes": bundle.file_size,
        "blob_bytes": bundle.nbytes,
        "blobs": len(bundle.blobs),
        "blobs_in_store": sum(1 for b in bundle.blobs.values() if b.where is Where.STORE),
        "logical_bytes": sum(c.nbytes for c in bundle.calls),
        "calls": [describe_call(c) for c in bundle.calls],
        "env": bundle.env,
        "info": bundle.info,
    }
