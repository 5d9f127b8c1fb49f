"""Deterministic mutations of bundles (torch-free): a case is (base, kind, seed) and always
builds the same files, so a failing case can be rebuilt anywhere from its name."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUNDLE_NAME = "case.kdump"


@dataclass(frozen=True)
class Case:
    base: str  # name of a base under the bases folder: a file `X.kdump` or a store folder `X/`
    kind: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.base}-{self.kind}-{self.seed}"


# --------------------------------------------------------------------------------------------
# The container


def split(content: bytes) -> tuple[dict[str, Any], Any, bytes]:
    (n,) = struct.unpack("<Q", content[:8])
    header = json.loads(content[8 : 8 + n])
    manifest = json.loads(header["__metadata__"]["kdump.manifest"])
    return header, manifest, content[8 + n :]


def join(header: dict[str, Any], manifest_text: str, data: bytes) -> bytes:
    header = dict(header)
    header["__metadata__"] = {"kdump.manifest": manifest_text}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _paths(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _pick_path(rng: random.Random, node: Any) -> tuple:
    paths = [p for p in _paths(node) if p]
    return rng.choice(paths)


def _get(node: Any, path: tuple) -> Any:
    for k in path:
        node = node[k]
    return node


def _set(node: Any, path: tuple, value: Any) -> None:
    _get(node, path[:-1])[path[-1]] = value


# --------------------------------------------------------------------------------------------
# Values

JUNK_STRINGS = (
    "\x1b]52;c;aGVsbG8=\x07",
    "\x1b[2J\x1b[H",
    "[bold red]x[/]",
    "[/]",
    "\u202eevil\u2066",
    "\ud800",
    "é" * 50,
    "\x00\x01\x7f",
    "float128",
    "inline",
    "store",
    "U8",
    "cuda:0",
    "a" * 64,
)


def _swap(rng: random.Random, old: Any) -> Any:
    """A value of another JSON type than `old` (int↔float↔bool↔str↔null↔list↔object)."""
    choices: list[Callable[[], Any]] = [
        lambda: float(old) if isinstance(old, int) and not isinstance(old, bool) else 0.0,
        lambda: rng.choice([True, False]),
        lambda: str(old),
        lambda: None,
        lambda: [old],
        lambda: {"v": old},
        lambda: rng.randrange(-4, 1 << 20),
        lambda: 1.5,
    ]
    return rng.choice(choices)()


def _huge(rng: random.Random) -> Any:
    return rng.choice([2**63 - 1, 2**63, 2**64 + 1, 10**30, 2**48 + 1, 1 << 40, 1e308, 10**400])


DEEP = "__kdump_fuzz_deep__"


def _deep_text(rng: random.Random) -> str:
    """JSON text nested `n` levels (written as text: deeper than json.dumps can go)."""
    n = rng.choice([63, 65, 70, 200, 3000, 100_000])
    leaf = rng.choice(["0", '"x"', '{"$tensor": 0}'])
    wrap = rng.choice([("[", "]"), ('{"$tuple": [', "]}"), ('{"k": ', "}")])
    return wrap[0] * n + leaf + wrap[1] * n


def _wide(rng: random.Random) -> Any:
    return [rng.randrange(100) for _ in range(rng.choice([1000, 200_000]))]


def _long_string(rng: random.Random) -> str:
    n = rng.choice([3000, 200_000, (1 << 20) + 1])
    return rng.choice(["x", "\x1b", "[", "é"]) * n


# --------------------------------------------------------------------------------------------
# Mutations of one bundle's bytes


def _json_edit(rng: random.Random, content: bytes, what: str) -> bytes:
    header, manifest, data = split(content)
    path = _pick_path(rng, manifest)
    old = _get(manifest, path)
    if what == "swap":
        _set(manifest, path, _swap(rng, old))
    elif what == "huge":
        _set(manifest, path, _huge(rng))
    elif what == "negative":
        v = old if isinstance(old, int) and not isinstance(old, bool) else 1
        _set(manifest, path, -abs(v) - rng.randrange(1, 4096))
    elif what == "deep":
        _set(manifest, path, DEEP)
    elif what == "wide":
        _set(manifest, path, _wide(rng))
    elif what == "long":
        _set(manifest, path, _long_string(rng))
    elif what == "junk":
        _set(manifest, path, rng.choice(JUNK_STRINGS))
    elif what == "missing":
        parent = _get(manifest, path[:-1])
        del parent[path[-1]]
    elif what == "extra":
        parent = _get(manifest, path[:-1])
        if isinstance(parent, dict):
            parent[rng.choice(["extra", "$tensor", "source", "\x1b"])] = rng.choice([1, "x", None])
        else:
            parent.append(rng.choice([1, "x", None, {}, [], {"$tensor": 99}]))
    text = json.dumps(manifest)
    if what == "deep":
        text = text.replace(json.dumps(DEEP), _deep_text(rng), 1)
    if what == "duplicate":  # a key given twice: JSON keeps the last
        key = rng.choice(["version", "calls", "blobs", "format"])
        value = json.dumps(rng.choice([True, 0.0, None, "2", [], {}, 2]))
        text = (
            text[:-1] + f', "{key}": {value}}}'
            if rng.random() < 0.5
            else ("{" + f'"{key}": {value}, ' + text[1:])
        )
    return join(header, text, data)


def _header_edit(rng: random.Random, content: bytes) -> bytes:
    header, _, data = split(content)
    entries = [k for k in header if k != "__metadata__"]
    if not entries:
        return content
    name = rng.choice(entries)
    entry = header[name]
    field = rng.choice(["data_offsets", "shape", "dtype", "overlap"])
    if field == "data_offsets":
        entry["data_offsets"] = [_swap(rng, 0), rng.choice([0, 8, len(data) + 1, 2**64])]
    elif field == "shape":
        entry["shape"] = rng.choice([[True], [1.0], [-1], [], [2**64]])
    elif field == "dtype":
        entry["dtype"] = rng.choice(["F32", None, 1])
    else:  # every blob claims the same bytes
        for k in entries:
            header[k] = dict(header[name])
    return join(header, header["__metadata__"]["kdump.manifest"], data)


def _bytes_edit(rng: random.Random, content: bytes, what: str) -> bytes:
    raw = bytearray(content)
    (hlen,) = struct.unpack("<Q", content[:8])
    if what == "flip_header":
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(8, 8 + hlen)] ^= rng.randrange(1, 256)
    elif what == "flip_data" and len(raw) > 8 + hlen:
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(8 + hlen, len(raw))] ^= rng.randrange(1, 256)
    elif what == "truncate":
        del raw[rng.randrange(0, len(raw)) :]
    elif what == "length":
        raw[:8] = struct.pack("<Q", rng.choice([0, 1, hlen - 1, hlen + 1, 2**62, 2**64 - 1]))
    elif what == "digit":
        digits = [i for i in range(8, 8 + hlen) if 0x30 <= raw[i] <= 0x39]
        for _ in range(rng.randint(1, 3)):
            raw[rng.choice(digits)] = rng.choice(b"0123456789-.e")
    return bytes(raw)


BYTE_KINDS = ("flip_header", "flip_data", "truncate", "length", "digit")
JSON_KINDS = ("swap", "huge", "negative", "deep", "wide", "long", "junk", "missing", "extra")
JSON_KINDS += ("duplicate",)
STORE_KINDS = ("blob_missing", "blob_swapped", "blob_fifo", "blob_dir", "blob_symlink")
STORE_KINDS += ("blob_devzero", "blob_truncated", "no_store")
SPECIAL_KINDS = ("bundle_fifo", "bundle_dir", "bundle_devnull", "empty")


def mutate_bytes(kind: str, seed: int, content: bytes) -> bytes:
    rng = random.Random(f"{kind}:{seed}")
    if kind in BYTE_KINDS:
        return _bytes_edit(rng, content, kind)
    if kind == "header":
        return _header_edit(rng, content)
    if kind in JSON_KINDS:
        return _json_edit(rng, content, kind)
    raise ValueError(kind)


def _store_edit(rng: random.Random, folder: Path, kind: str) -> None:
    blobs = sorted(p for p in (folder / "blobs").rglob("*") if p.is_file() and p.stat().st_size)
    victim = rng.choice(blobs)
    if kind == "blob_missing":
        victim.unlink()
    elif kind == "blob_swapped":
        other = rng.choice([b for b in blobs if b != victim] or blobs)
        data = other.read_bytes()
        victim.write_bytes(data if other != victim else data[::-1] + b"x")
    elif kind == "blob_fifo":
        victim.unlink()
        os.mkfifo(victim)
    elif kind == "blob_dir":
        victim.unlink()
        victim.mkdir()
    elif kind == "blob_symlink":
        victim.unlink()
        target = rng.choice([b for b in blobs if b != victim] or ["/nonexistent"])
        victim.symlink_to(target)
    elif kind == "blob_devzero":
        victim.unlink()
        victim.symlink_to("/dev/zero")
    elif kind == "blob_truncated":
        victim.write_bytes(victim.read_bytes()[: rng.randrange(0, victim.stat().st_size)])
    elif kind == "no_store":
        shutil.rmtree(folder / "blobs")


def build(case: Case, bases: Path, scratch: Path) -> Path:
    """Write the case's files under `scratch` (emptied first); the path to give the reader."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    src = bases / case.base
    target = scratch / BUNDLE_NAME
    if src.is_dir():  # a capture folder: a bundle and its shared store
        shutil.copytree(src, scratch / "store", symlinks=True)
        target = scratch / "store" / BUNDLE_NAME
        if case.kind in STORE_KINDS:
            _store_edit(random.Random(f"{case.kind}:{case.seed}"), scratch / "store", case.kind)
        else:
            target.write_bytes(mutate_bytes(case.kind, case.seed, target.read_bytes()))
        return target
    if case.kind == "bundle_fifo":
        os.mkfifo(target)
    elif case.kind == "bundle_dir":
        target.mkdir()
    elif case.kind == "bundle_devnull":
        target.symlink_to("/dev/null")
    elif case.kind == "empty":
        target.write_bytes(b"")
    else:
        target.write_bytes(mutate_bytes(case.kind, case.seed, src.read_bytes()))
    return target


def campaign(file_bases: list[str], store_bases: list[str], per_kind: int) -> list[Case]:
    """The deterministic list of cases: every kind over the bases, `per_kind` seeds each."""
    cases: list[Case] = []
    for kind in (*BYTE_KINDS, *JSON_KINDS, "header"):
        for seed in range(per_kind):
            cases.append(Case(file_bases[seed % len(file_bases)], kind, seed))
            if seed % 4 == 0:
                cases.append(Case(store_bases[seed % len(store_bases)], kind, seed))
    for kind in STORE_KINDS:
        for seed in range(max(4, per_kind // 8)):
            cases.append(Case(store_bases[seed % len(store_bases)], kind, seed))
    for kind in SPECIAL_KINDS:
        cases.append(Case(file_bases[0], kind, 0))
    return cases
