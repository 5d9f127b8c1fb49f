"""Header templates for small bundles of a repeated call signature, by signature.

A recorder writes one bundle per call, and calls of one target with arguments of one layout give
headers that differ only in a few values: addresses, blob names, the call's meta, its argument
values, the time. The first bundle of a signature is built the ordinary way (records, manifest,
JSON); its header is also built once more with a unique token in place of every such value and
split at the tokens into constant text (`kdump.bundle.manifest.build_template`). Later bundles of
the signature only encode what changed and fill it in. A template is kept only if filling it with
the first bundle's values gives that bundle's header byte for byte, so a template never writes
what the ordinary path would not.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

from kdump.bundle.capture import CallRecord
from kdump.bundle.fileio import Digests
from kdump.bundle.manifest import (
    RepeatForm,
    Template,
    build_template,
    encode_json,
    escaped,
    header_for,
    render,
    repeat_form,
    template_fills,
)
from kdump.bundle.store import fast_checksum
from kdump.format.records import MAX_HEADER, Source, Where, launch_json

_MISSING = object()


class HeaderCache:
    """Templates by call signature (bounded: the oldest goes first).

    The env and info a recorder passes are encoded again only when they are other objects than
    the previous bundle's: a recorder builds a new dict when a fact changes and never edits one
    it passed (kdump.record.sync.recorder). A call signature is looked up first by the identity of
    the call's frozen storage and tensor records (a call whose tensors keep their addresses has the
    same records: `kdump.bundle.tensors` remembers them by layout facts), the entry holding
    those records so that their identities stay theirs."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._templates: dict[tuple[Any, ...], Template | None] = {}
        self._nonce = secrets.token_hex(8)
        self.hits = 0
        self._encoded: dict[str, tuple[object, str]] = {}  # "env" / "info" -> (value, fill)
        self._by_records: dict[tuple[Any, ...], tuple[tuple[Any, ...], list[Any]]] = {}
        # The template and fills of the last header made from one (`repeat_form` starts there).
        self._last: tuple[Template, list[str], int] | None = None

    def header(
        self,
        calls: Sequence[CallRecord],
        digests: Sequence[Digests],
        wheres: Sequence[Where],
        inline: dict[str, tuple[memoryview, int]],
        env: dict[str, Any],
        info: dict[str, Any],
        created: str,
        make_manifest: Callable[[Sequence[Digests]], dict[str, Any]],
    ) -> bytes | None:
        """The padded header of the bundle, or None where the ordinary path must build it."""
        order: dict[str, int] = {}
        pattern = tuple(order.setdefault(sha, len(order)) for sha, _ in digests)
        key = self._key(calls, pattern, wheres, inline)
        if key is None:
            return None
        env_fill, info_fill = self._fill("env", env), self._fill("info", info)
        fills = template_fills(calls, digests, order, env_fill, info_fill, created)
        tpl = self._templates.get(key, _MISSING)
        if tpl is _MISSING:
            real = header_for(make_manifest(digests), inline)[0]
            made = build_template(calls, pattern, order, wheres, inline, self._nonce)
            made = made if made is not None and render(made, fills) == real else None
            if len(self._templates) >= self.max_entries:
                self._templates.pop(next(iter(self._templates)))
            self._templates[key] = made
            self._last = (made, fills, len(order)) if made is not None else None
            return real
        self._last = None
        if tpl is None:
            return None
        out = render(tpl, fills)  # type: ignore[arg-type]
        if len(out) > MAX_HEADER:
            return None  # the ordinary path says why
        self.hits += 1
        self._last = (tpl, fills, len(order))  # type: ignore[assignment]
        return out

    def repeat_form(self) -> tuple[RepeatForm, str] | None:
        """The last header's template (a one-call bundle) with every fill but the creation time,
        the blob digests and the call's meta put in (`kdump.bundle.manifest.repeat_form`), with
        that header's creation time. None where the last header was not made from a template,
        or the form does not give that header byte for byte."""
        if self._last is None:
            return None
        return repeat_form(*self._last)

    def _key(
        self,
        calls: Sequence[CallRecord],
        pattern: tuple[int, ...],
        wheres: Sequence[Where],
        inline: dict[str, tuple[memoryview, int]],
    ) -> tuple[Any, ...] | None:
        """The call signature (`_signature`), found by the records' identities where it can."""
        ids = _bundle_shape(pattern, wheres, inline)
        held: list[Any] = []
        for call in calls:
            ids.append(_call_shape(call))
            for cap in (call.inputs, call.outputs):
                if cap is None:
                    ids.append(None)
                    continue
                ids.append((*map(id, cap.storages), -1, *map(id, cap.tensors)))
                held.append((cap.storages, cap.tensors))
        fast = tuple(ids)
        hit = self._by_records.get(fast)
        if hit is not None:
            return hit[0]
        key = _signature(calls, pattern, wheres, inline)
        if key is not None:
            if len(self._by_records) >= 4 * self.max_entries:
                self._by_records.pop(next(iter(self._by_records)))
            # The lists are the call's own; their records (frozen) keep their identities here.
            self._by_records[fast] = (key, [(tuple(st), tuple(t)) for st, t in held])
        return key

    def _fill(self, slot: str, value: dict[str, Any]) -> str:
        """The fill of `env` or `info`: encoded again only for another object than last time."""
        last = self._encoded.get(slot)
        if last is not None and last[0] is value:
            return last[1]
        text = escaped(encode_json(value))
        self._encoded[slot] = (value, text)
        return text


def _bundle_shape(
    pattern: tuple[int, ...], wheres: Sequence[Where], inline: dict[str, tuple[memoryview, int]]
) -> list[Any]:
    """What a signature holds of the bundle as a whole: the fast check algorithm, which blobs
    are the same, where each is and the sizes of the inline ones."""
    return [fast_checksum(), pattern, tuple(wheres), tuple(len(v) for v, _ in inline.values())]


def _call_shape(call: CallRecord) -> tuple[Any, ...]:
    """What a signature holds of a call beside its records: target, names, in-place pairs and
    a JIT kernel's launch record (its grid and options are not holes of the template)."""
    names = tuple(call.names) if call.names is not None else None
    inplace = tuple(call.inplace) if call.outputs is not None else None
    launch = None if call.launch is None else encode_json(launch_json(call.launch))
    return (call.target, call.called_as, names, inplace, launch)


def _signature(
    calls: Sequence[CallRecord],
    pattern: tuple[int, ...],
    wheres: Sequence[Where],
    inline: dict[str, tuple[memoryview, int]],
) -> tuple[Any, ...] | None:
    """Everything of the bundle's header that is not a hole; None for a bundle with storages of
    other sources (the ordinary path writes those)."""
    parts = _bundle_shape(pattern, wheres, inline)
    for call in calls:
        caps = []
        for cap in (call.inputs, call.outputs):
            if cap is None:
                caps.append(None)
                continue
            st_key = []
            for st in cap.storages:
                if st.source is not Source.BLOB or st.stats is not None or st.ranges:
                    return None
                if st.generator is not None:
                    return None
                st_key.append((st.device, st.storage_nbytes, st.span_start, st.span_nbytes))
            caps.append(
                (
                    tuple(st_key),
                    tuple(
                        (t.storage, t.dtype, t.shape, t.stride, t.storage_offset, t.requires_grad)
                        for t in cap.tensors
                    ),
                )
            )
        parts.append((_call_shape(call), caps[0], caps[1]))
    return tuple(parts)
