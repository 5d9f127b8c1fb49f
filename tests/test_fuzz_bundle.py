"""Fuzzing the reader: mutated real bundles must load correctly or raise a KdumpError.

Every case ends in a KdumpError or a successful load; after a successful load every call is
materialised on CPU (inputs and recorded outputs), which again must succeed or raise a KdumpError.
No other exception, no hang (an interval timer interrupts a slow case), and no allocation out of
proportion to the file (torch.empty inside kdump.bundle.tensors is wrapped to check every size).
"""

from __future__ import annotations

import json
import math
import signal
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdump.bundle.tensors
from kdump.bundle import attach_outputs, capture_call, input_tensors, load_bundle, save_calls
from kdump.errors import KdumpError

CASE_SECONDS = 5.0
FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


def _make_bases(folder: Path) -> list[bytes]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 10, generator=g)
    q = (torch.randn(64, generator=g) * 30).to(torch.float8_e4m3fn)
    sc = torch.empty_strided((6, 2), (1, 8), dtype=torch.float32).copy_(torch.rand(6, 2) + 1)
    labels = torch.randint(-1, 3, (6,), dtype=torch.int32, generator=g)
    args = [(q[:48].view(6, 8), sc), x[1:, ::3], labels, 3, 0.5]
    kwargs = {"d": x.t(), "dt": torch.bfloat16, "e": torch.empty(0, 3), "s": torch.tensor(2.0)}
    rec = capture_call("m:f", args, kwargs, names=["a", "x", "labels", "n", "alpha"])
    live = input_tensors(rec, args, kwargs)
    x.add_(1.0)
    attach_outputs(rec, live, [4])
    small = capture_call("m:g", [torch.arange(1, 9, dtype=torch.int64).view(2, 4).t()], {})
    out = []
    for i, calls in enumerate(([rec, small], [small])):
        p = save_calls(folder / f"base{i}.kdump", calls)
        out.append(p.read_bytes())
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    return _make_bases(tmp_path_factory.mktemp("fuzzbase"))


class _GuardedTorch:
    """Forwards to torch; `empty` checks that no single buffer exceeds the limit."""

    def __init__(self) -> None:
        self.limit = 0
        self.total = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size: Any, **kw: Any) -> torch.Tensor:
        dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        dtype = kw.get("dtype") or torch.get_default_dtype()
        nbytes = math.prod(int(d) for d in dims) * dtype.itemsize
        assert nbytes <= self.limit, f"reader allocated {nbytes} bytes for a small file"
        self.total += nbytes
        return torch.empty(*size, **kw)


@contextmanager
def _guards(file_size: int) -> Iterator[_GuardedTorch]:
    guard = _GuardedTorch()
    # A span is at most a blob (itself inside the file); a storage may also re-create up to
    # PREFIX_LIMIT zero bytes before its span, plus alignment slack.
    guard.limit = file_size + kdump.bundle.tensors.PREFIX_LIMIT + (1 << 20)
    saved = kdump.bundle.tensors.torch

    def alarm(*_: Any) -> None:
        raise TimeoutError("fuzz case took too long (a hang in the reader?)")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    kdump.bundle.tensors.torch = guard  # type: ignore[assignment]
    try:
        yield guard
    finally:
        kdump.bundle.tensors.torch = saved
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _exercise(path: Path, content: bytes) -> str:
    """Load and materialise everything; return how it ended ('ok' or the error's first words)."""
    path.write_bytes(content)
    with _guards(len(content)) as guard:
        try:
            b = load_bundle(path)
        except KdumpError as exc:
            assert "\n" not in str(exc), "error messages are one line"
            return "load: " + str(exc).split(":")[-1][:30]
        ended = "ok"
        for call in b.calls:
            try:
                m = call.materialize("cpu")
                assert len(m.tensors) == len(call.tensors)
                call.materialize_outputs("cpu")
                _ = call.tensor_names
            except KdumpError as exc:
                assert "\n" not in str(exc)
                ended = "materialise: error"
        try:
            b.verify()
        except KdumpError:
            ended += " verify: error"
        b.close()
        assert guard.total <= len(b.calls) * 64 * (len(content) + (1 << 20)) + (64 << 20)
        return ended


# ---------------------------------------------------------------------------------------------
# 1. Byte-level mutations of the whole file (header length, header JSON, data section)

_byte_op = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 16)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
    st.tuples(
        st.just("length"),
        st.one_of(st.integers(0, 1 << 20), st.sampled_from([2**62, 2**64 - 1, 100_000_001])),
    ),
    st.tuples(st.just("digit"), st.integers(0, 1 << 20), st.sampled_from(list(b"0123456789-"))),
)


def _apply_byte_op(raw: bytearray, op: tuple[Any, ...]) -> None:
    kind = op[0]
    n = len(raw)
    (hlen,) = struct.unpack("<Q", bytes(raw[:8])) if n >= 8 else (0,)
    if kind == "flip" and n:
        # Bias towards the header, where the structure is.
        pos = op[1] % max(1, min(n, 8 + hlen)) if op[1] % 4 else op[1] % n
        raw[pos] ^= op[2]
    elif kind == "insert":
        pos = op[1] % (n + 1)
        raw[pos:pos] = op[2]
    elif kind == "delete" and n:
        pos = op[1] % n
        del raw[pos : pos + op[2]]
    elif kind == "truncate":
        del raw[op[1] % (n + 1) :]
    elif kind == "extend":
        raw.extend(op[1])
    elif kind == "length" and n >= 8:
        raw[:8] = struct.pack("<Q", op[1])
    elif kind == "digit" and n:
        # Replace a digit inside the header's JSON: changes numbers (shapes, offsets, sizes).
        digits = [i for i in range(8, min(n, 8 + hlen)) if 0x30 <= raw[i] <= 0x39]
        if digits:
            raw[digits[op[1] % len(digits)]] = op[2]


@FUZZ
@given(which=st.integers(0, 1), ops=st.lists(_byte_op, min_size=1, max_size=4))
def test_fuzz_bytes(
    bases: list[bytes], tmp_path_factory: pytest.TempPathFactory, which: int, ops: list
) -> None:
    raw = bytearray(bases[which])
    for op in ops:
        _apply_byte_op(raw, op)
    _exercise(_case_path(tmp_path_factory), bytes(raw))


# ---------------------------------------------------------------------------------------------
# 2. Structured mutations of the manifest JSON (numbers, types, missing keys)


def _paths(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


_values = st.one_of(
    st.integers(-(2**63), 2**64),
    st.sampled_from([2**62, -1, 0, 1, 2**48, 2**48 + 1, 2**31, 1 << 26, 7]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["float128", "inline", "store", "U8", "cuda:0", "a" * 64, "e3b0c442"]),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-4, 2**40), max_size=5),
    st.sampled_from([{}, [], {"$tensor": 0}, {"$tensor": 99}, {"$tuple": 1}, {"$dict": [[1]]}]),
)

_edit = st.one_of(
    st.tuples(st.just("set"), _values),
    st.tuples(st.just("scale"), st.sampled_from([-1, 2, 1000, 2**20, 2**40])),
    st.tuples(st.just("add"), st.integers(-4096, 4096)),
    st.tuples(st.just("delete")),
)


def _mutate(manifest: Any, path: tuple, edit: tuple[Any, ...]) -> Any:
    if not path:
        return edit[1] if edit[0] == "set" else manifest
    parent = manifest
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    old = parent[key]
    if edit[0] == "delete":
        del parent[key]
    elif edit[0] == "set":
        parent[key] = edit[1]
    elif isinstance(old, int) and not isinstance(old, bool):
        parent[key] = old * edit[1] if edit[0] == "scale" else old + edit[1]
    else:
        parent[key] = edit[1] if isinstance(edit[1], int) and edit[0] == "scale" else old
    return manifest


def _rewrite(content: bytes, fn: Any) -> bytes:
    (n,) = struct.unpack("<Q", content[:8])
    header = json.loads(content[8 : 8 + n])
    data = content[8 + n :]
    manifest = json.loads(header["__metadata__"]["kdump.manifest"])
    manifest = fn(manifest, header)
    header["__metadata__"]["kdump.manifest"] = json.dumps(manifest)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


_counter = [0]


def _case_path(factory: pytest.TempPathFactory) -> Path:
    if not hasattr(_case_path, "folder"):
        _case_path.folder = factory.mktemp("fuzzcase")  # type: ignore[attr-defined]
    _counter[0] += 1
    return _case_path.folder / "case.kdump"  # type: ignore[attr-defined]


@FUZZ
@given(
    which=st.integers(0, 1),
    edits=st.lists(st.tuples(st.integers(0, 10**6), _edit), min_size=1, max_size=3),
    header_edit=st.booleans(),
    data=st.data(),
)
def test_fuzz_manifest(
    bases: list[bytes],
    tmp_path_factory: pytest.TempPathFactory,
    which: int,
    edits: list,
    header_edit: bool,
    data: st.DataObject,
) -> None:
    def fn(manifest: Any, header: dict[str, Any]) -> Any:
        target: Any = manifest
        if header_edit:  # sometimes edit the safetensors header entries instead
            target = {k: v for k, v in header.items() if k != "__metadata__"}
        for pick, edit in edits:
            paths = list(_paths(target))
            target = _mutate(target, paths[pick % len(paths)], edit)
        if header_edit:
            if isinstance(target, dict):
                header.clear()
                header.update({**target, "__metadata__": {"kdump.manifest": "{}"}})
            return manifest
        return target

    content = _rewrite(bases[which], fn)
    if data.draw(st.booleans()):  # and sometimes a blob byte too
        pos = data.draw(st.integers(1, 64))
        content = content[:-pos] + bytes([content[-pos] ^ 0x5A]) + content[len(content) - pos + 1 :]
    _exercise(_case_path(tmp_path_factory), content)


def test_unmutated_bases_load(bases: list[bytes], tmp_path: Path) -> None:
    assert _exercise(tmp_path / "b.kdump", bases[0]) == "ok"
    assert _exercise(tmp_path / "c.kdump", bases[1]) == "ok"
    assert _exercise(tmp_path / "d.kdump", bases[0][:-1]).startswith("load")
