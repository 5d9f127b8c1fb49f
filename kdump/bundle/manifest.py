"""A bundle's manifest and header, defined once: the manifest records of captured calls
(`call_entries`, `manifest_maker`), the safetensors header that carries them (`header_json`,
`header_for`), and the header template that small bundles of a repeated call signature are
filled into (`build_template`, `template_fills`, `render`, `RepeatForm`; the cache of templates
by signature is `kdump.bundle.header_cache`). The writer and the template build headers with the
same code, so a template never writes what the ordinary path would not.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kdump._version import __version__
from kdump.bundle.capture import CallRecord, Captured
from kdump.bundle.fileio import Digests
from kdump.bundle.store import fast_checksum
from kdump.errors import BundleError
from kdump.errors import BundleErrorKind as K
from kdump.format import argtree
from kdump.format.records import (
    ALIGN_MOD,
    ALIGNED_BLOB_MIN,
    FORMAT_VERSION,
    MANIFEST_KEY,
    MAX_HEADER,
    PAD_PREFIX,
    BlobRecord,
    CallEntry,
    Manifest,
    OutputsRecord,
    Source,
    StorageRecord,
    Where,
    blob_offset,
    manifest_json,
)

WRITER = f"kdump {__version__}"  # the manifest's `writer`
# The data section starts at a multiple of this when a blob in it is aligned (else of 8).
DATA_ALIGN = ALIGN_MOD


def call_entries(
    calls: Sequence[CallRecord], shas: Sequence[str | tuple[tuple[str, int], ...]]
) -> tuple[CallEntry, ...]:
    """The manifest records of `calls`, their storages named by `shas` (in capture order): a
    blob's name, or the (name, size) of each piece of a storage written in pieces."""
    it = iter(shas)

    def one(st: StorageRecord) -> StorageRecord:
        name = next(it)
        pieces: tuple[tuple[str, int], ...] = ()
        if isinstance(name, tuple):
            blob, pieces, source = "", name, Source.PIECES
        else:
            blob, source = name, st.source
        # The constructor, not dataclasses.replace: this runs for every storage of every bundle.
        return StorageRecord(
            st.device,
            st.base_ptr,
            st.storage_nbytes,
            st.span_start,
            st.span_nbytes,
            blob,
            source,
            st.stats,
            pieces=pieces,
        )

    def named(cap: Captured) -> tuple[StorageRecord, ...]:
        return tuple(
            one(st)
            if st.source is Source.BLOB
            else replace(st, blob=next(it))
            if st.source is Source.SPARSE
            else st
            for st in cap.storages
        )

    out = []
    for i, call in enumerate(calls):
        storages = named(call.inputs)
        outputs = None
        if call.outputs is not None:
            outputs = OutputsRecord(
                storages=named(call.outputs),
                tensors=tuple(call.outputs.tensors),
                inplace=tuple(call.inplace),
                returned=call.returned,
            )
        out.append(
            CallEntry(
                index=i,
                target=call.target,
                called_as=call.called_as,
                names=tuple(call.names) if call.names is not None else None,
                args=call.args,
                kwargs=call.kwargs,
                storages=storages,
                tensors=tuple(call.inputs.tensors),
                outputs=outputs,
                meta=bounded_meta(call.meta),
                launch=call.launch,
            )
        )
    return tuple(out)


def bounded_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with strings cut to the reader's string limit (an exception text may be huge)."""
    limit = argtree.LIMITS.max_string
    try:  # no string is longer than the whole JSON text: nothing to cut (the common case)
        if len(json.dumps(meta)) <= limit:
            return meta
    except (TypeError, ValueError):
        pass

    def cut(v: Any) -> Any:
        if isinstance(v, str) and len(v) > limit:
            return v[: limit - 40] + f"…[{len(v) - limit + 40} more characters]"
        if isinstance(v, dict):
            return {cut(k): cut(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [cut(x) for x in v]
        return v

    return cut(meta)


def manifest_maker(
    calls: Sequence[CallRecord],
    sizes: Sequence[int],
    wheres: Sequence[Where],
    env: dict[str, Any] | None,
    info: dict[str, Any] | None,
    created: str,
    counts: Sequence[int] | None = None,
) -> Callable[[Sequence[Digests]], dict[str, Any]]:
    """The manifest of `calls` given the digests of their blobs (in capture order; `counts`:
    how many blobs each storage that holds bytes has, where one was written in pieces)."""
    algo = fast_checksum()
    pieced = counts is not None and any(k > 1 for k in counts)

    def names(digests: Sequence[Digests]) -> list[str | tuple[tuple[str, int], ...]]:
        if not pieced:
            return [sha for sha, _ in digests]
        assert counts is not None
        out: list[str | tuple[tuple[str, int], ...]] = []
        pos = 0
        for k in counts:
            if k == 1:
                out.append(digests[pos][0])
            else:
                out.append(tuple((digests[j][0], sizes[j]) for j in range(pos, pos + k)))
            pos += k
        return out

    def make_manifest(digests: Sequence[Digests]) -> dict[str, Any]:
        blobs: dict[str, BlobRecord] = {}
        for (sha, fast), n, where in zip(digests, sizes, wheres):
            blobs.setdefault(sha, BlobRecord(n, where, algo, fast))
        return manifest_json(
            Manifest(
                version=FORMAT_VERSION,
                writer=WRITER,
                created=created,
                env=env or {},
                info=info or {},
                blobs=blobs,
                calls=call_entries(calls, names(digests)),
            )
        )

    return make_manifest


def blob_alignments(calls: Sequence[CallEntry]) -> dict[str, int]:
    """Each blob the calls' storages name, in order of first use, with the alignment it is
    written at: that of the first storage using it, offset by where it begins in that storage's
    span (pieces lie back to back, as written)."""
    aligns: dict[str, int] = {}
    for c in calls:
        for st in (*c.storages, *(c.outputs.storages if c.outputs else ())):
            for sha, begin, _ in st.piece_spans():
                aligns.setdefault(sha, (st.alignment + begin) % ALIGN_MOD)
    return aligns


def header_bound(
    views: Sequence[memoryview], make_manifest: Callable[[Sequence[Digests]], dict[str, Any]]
) -> int:
    """An upper bound of the padded header of a bundle of `views` (every blob unique and fully
    padded: de-duplication only shortens it), so its space is reserved before the blobs are
    hashed."""
    placeholder = [(f"{i:064x}", "0" * 32) for i in range(len(views))]
    upper: dict[str, tuple[int, int]] = {}
    pads = []
    off = 0
    for (name, _), view in zip(placeholder, views):
        pads.append((off, off + ALIGN_MOD - 1))
        off += ALIGN_MOD - 1
        upper[name] = (off, off + len(view))
        off += len(view)
    raw = header_json(make_manifest(placeholder), upper, pads)
    return padded_size(len(raw), map(len, views))


def header_json(
    manifest: dict[str, Any], layout: dict[str, tuple[int, int]], pads: Sequence[tuple[int, int]]
) -> bytes:
    """The safetensors header: one U8 entry per inline blob and padding span, and the manifest
    as a JSON string in `__metadata__`. Entry names are hex digests and `kdump.pad.<i>` (nothing
    to escape), so the entries are formatted directly and only the manifest goes through json."""
    entries = [*layout.items(), *((f"{PAD_PREFIX}{i}", span) for i, span in enumerate(pads))]
    parts = [
        f'"{name}":{{"dtype":"U8","shape":[{e - b}],"data_offsets":[{b},{e}]}}'
        for name, (b, e) in entries
    ]
    text = json.dumps(json.dumps(manifest, separators=(",", ":")))
    parts.append(f'"__metadata__":{{{json.dumps(MANIFEST_KEY)}:{text}}}')
    return ("{" + ",".join(parts) + "}").encode()


def padded_size(raw_len: int, sizes: Iterable[int]) -> int:
    """Header length with its space padding: the data section starts at a multiple of DATA_ALIGN
    when a blob is to be aligned (else of 8, so small bundles stay small)."""
    unit = DATA_ALIGN if any(n >= ALIGNED_BLOB_MIN for n in sizes) else 8
    return raw_len + (-(8 + raw_len)) % unit


def blob_layout(
    blobs: dict[str, tuple[memoryview, int]],
) -> tuple[dict[str, tuple[int, int]], list[tuple[int, int]], int]:
    """(data offsets of the blobs, padding spans, data section length) of inline blobs
    (sha -> (bytes, recorded alignment)), laid out in order (`blob_offset`)."""
    layout: dict[str, tuple[int, int]] = {}
    pads: list[tuple[int, int]] = []
    offset = 0
    for sha, (view, align) in blobs.items():
        start = blob_offset(offset, len(view), align)
        if start > offset:
            pads.append((offset, start))
        layout[sha] = (start, start + len(view))
        offset = start + len(view)
    return layout, pads, offset


def header_for(
    manifest: dict[str, Any], blobs: dict[str, tuple[memoryview, int]]
) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """(padded header, data offsets of the blobs, data section length) of a bundle."""
    layout, pads, offset = blob_layout(blobs)
    raw = header_json(manifest, layout, pads)
    raw += b" " * (padded_size(len(raw), (len(v) for v, _ in blobs.values())) - len(raw))
    if len(raw) > MAX_HEADER:
        raise BundleError(
            f"bundle manifest is {len(raw)} bytes, over the {MAX_HEADER}-byte header limit: "
            "write fewer calls per bundle",
            K.LIMIT,
        )
    return raw, layout, offset


# ---------------------------------------------------------------------------------------------
# The header template: a bundle's header with a hole in place of every value that changes between
# calls of one signature. Its holes are numbered once, here: 0 the creation time, 1 the env,
# 2 the info, then the SHA-256 name and the fast check of each distinct blob (`sha_hole`,
# `fast_hole`), then per call (from `calls_hole`) its args, kwargs, meta and return value, then
# per captured part (inputs, outputs) each storage's base address and each tensor's address.
# `template_fills` lists the values in that order and `build_template` puts a token there.

CREATED_HOLE, ENV_HOLE, INFO_HOLE = 0, 1, 2
CALL_HOLES = 4  # args, kwargs, meta, returned


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


encode_json = _encoder()


def escaped(text: str) -> str:
    """JSON text as it appears inside the manifest string: what json.dumps(text)[1:-1] gives.
    JSON escapes one character at a time, so the pieces of a string escape to the pieces of its
    escape; and text from the encoder is ASCII without control characters (it escapes those),
    so a backslash and a quote are all there is to escape."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


@dataclass(frozen=True)
class Template:
    """The header as a format string: field k < holes is hole k's fill (inside the manifest
    string); the fields after those are the holes of `outside`, in order (blob names in the
    safetensors entries: the fill without its escaped quotes)."""

    form: str
    outside: tuple[int, ...]


def render(tpl: Template, fills: Sequence[str]) -> bytes:
    """The padded header a template gives with `fills` (`template_fills`) in its holes."""
    out = tpl.form.format(*fills, *(fills[k][2:-2] for k in tpl.outside)).encode("ascii")
    return out + b" " * (-(8 + len(out)) % 8)


def sha_hole(u: int) -> int:
    """The hole of the SHA-256 name of the header's u-th distinct blob."""
    return 3 + 2 * u


def fast_hole(u: int) -> int:
    """The hole of the fast check digest of the header's u-th distinct blob."""
    return 4 + 2 * u


def calls_hole(blobs: int) -> int:
    """The first hole of the calls of a header with `blobs` distinct blobs."""
    return 3 + 2 * blobs


def template_fills(
    calls: Sequence[CallRecord],
    digests: Sequence[Digests],
    order: dict[str, int],
    env: str,
    info: str,
    created: str,
) -> list[str]:
    """Each hole's text as it appears inside the manifest string (escaped), in hole order; `env`
    and `info` are their fills already (`escaped(encode_json(...))`). Outside the manifest
    string (blob names in the safetensors entries) a hole's text is the same without its escaped
    quotes."""
    fasts: dict[str, str] = {}
    for sha, fast in digests:
        fasts.setdefault(sha, fast)
    out = [f'\\"{created}\\"', env, info]
    for sha in order:
        out.append(f'\\"{sha}\\"')
        out.append(f'\\"{fasts[sha]}\\"')
    limit = argtree.LIMITS.max_string
    for call in calls:
        meta = encode_json(call.meta)
        if len(meta) > limit:  # a string to cut (an exception's text): as the writer does
            meta = encode_json(bounded_meta(call.meta))
        returned = call.returned if call.outputs is not None else None
        out.append(escaped(encode_json(call.args)))
        out.append(escaped(encode_json(call.kwargs)))
        out.append(escaped(meta))
        out.append(escaped(encode_json(returned)))
        for cap in (call.inputs, call.outputs):
            if cap is not None:
                out += [str(st.base_ptr) for st in cap.storages]
                out += [str(t.data_ptr) for t in cap.tensors]
    return out


def build_template(
    calls: Sequence[CallRecord],
    pattern: tuple[int, ...],
    order: dict[str, int],
    wheres: Sequence[Where],
    inline: dict[str, tuple[memoryview, int]],
    nonce: str,
) -> Template | None:
    """The header of these calls with a token for every hole, built by the writer's own manifest
    and header code and split at the tokens (holes numbered as `template_fills` lists them);
    None for a header too large to be one."""

    def tok(k: int) -> str:
        return f"KDUMPHOLE{nonce}x{k}y"

    k = calls_hole(len(order))
    shas = [tok(sha_hole(u)) for u in range(len(order))]
    fasts = [tok(fast_hole(u)) for u in range(len(order))]
    held: list[Captured] = []
    marked = []
    for call in calls:
        holes = [tok(k + j) for j in range(CALL_HOLES)]
        k += CALL_HOLES
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
                launch=call.launch,
            )
        )
    sizes = [st.span_nbytes for cap in held for st in cap.storages]
    maker = manifest_maker(
        marked,
        sizes,
        wheres,
        tok(ENV_HOLE),  # type: ignore[arg-type]
        tok(INFO_HOLE),  # type: ignore[arg-type]
        tok(CREATED_HOLE),
    )
    marked_digests = [(shas[u], fasts[u]) for u in pattern]
    marked_inline = {shas[order[sha]]: v for sha, v in inline.items()}
    try:
        raw = header_for(maker(marked_digests), marked_inline)[0]
    except Exception:  # too large for a header: the ordinary path says so
        return None
    return _split_at_tokens(raw.rstrip(b" ").decode("ascii"), nonce, k)


def _split_at_tokens(text: str, nonce: str, holes: int) -> Template:
    """A header text with tokens as a Template: a token inside the manifest string (between
    escaped quotes) becomes its hole's field; one outside it (a blob name in the safetensors
    entries) a field after the `holes` holes' own."""
    one = rf"KDUMPHOLE{nonce}x(\d+)y"
    parts: list[str] = []
    outside: list[int] = []
    pos = 0
    for m in re.finditer(rf'\\"{one}\\"|{one}', text):
        parts.append(text[pos : m.start()].replace("{", "{{").replace("}", "}}"))
        if m.group(1) is not None:
            parts.append(f"{{{m.group(1)}}}")
        else:
            parts.append(f"{{{holes + len(outside)}}}")  # after every hole's own field
            outside.append(int(m.group(2)))
        pos = m.end()
    parts.append(text[pos:].replace("{", "{{").replace("}", "}}"))
    return Template("".join(parts), tuple(outside))


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
        (escaped: `escaped`)."""
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


def repeat_form(tpl: Template, fills: list[str], blobs: int) -> tuple[RepeatForm, str] | None:
    """The template of a one-call header with every fill but the creation time, the blob digests
    and the call's meta put in: what an exact repeat of that call (same arguments, tensors,
    layouts, env and info) changes; with that header's creation time. None where the form does
    not give that header byte for byte."""
    meta = calls_hole(blobs) + 2  # the call's args, kwargs, then its meta
    if len(fills) < meta + 2:
        return None
    new: dict[int, int] = {CREATED_HOLE: 0, meta: 1 + 2 * blobs}
    for u in range(blobs):
        new[sha_hole(u)] = 1 + 2 * u
        new[fast_hole(u)] = 2 + 2 * u
    # Kept holes become marks (control characters: no fill has one), the text is escaped
    # for str.format, then the marks become its fields.
    outside: list[str] = []
    for hole in tpl.outside:  # blob names in the safetensors entries: a sha without quotes
        u, odd = divmod(hole - sha_hole(0), 2)
        if odd or not 0 <= u < blobs:
            return None
        outside.append(f"\x00{2 + 2 * blobs + u}\x01")
    inner = [f"\x00{new[k]}\x01" if k in new else f for k, f in enumerate(fills)]
    try:
        text = tpl.form.format(*inner, *outside).replace("{", "{{").replace("}", "}}")
        form = RepeatForm(re.sub("\x00(\\d+)\x01", r"{\1}", text), blobs)
        digests = [(fills[sha_hole(u)][2:-2], fills[fast_hole(u)][2:-2]) for u in range(blobs)]
        created = fills[CREATED_HOLE][2:-2]
        same = form.render(created, digests, fills[meta]) == render(tpl, fills)
    except (IndexError, KeyError, ValueError):
        return None
    return (form, created) if same else None
