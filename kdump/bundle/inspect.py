"""A bundle's contents as plain data (for `kdump info` and bug reports).

Everything taken from the bundle is bounded here, so showing it is linear in what is shown: every
string goes through `kdump.text.visible` (escaped, cut with a marker), free-form structures (env,
info, meta) are shown to SHOW_DEPTH levels and SHOW_WIDTH items per level, and a call shows at most
SHOW_TENSORS tensors.
"""

from __future__ import annotations

from typing import Any

from kdump.bundle import Bundle, Call
from kdump.format.records import ALIGN_MOD, Where
from kdump.text import visible

SHOW_DEPTH = 6
SHOW_WIDTH = 100
SHOW_TENSORS = 1000
SHOW_CALLS = 1000


def shown(value: Any, depth: int = SHOW_DEPTH) -> Any:
    """A free-form JSON value cut to a bounded size, every string made visible."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return visible(value)
    if depth <= 0:
        return "…[nested deeper]"
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for i, (k, v) in enumerate(value.items()):
            if i == SHOW_WIDTH:
                out["…"] = f"[{len(value) - SHOW_WIDTH} more entries]"
                break
            out[visible(k, 200)] = shown(v, depth - 1)
        return out
    if isinstance(value, (list, tuple)):
        items = [shown(v, depth - 1) for v in value[:SHOW_WIDTH]]
        if len(value) > SHOW_WIDTH:
            items.append(f"…[{len(value) - SHOW_WIDTH} more items]")
        return items
    return visible(value)


def aliasing_groups(call: Call) -> list[list[str]]:
    """Argument paths that share one storage (only groups of two or more)."""
    names = call.tensor_names
    groups: dict[int, list[str]] = {}
    for i, rec in enumerate(call.tensors):
        groups.setdefault(rec.storage, []).append(visible(names[i], 200))
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


def outputs_not_kept(call: Call) -> dict[str, Any] | None:
    """The outputs the flight recorder could not keep (`meta["outputs_not_kept"]`): their
    argument paths, bytes and the --slot-bytes that would hold them; None when it kept all it
    was asked for (or the bundle says nothing of it). Values of the wrong type are dropped."""
    said = call.meta.get("outputs_not_kept")
    if not isinstance(said, dict):
        return None
    tensors = said.get("tensors")
    tensors = tensors if isinstance(tensors, list) else []
    out: dict[str, Any] = {"tensors": [visible(t, 200) for t in tensors[:SHOW_WIDTH]]}
    if len(tensors) > SHOW_WIDTH:
        out["tensors"].append(f"…[{len(tensors) - SHOW_WIDTH} more]")
    for key in ("bytes", "slot_bytes"):
        v = said.get(key)
        out[key] = v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    return out


def outputs_line(desc: dict[str, Any]) -> str:
    """One line for a described call (`describe_call`): the outputs it holds, and those the
    recorder did not keep with the --slot-bytes that would hold them. Plain text, every part
    from the bundle already made visible."""
    held = desc.get("outputs") or []
    line = "outputs recorded: " + (", ".join(held) if held else "none (inputs only)")
    lost = desc.get("outputs_not_kept")
    if lost:
        line += "; not kept (did not fit the flight recorder's slot): " + ", ".join(lost["tensors"])
        if lost.get("bytes") is not None:
            line += f" ({lost['bytes']} bytes)"
        if lost.get("slot_bytes") is not None:
            line += f"; --slot-bytes {lost['slot_bytes']} would hold them"
    return line


def describe_call(call: Call) -> dict[str, Any]:
    names = call.tensor_names
    tensors = []
    for i, rec in enumerate(call.tensors[:SHOW_TENSORS]):
        st = call.storages[rec.storage]
        lo, hi = rec.byte_extent()
        tensors.append(
            {
                "name": visible(names[i], 200),
                "dtype": rec.dtype,
                "shape": list(rec.shape),
                "stride": list(rec.stride),
                "storage_offset": rec.storage_offset,
                "device": visible(st.device, 100),
                "data_ptr": hex(rec.data_ptr),
                "alignment": rec.data_ptr % ALIGN_MOD,
                "bytes": hi - lo,
                "storage": rec.storage,
                "storage_span": [st.span_start, st.span_start + st.span_nbytes],
                "storage_nbytes": st.storage_nbytes,
                # blob / pieces / sparse / synthetic / by-reference / missing, and the bytes held
                "source": st.source.value,
                "held_bytes": st.held_nbytes,
                "pieces": len(st.pieces),  # blobs a pieced storage is split into (else 0)
            }
        )
    aliasing = aliasing_groups(call)
    return {
        "index": call.index,
        "target": visible(call.target),
        "called_as": visible(call.called_as),
        "tensors": tensors,
        "tensors_not_shown": max(0, len(call.tensors) - SHOW_TENSORS),
        "aliasing": [g[:SHOW_WIDTH] for g in aliasing[:SHOW_WIDTH]],
        "outputs_recorded": call.has_outputs,
        "outputs": recorded_outputs(call),
        "outputs_not_kept": outputs_not_kept(call),
        "stored_bytes": call.nbytes,
        "meta": shown(call.meta),
    }


def describe_bundle(bundle: Bundle) -> dict[str, Any]:
    return {
        "path": visible(bundle.path, None),
        "format_version": bundle.version,
        "file_bytes": bundle.file_size,
        "blob_bytes": bundle.nbytes,
        "blobs": len(bundle.blobs),
        "blobs_in_store": sum(1 for b in bundle.blobs.values() if b.where is Where.STORE),
        "logical_bytes": sum(c.nbytes for c in bundle.calls),
        "calls": [describe_call(c) for c in bundle.calls[:SHOW_CALLS]],
        "calls_not_shown": max(0, len(bundle.calls) - SHOW_CALLS),
        "env": shown(bundle.env),
        "info": shown(bundle.info),
    }
