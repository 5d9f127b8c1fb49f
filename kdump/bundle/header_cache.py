"""Header templates for small bundles of a repeated call signature.

A recorder writes one bundle per call, and calls of one target with arguments of one layout give
headers that differ only in a few values: addresses, blob names, the call's meta, its argument
values, the time. The first bundle of a signature is built the ordinary way (records, manifest,
JSON); its header is also built once more with a unique token in place of every such value and
split at the tokens into constant text. Later bundles of the signature only encode what changed
and fill it in. A template is kept only if filling it with the first bundle's values gives that
bundle's header byte for byte, so a template never writes what the ordinary path would not.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kdump.bundle.argtree import LIMITS as _LIMITS
from kdump.bundle.store import fast_checksum
from kdump.bundle.tensors import Captured
from kdump.format.records import MAX_HEADER, Source, Where

if TYPE_CHECKING:
    from kdump.bundle.writer import CallRecord

Digests = tuple[str, str]


def _encoder() -> Callable[[Any], str]:
    """What json.dumps(value, separators=(",", ":")) gives (the manifest's encoding), with the
    encoder made once: json.dumps makes one per call when given options, which costs more than
    encoding a call's meta. The values are the writer's own trees (acyclic), so the encoder keeps
    no table of open containers (one it shared between threads would see false cycles)."""
    base = json.JSONEncoder(separators=(",", ":"), check_circular=False)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator: the pure-Python encoder, made once all the same
        return base.encode
    one = make(
        None, base.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )

    def encode(value: Any) -> str:
        return "".join(one(value, 0))

    return encode


_encode = _encoder()
_MISSING = object()


@dataclass(frozen=True)
class _Template:
    """The header as a format string: field k < holes is hole k's fill (inside the manifest
    string); the fields after those are the holes of `outside`, in order (blob names in the
    safetensors entries: the fill without its escaped quotes)."""

    form: str
    outside: tuple[int, ...]


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
        self._templates: dict[tuple[Any, ...], _Template | None] = {}
        self._nonce = secrets.token_hex(8)
        self.hits = 0
        self._encoded: dict[str, tuple[object, str]] = {}  # "env" / "info" -> (value, fill)
        self._by_records: dict[tuple[Any, ...], tuple[tuple[Any, ...], list[Any]]] = {}
        # The template and fills of the last header made from one (`repeat_form` starts there).
        self._last: tuple[_Template, list[str], int] | None = None

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
        fills = self._values(calls, digests, order, env, info, created)
        tpl = self._templates.get(key, _MISSING)
        if tpl is _MISSING:
            from kdump.bundle.writer import _header_for

            real = _header_for(make_manifest(digests), inline)[0]
            made = self._build(calls, pattern, order, wheres, inline)
            made = made if made is not None and _render(made, fills) == real else None
            if len(self._templates) >= self.max_entries:
                self._templates.pop(next(iter(self._templates)))
            self._templates[key] = made
            self._last = (made, fills, len(order)) if made is not None else None
            return real
        self._last = None
        if tpl is None:
            return None
        out = _render(tpl, fills)  # type: ignore[arg-type]
        if len(out) > MAX_HEADER:
            return None  # the ordinary path says why
        self.hits += 1
        self._last = (tpl, fills, len(order))  # type: ignore[assignment]
        return out

    def repeat_form(self) -> tuple[RepeatForm, str] | None:
        """The last header's template (a one-call bundle) with every fill but the creation time,
        the blob digests and the call's meta put in: what an exact repeat of that call (same
        arguments, tensors, layouts, env and info) changes; with that header's creation time.
        None where the last header was not
        made from a template, or the form does not give that header byte for byte."""
        if self._last is None:
            return None
        tpl, fills, blobs = self._last
        meta = 3 + 2 * blobs + 2  # created, env, info, (sha, fast) per blob, then args, kwargs
        if len(fills) < meta + 2:
            return None
        new: dict[int, int] = {0: 0, meta: 1 + 2 * blobs}
        for u in range(blobs):
            new[3 + 2 * u] = 1 + 2 * u
            new[4 + 2 * u] = 2 + 2 * u
        # Kept holes become marks (control characters: no fill has one), the text is escaped
        # for str.format, then the marks become its fields.
        outside: list[str] = []
        for hole in tpl.outside:  # blob names in the safetensors entries: a sha without quotes
            u, odd = divmod(hole - 3, 2)
            if odd or not 0 <= u < blobs:
                return None
            outside.append(f"\x00{2 + 2 * blobs + u}\x01")
        inner = [f"\x00{new[k]}\x01" if k in new else f for k, f in enumerate(fills)]
        try:
            text = tpl.form.format(*inner, *outside).replace("{", "{{").replace("}", "}}")
            form = RepeatForm(re.sub("\x00(\\d+)\x01", r"{\1}", text), blobs)
            digests = [(fills[3 + 2 * u][2:-2], fills[4 + 2 * u][2:-2]) for u in range(blobs)]
            same = form.render(fills[0][2:-2], digests, fills[meta]) == _render(tpl, fills)
        except (IndexError, KeyError, ValueError):
            return None
        return (form, fills[0][2:-2]) if same else None

    def _key(
        self,
        calls: Sequence[CallRecord],
        pattern: tuple[int, ...],
        wheres: Sequence[Where],
        inline: dict[str, tuple[memoryview, int]],
    ) -> tuple[Any, ...] | None:
        """The call signature (`_signature`), found by the records' identities where it can."""
        ids: list[Any] = [
            fast_checksum(),
            pattern,
            tuple(wheres),
            tuple(len(v) for v, _ in inline.values()),
        ]
        held: list[Any] = []
        for call in calls:
            ids.append((call.target, call.called_as))
            ids.append(tuple(call.names) if call.names is not None else None)
            ids.append(tuple(call.inplace) if call.outputs is not None else None)
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
        text = _escaped(_encode(value))
        self._encoded[slot] = (value, text)
        return text

    # -- per bundle -------------------------------------------------------------------------------
    def _values(
        self,
        calls: Sequence[CallRecord],
        digests: Sequence[Digests],
        order: dict[str, int],
        env: dict[str, Any],
        info: dict[str, Any],
        created: str,
    ) -> list[str]:
        """Each hole's text as it appears inside the manifest string (escaped), in hole order.
        Outside it (blob names in the safetensors entries) a hole's text is the same without its
        escaped quotes."""
        fasts: dict[str, str] = {}
        for sha, fast in digests:
            fasts.setdefault(sha, fast)
        out = [f'\\"{created}\\"', self._fill("env", env), self._fill("info", info)]
        for sha in order:
            out.append(f'\\"{sha}\\"')
            out.append(f'\\"{fasts[sha]}\\"')
        limit = _LIMITS.max_string
        for call in calls:
            meta = _encode(call.meta)
            if len(meta) > limit:  # a string to cut (an exception's text): as the writer does
                from kdump.bundle.writer import _bounded

                meta = _encode(_bounded(call.meta))
            returned = call.returned if call.outputs is not None else None
            out.append(_escaped(_encode(call.args)))
            out.append(_escaped(_encode(call.kwargs)))
            out.append(_escaped(meta))
            out.append(_escaped(_encode(returned)))
            for cap in (call.inputs, call.outputs):
                if cap is not None:
                    out += [str(st.base_ptr) for st in cap.storages]
                    out += [str(t.data_ptr) for t in cap.tensors]
        return out

    # -- per signature ----------------------------------------------------------------------------
    def _token(self, k: int) -> str:
        return f"KDUMPHOLE{self._nonce}x{k}y"

    def _build(
        self,
        calls: Sequence[CallRecord],
        pattern: tuple[int, ...],
        order: dict[str, int],
        wheres: Sequence[Where],
        inline: dict[str, tuple[memoryview, int]],
    ) -> _Template | None:
        """The header of these calls with a token for every hole, split at the tokens (holes are
        numbered as `_values` lists them)."""
        from kdump.bundle.writer import CallRecord, _header_for, _manifest_maker

        tok = self._token
        k = 3 + 2 * len(order)
        shas = [tok(3 + 2 * u) for u in range(len(order))]
        fasts = [tok(4 + 2 * u) for u in range(len(order))]
        held: list[Captured] = []
        marked = []
        for call in calls:
            holes = [tok(k + j) for j in range(4)]
            k += 4
            caps: list[Captured | None] = []
            for cap in (call.inputs, call.outputs):
                if cap is None:
                    caps.append(None)
                    continue
                storages = [replace(st, base_ptr=tok(k + i)) for i, st in enumerate(cap.storages)]
                k += len(storages)
                tensors = [replace(t, data_ptr=tok(k + i)) for i, t in enumerate(cap.tensors)]
                k += len(tensors)
                caps.append(Captured(storages, tensors, list(cap.data)))
                held.append(cap)
            marked.append(
                CallRecord(
                    target=call.target,
                    called_as=call.called_as,
                    args=holes[0],  # type: ignore[arg-type]
                    kwargs=holes[1],  # type: ignore[arg-type]
                    names=call.names,
                    inputs=caps[0],  # type: ignore[arg-type]
                    outputs=caps[1],
                    inplace=call.inplace,
                    returned=holes[3],
                    meta=holes[2],  # type: ignore[arg-type]
                )
            )
        sizes = [st.span_nbytes for cap in held for st in cap.storages]
        maker = _manifest_maker(
            marked,
            sizes,
            wheres,
            tok(1),  # type: ignore[arg-type]
            tok(2),  # type: ignore[arg-type]
            created=tok(0),
        )
        marked_digests = [(shas[u], fasts[u]) for u in pattern]
        marked_inline = {shas[order[sha]]: v for sha, v in inline.items()}
        try:
            raw = _header_for(maker(marked_digests), marked_inline)[0]
        except Exception:  # too large for a header: the ordinary path says so
            return None
        text = raw.rstrip(b" ").decode("ascii")
        one = rf"KDUMPHOLE{self._nonce}x(\d+)y"
        parts: list[str] = []
        outside: list[int] = []
        pos = 0
        for m in re.finditer(rf'\\"{one}\\"|{one}', text):
            parts.append(text[pos : m.start()].replace("{", "{{").replace("}", "}}"))
            if m.group(1) is not None:
                parts.append(f"{{{m.group(1)}}}")
            else:
                parts.append(f"{{{k + len(outside)}}}")  # after every hole's own field
                outside.append(int(m.group(2)))
            pos = m.end()
        parts.append(text[pos:].replace("{", "{{").replace("}", "}}"))
        return _Template("".join(parts), tuple(outside))


class RepeatForm:
    """A one-call header as a format string whose fields are the creation time, each blob's
    (sha, fast) digests in the header's order, the call's meta (JSON text) and the blob names
    again for the safetensors entries (`HeaderCache.repeat_form`); split once into its literal
    pieces (str.format parses the whole header again on every call)."""

    def __init__(self, form: str, blobs: int) -> None:
        self.form = form
        self.blobs = blobs
        pieces = [""]
        fields: list[int] = []
        for literal, field, spec, conv in string.Formatter().parse(form):
            pieces[-1] += literal  # with "{{" and "}}" made single
            if field is not None:
                if spec or conv or not field.isdigit():
                    raise ValueError(f"not a plain field: {field!r}")
                fields.append(int(field))
                pieces.append("")
        self._pieces = tuple(pieces)
        self._fields = tuple(fields)

    def render(self, created: str, digests: Sequence[Digests], meta: str) -> bytes:
        """The padded header; `meta` is the meta's JSON text as the manifest string holds it
        (escaped: `_escaped`)."""
        out = self.text(created, digests, meta)
        return out + b" " * (-(8 + len(out)) % 8)

    def text(self, created: str, digests: Sequence[Digests], meta: str) -> bytes:
        """The header without its padding."""
        fills = [f'\\"{created}\\"']
        for sha, fast in digests:
            fills += (f'\\"{sha}\\"', f'\\"{fast}\\"')
        fills.append(meta)
        fills += (sha for sha, _ in digests)
        pieces = self._pieces
        parts = [pieces[0]]
        for k, field in enumerate(self._fields):
            parts += (fills[field], pieces[k + 1])
        return "".join(parts).encode("ascii")


def _signature(
    calls: Sequence[CallRecord],
    pattern: tuple[int, ...],
    wheres: Sequence[Where],
    inline: dict[str, tuple[memoryview, int]],
) -> tuple[Any, ...] | None:
    """Everything of the bundle's header that is not a hole; None for a bundle with storages of
    other sources (the ordinary path writes those)."""
    parts: list[Any] = [
        fast_checksum(),
        pattern,
        tuple(wheres),
        tuple(len(v) for v, _ in inline.values()),
    ]
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
        names = tuple(call.names) if call.names is not None else None
        inplace = tuple(call.inplace) if call.outputs is not None else None
        parts.append((call.target, call.called_as, names, caps[0], caps[1], inplace))
    return tuple(parts)


def _render(tpl: _Template, fills: Sequence[str]) -> bytes:
    out = tpl.form.format(*fills, *(fills[k][2:-2] for k in tpl.outside)).encode("ascii")
    return out + b" " * (-(8 + len(out)) % 8)


def _escaped(text: str) -> str:
    """JSON text as it appears inside the manifest string: what json.dumps(text)[1:-1] gives.
    JSON escapes one character at a time, so the pieces of a string escape to the pieces of its
    escape; and text from the encoder is ASCII without control characters (it escapes those),
    so a backslash and a quote are all there is to escape."""
    return text.replace("\\", "\\\\").replace('"', '\\"')
