"""Bundles end to end: capture_call -> save_calls -> load_bundle -> call.args / kwargs."""

from __future__ import annotations

import enum
import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from tensor_data import ROUND_TRIP_DTYPES, bits, random_bits

import kdump
from kdump.bundle import (
    BlobStore,
    attach_outputs,
    capture_call,
    input_tensors,
    load_bundle,
    pack,
    save_calls,
)
from kdump.bundle.store import blob_digests, fast_checksum
from kdump.errors import BundleError, KdumpError
from kdump.errors import BundleErrorKind as K
from kdump.format.argtree import Opaque, RecordedEnum
from kdump.format.records import ALIGN_MOD, FORMAT_VERSION, PAD_PREFIX, Checksum

GEN = torch.Generator().manual_seed(99)

DTYPES = ROUND_TRIP_DTYPES


def rand(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return random_bits(shape, dtype, generator=GEN)


def assert_exact(got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    assert got.storage_offset() == want.storage_offset()
    assert bits(got) == bits(want)


def read_manifest(path: Path) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return header, json.loads(header["__metadata__"]["kdump.manifest"]), raw[8 + n :]


def write_manifest(path: Path, header: dict[str, Any], manifest: Any, data: bytes) -> None:
    header = dict(header)
    header["__metadata__"] = {"kdump.manifest": json.dumps(manifest)}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def edit_manifest(path: Path, fn) -> None:
    header, manifest, data = read_manifest(path)
    fn(manifest)
    write_manifest(path, header, manifest, data)


# ---------------------------------------------------------------------------------------------
# Round trips


def layouts(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    base = rand((16, 24), dtype)
    m, kb = 30, 5
    tma = torch.empty_strided((m, kb), (1, (m + 3) // 4 * 4), dtype=dtype)
    tma.copy_(rand((m, kb), dtype))
    return {
        "slice": base[2:14:3, 1::2],
        "transposed": rand((12, 20), dtype).t(),
        "expanded": rand((5, 1), dtype).expand(5, 7),
        "tma": tma,
        "offset": rand((300_000,), dtype)[200_001:200_101],
        "scalar": rand((), dtype),
        "empty": rand((0, 5), dtype),
        "empty_view": base[:, 4:4],
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_layout(tmp_path: Path, dtype: torch.dtype) -> None:
    ts = layouts(dtype)
    names = list(ts)
    args = [ts[n] for n in names[:4]]
    kwargs = {n: ts[n] for n in names[4:]}
    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", args, kwargs, names=names[:4])])
    call = kdump.load_bundle(path).calls[0]
    for got, want in zip(call.args, args):
        assert_exact(got, want)
    for k, want in kwargs.items():
        assert_exact(call.kwargs[k], want)
    assert call.tensor_names[:4] == names[:4]


def test_aliasing_survives_the_file(tmp_path: Path) -> None:
    base = rand((32, 32), torch.bfloat16)
    q = rand((4096,), torch.float8_e4m3fn)
    data, scale = q[:3072].view(48, 64), q[3072:].view(torch.float8_e8m0fnu)
    w = rand((8, 8))
    args = [base, base[4:20, 8:], (data, scale), w, w, base.t()]
    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", args, {"x": base[10]})])
    call = load_bundle(path).calls[0]
    a = call.args
    ptrs = {t.untyped_storage().data_ptr() for t in (a[0], a[1], a[5], call.kwargs["x"])}
    assert len(ptrs) == 1
    a[1][6, 3] = 5.0  # base[10, 11]
    assert a[0][10, 11] == 5.0 and a[5][11, 10] == 5.0 and call.kwargs["x"][11] == 5.0
    assert a[3] is a[4]  # the same tensor passed twice is one tensor
    d, s = a[2]
    assert d.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
    assert s.data_ptr() == d.data_ptr() + 3072
    assert_exact(d, data)
    assert_exact(s, scale)
    man = read_manifest(path)[1]["calls"][0]
    assert len(man["storages"]) == 3  # base, q, w


def test_alignment_recorded_and_recreated(tmp_path: Path) -> None:
    big = rand((8192,), torch.uint8)
    views = [big[o : o + 100] for o in (1, 13, 200, 517, 1023)]
    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", views)])
    call = load_bundle(path).calls[0]
    recorded = [r.data_ptr % ALIGN_MOD for r in call.tensors]
    assert recorded == [v.data_ptr() % ALIGN_MOD for v in views]
    assert [t.data_ptr() % ALIGN_MOD for t in call.args] == recorded
    mc = call.materialize("cpu")
    assert [t.data_ptr() % ALIGN_MOD for t in mc.tensors] == recorded


def test_placements_through_the_bundle(tmp_path: Path) -> None:
    x = rand((40, 40), torch.float16)[3:30, 5:]
    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", [x])])
    call = load_bundle(path).calls[0]
    flush = call.materialize("cpu", kdump.bundle.Placement(flush_end=True))
    alloc = flush.materialized.allocations[0]
    assert alloc.span_ptr + alloc.span_nbytes == alloc.buffer.data_ptr() + alloc.buffer.numel()
    assert bits(flush.args[0]) == bits(x) and flush.args[0].stride() == x.stride()
    halo = call.materialize("cpu", kdump.bundle.Placement(halo=256))
    buf = halo.materialized.allocations[0]
    assert torch.all(buf.buffer[buf.span_offset - 256 : buf.span_offset] == 0xFF)
    end = buf.span_offset + buf.span_nbytes
    assert torch.all(buf.buffer[end : end + 256] == 0xFF)
    assert bits(halo.args[0]) == bits(x)


def test_materialize_gives_fresh_copies(tmp_path: Path) -> None:
    x = rand((64,))
    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", [x])])
    call = load_bundle(path).calls[0]
    one, two = call.materialize(), call.materialize()
    one.args[0].fill_(1.0)
    assert bits(two.args[0]) == bits(x)
    assert bits(load_bundle(path).calls[0].args[0]) == bits(x)  # the file was not written


class Recipe(enum.Enum):
    FP8 = 1
    FP4 = "fp4"


def test_argument_tree_round_trip(tmp_path: Path) -> None:
    t = rand((3, 3))
    tree = {
        "enum": Recipe.FP4,
        "int_enum": Recipe.FP8,
        "dtype": torch.float8_e4m3fn,
        "device": torch.device("cuda", 3),
        "opaque": object(),
        "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 1e-300, 0.1],
        "keys": {1: "one", (2, 3): "pair", None: t, "s": 4},
        "nested": ((1, (2, (t, None))), [True, False], "text", 2**70),
    }
    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", [], tree)])
    got = load_bundle(path).calls[0].kwargs
    assert got["enum"] == RecordedEnum(f"{__name__}.Recipe", "FP4", "fp4")
    assert int(got["int_enum"]) == 1
    assert got["dtype"] is torch.float8_e4m3fn
    assert got["device"] == torch.device("cuda:3")
    assert isinstance(got["opaque"], Opaque) and got["opaque"].cls == "builtins.object"
    f = got["floats"]
    assert math.isnan(f[0]) and f[1] == math.inf and f[2] == -math.inf
    assert f[3] == 0.0 and math.copysign(1.0, f[3]) == -1.0 and f[4:] == [1e-300, 0.1]
    assert set(got["keys"]) == {1, (2, 3), None, "s"} and got["keys"][(2, 3)] == "pair"
    assert_exact(got["keys"][None], t)
    n = got["nested"]
    assert n[0][0] == 1 and isinstance(n[0][1], tuple) and n[0][1][0] == 2
    assert n[0][1][1][0] is got["keys"][None]  # same tensor object -> one table entry
    assert n[1:] == ([True, False], "text", 2**70)


def test_public_api(tmp_path: Path) -> None:
    a = rand((8, 16), torch.bfloat16)
    d = rand((8, 4))
    args, kwargs = [(a, a[:, :2])], {"d": d, "alpha": 0.5}
    rec = capture_call(
        "deep_gemm:fn", args, kwargs, called_as="fn_alias", names=["a"], meta={"rank": 3}
    )
    live = input_tensors(rec, args, kwargs)
    assert live[2] is d
    d.mul_(2.0).add_(1.0)  # the "kernel" writes d
    attach_outputs(rec, live, [2])
    plain = capture_call("other:g", [rand((2,), torch.int32)])
    path = save_calls(tmp_path / "b.kdump", [rec, plain], env={"hostname": "h"}, info={"m": 1})
    b = kdump.load_bundle(path)
    assert (b.version, len(b.calls)) == (FORMAT_VERSION, 2)
    assert (b.env["hostname"], b.info) == ("h", {"m": 1})
    c = b.calls[0]
    assert (c.target, c.called_as, c.meta, c.index) == ("deep_gemm:fn", "fn_alias", {"rank": 3}, 0)
    assert c.tensor_names == ["a[0]", "a[1]", "d"]
    assert c.kwargs["alpha"] == 0.5 and isinstance(c.args[0], tuple)
    assert c.outputs is not None and set(c.outputs) == {"d"}
    assert_exact(c.outputs["d"], d)  # post-call value
    assert bits(c.kwargs["d"]) != bits(d)  # the input is the pre-call value
    assert b.calls[1].outputs is None and b.call(1).target == "other:g"
    with pytest.raises(BundleError, match="no call 5"):
        b.call(5)
    assert "kdump.Call" in repr(c) and f"v{FORMAT_VERSION}" in repr(b)


# ---------------------------------------------------------------------------------------------
# De-duplication, store, pack


def test_weight_passed_to_100_calls_is_stored_once(tmp_path: Path) -> None:
    w = rand((256, 1024))  # 1 MiB
    calls = [capture_call("m:f", [rand((4, 1024)), w]) for _ in range(100)]
    path = save_calls(tmp_path / "b.kdump", calls)
    size = path.stat().st_size
    assert size < w.numel() * 4 + 100 * 4 * 1024 * 4 + 400_000
    b = load_bundle(path)
    assert len(b.blobs) == 101
    assert_exact(b.calls[73].args[1], w)
    assert b.calls[73].storages[1].blob == b.calls[0].storages[1].blob


def test_blob_store_shared_pack_and_missing_store(tmp_path: Path) -> None:
    cap = tmp_path / "capture"
    store = BlobStore(cap)
    w = rand((512, 512))
    x1, x2 = rand((16, 512)), rand((16, 512))
    p1 = save_calls(cap / "rank0" / "a.kdump", [capture_call("m:f", [x1, w])], store=store)
    p2 = save_calls(cap / "rank1" / "b.kdump", [capture_call("m:f", [x2, w])], store=store)
    blobs = sorted((cap / "blobs").rglob("*"))
    files = [f for f in blobs if f.is_file()]
    assert len(files) == 3  # w shared between the two bundles
    assert all(f.parent.name == f.name[:2] for f in files)
    assert p1.stat().st_size < 10_000 and p2.stat().st_size < 10_000
    assert_exact(load_bundle(p2).calls[0].args[1], w)

    packed = pack(p1, tmp_path / "packed.kdump")
    moved = tmp_path / "elsewhere" / "a.kdump"
    moved.parent.mkdir()
    shutil.copy(p1, moved)
    shutil.rmtree(cap / "blobs")
    b = load_bundle(packed)
    assert [info.where.value for info in b.blobs.values()] == ["inline"] * len(b.blobs)
    assert_exact(b.calls[0].args[0], x1)
    assert_exact(b.calls[0].args[1], w)
    b.verify()
    with pytest.raises(BundleError, match="store"):
        load_bundle(moved).calls[0].materialize()
    with pytest.raises(BundleError, match="store"):
        load_bundle(p1).calls[0].materialize()


def test_store_blob_of_wrong_size(tmp_path: Path) -> None:
    p = save_calls(
        tmp_path / "a.kdump", [capture_call("m:f", [rand((64,))])], store=BlobStore(tmp_path)
    )
    blob = next(f for f in (tmp_path / "blobs").rglob("*") if f.is_file())
    blob.write_bytes(blob.read_bytes()[:-1])
    with pytest.raises(BundleError, match="wrong size"):
        load_bundle(p).calls[0].materialize()


# ---------------------------------------------------------------------------------------------
# Checksums


def test_lazy_verification(tmp_path: Path) -> None:
    good, bad = rand((1000,)), rand((1000,))
    path = save_calls(
        tmp_path / "b.kdump", [capture_call("m:f", [good]), capture_call("m:g", [bad])]
    )
    header, manifest, data = read_manifest(path)
    b, _ = header[manifest["calls"][1]["storages"][0]["blob"]]["data_offsets"]
    raw = bytearray(path.read_bytes())
    raw[len(raw) - len(data) + b + 17] ^= 0x01
    path.write_bytes(bytes(raw))
    bundle = load_bundle(path)  # loads: the manifest is intact
    assert_exact(bundle.calls[0].args[0], good)
    with pytest.raises(BundleError, match="checksum mismatch"):
        bundle.calls[1].materialize()
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(path).verify()
    with pytest.raises(BundleError, match="checksum"):
        pack(path, tmp_path / "p.kdump")


# ---------------------------------------------------------------------------------------------
# Typed errors


@pytest.fixture
def bundle_path(tmp_path: Path) -> Path:
    x = rand((8, 16))
    return save_calls(tmp_path / "b.kdump", [capture_call("m:f", [x[1:, 2:], x])])


def test_truncated_and_lying_files(bundle_path: Path) -> None:
    raw = bundle_path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = len(raw[8 : 8 + n].rstrip())  # the JSON without its padding
    cases = {
        "empty": (b"", "too short", K.TRUNCATED),
        "seven": (raw[:7], "too short", K.TRUNCATED),
        "header cut": (raw[: 8 + n // 2], "header length", K.TRUNCATED),
        "data cut": (raw[:-10], "data section", K.TRUNCATED),
        "length too big": (struct.pack("<Q", n + 1000) + raw[8:], "header length", K.TRUNCATED),
        "length zero": (struct.pack("<Q", 0) + raw[8:], "header length", K.TRUNCATED),
        "length huge": (struct.pack("<Q", 2**63) + raw[8:], "header length", K.TRUNCATED),
        "length short": (struct.pack("<Q", text - 8) + raw[8:], "not valid JSON", K.BAD_HEADER),
        "garbage": (b"\xff" * 64, "header length", K.TRUNCATED),
        "binary header": (struct.pack("<Q", 8) + b"\xff" * 8, "not valid JSON", K.BAD_HEADER),
        "not object": (struct.pack("<Q", 8) + b"[1,2,3] ", "not a JSON object", K.BAD_HEADER),
    }
    for content, match, kind in cases.values():
        bundle_path.write_bytes(content)
        with pytest.raises(BundleError, match=match) as err:
            load_bundle(bundle_path)
        assert err.value.kind is kind


def test_plain_safetensors_file_is_not_a_bundle(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": rand((4,))}, str(tmp_path / "x.safetensors"))
    with pytest.raises(BundleError, match="without a kdump manifest"):
        load_bundle(tmp_path / "x.safetensors")


def test_directory_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="directory"):
        load_bundle(tmp_path)
    with pytest.raises(BundleError, match="no such file"):
        load_bundle(tmp_path / "nope.kdump")


def _mutations() -> dict[str, tuple[Any, str, K]]:
    def storage(c: dict, **kw: Any) -> None:
        c["calls"][0]["storages"][0].update(kw)

    def tensor(c: dict, **kw: Any) -> None:
        c["calls"][0]["tensors"][0].update(kw)

    return {
        "version": (
            lambda m: m.update(version=FORMAT_VERSION + 1),
            f"version {FORMAT_VERSION + 1} is not supported",
            K.UNSUPPORTED_VERSION,
        ),
        "version str": (lambda m: m.update(version="1"), "not supported", K.UNSUPPORTED_VERSION),
        "format": (lambda m: m.update(format="other"), "not a kdump manifest", K.NOT_A_BUNDLE),
        "neg shape": (lambda m: tensor(m, shape=[-7, 14]), "negative or absurd", K.LIMIT),
        "huge shape": (lambda m: tensor(m, shape=[2**62, 14]), "negative or absurd", K.LIMIT),
        "huge stride": (lambda m: tensor(m, stride=[2**62, 1]), "negative or absurd", K.LIMIT),
        "float shape": (lambda m: tensor(m, shape=[7.0, 14]), "malformed", K.SCHEMA),
        "outside span": (lambda m: tensor(m, shape=[9, 14]), "outside the stored span", K.SCHEMA),
        "offset": (lambda m: tensor(m, storage_offset=100), "outside the stored span", K.SCHEMA),
        "dtype": (lambda m: tensor(m, dtype="float128"), "unknown dtype 'float128'", K.SCHEMA),
        "storage idx": (lambda m: tensor(m, storage=5), "does not exist", K.SCHEMA),
        "span lie": (lambda m: storage(m, span_nbytes=4), "does not hold", K.MISSING_BLOB),
        "neg span": (lambda m: storage(m, span_start=-4), "malformed", K.SCHEMA),
        "unknown blob": (lambda m: storage(m, blob="ab" * 32), "does not hold", K.MISSING_BLOB),
        "extra field": (lambda m: storage(m, color="red"), "unknown fields", K.SCHEMA),
        "index": (lambda m: m["calls"][0].update(index=3), "out of order", K.SCHEMA),
        "bad ref": (
            lambda m: m["calls"][0]["args"].append({"$tensor": 9}),
            "does not exist",
            K.SCHEMA,
        ),
        "bad node": (
            lambda m: m["calls"][0]["args"].append({"$evil": 1}),
            "unknown node",
            K.SCHEMA,
        ),
        "blob nbytes": (
            lambda m: [v.update(nbytes=v["nbytes"] + 1) for v in m["blobs"].values()],
            "listed inline but not stored",
            K.MISSING_BLOB,
        ),
        "calls": (lambda m: m.update(calls={}), "lacks its blob table", K.SCHEMA),
        "env": (lambda m: m.update(env=[]), "not an object", K.SCHEMA),
    }


@pytest.mark.parametrize("case", list(_mutations()))
def test_manifest_mutations_raise_bundle_error(bundle_path: Path, case: str) -> None:
    fn, match, kind = _mutations()[case]
    edit_manifest(bundle_path, fn)
    with pytest.raises(BundleError, match=match) as err:
        load_bundle(bundle_path)
    assert err.value.kind is kind


def test_offsets_past_end(bundle_path: Path) -> None:
    header, manifest, data = read_manifest(bundle_path)
    sha = next(k for k in header if k != "__metadata__")
    header[sha]["data_offsets"] = [len(data) - 8, len(data) + 1000]
    header[sha]["shape"] = [1008]
    write_manifest(bundle_path, header, manifest, data)
    with pytest.raises(BundleError, match="data section"):
        load_bundle(bundle_path)


def test_errors_are_kdump_errors_with_exit_code_2() -> None:
    assert issubclass(BundleError, KdumpError) and int(BundleError.exit_code) == 2


def test_save_rejects_unsupported_tensors(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not supported"):
        capture_call("m:f", [torch.zeros(3, dtype=torch.complex128)])
    with pytest.raises(BundleError, match="strided"):
        capture_call("m:f", [torch.eye(3).to_sparse()])


def test_duplicates_written_before_their_hash_is_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer overlaps hashing and writing: with slow hashes every blob is written
    speculatively and a duplicate must be overwritten by the next blob (no hole, no copy)."""
    import time

    from safetensors import safe_open

    import kdump.bundle.writer as kb

    real = kb.blob_digests

    def slow(view: Any) -> tuple[str, str]:
        time.sleep(0.02)
        return real(view)

    monkeypatch.setattr(kb, "blob_digests", slow)
    w = rand((64, 256))
    xs = [rand((8, 256)) for _ in range(4)]
    calls = [capture_call("m:f", [w, x, w[1:]]) for x in xs]
    path = save_calls(tmp_path / "b.kdump", calls)
    _, manifest, data = read_manifest(path)
    unique = w.numel() * 4 + 4 * 8 * 256 * 4
    assert len(manifest["blobs"]) == 5 and sum(b["nbytes"] for b in manifest["blobs"].values())
    assert unique <= len(data) < unique + ALIGN_MOD  # one alignment gap at most
    b = load_bundle(path)
    b.verify()
    for call, x in zip(b.calls, xs):
        assert_exact(call.args[0], w)
        assert_exact(call.args[1], x)
        assert_exact(call.args[2], w[1:])
    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        assert len([k for k in names if not k.startswith(PAD_PREFIX)]) == 5


# ---------------------------------------------------------------------------------------------
# Format version 2, version 1 compatibility, strict types


DATA = Path(__file__).parent / "data"


def _sha(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(bits(t)).hexdigest()


def test_version_1_bundle_loads_bit_exactly(tmp_path: Path) -> None:
    """tests/data/v1_bundle.kdump was written by the version-1 writer: a strided view at a storage
    offset and a second argument sharing its storage, a tuple, and a recorded output."""
    expected = json.loads((DATA / "v1_bundle.expected.json").read_text())
    b = load_bundle(DATA / "v1_bundle.kdump")
    assert b.version == 1 and [s.source.value for s in b.calls[0].storages] == ["blob"] * 3
    b.verify()
    c = b.calls[0]
    assert c.tensor_names == ["a", "b[0]", "b[1]", "out"]
    mat = c.materialize("cpu")
    for t, exp in zip(mat.tensors, expected["tensors"], strict=True):
        assert (str(t.dtype), list(t.shape), list(t.stride())) == (
            f"torch.{exp['dtype']}",
            exp["shape"],
            exp["stride"],
        )
        assert t.storage_offset() == exp["storage_offset"] and _sha(t) == exp["sha256"]
    a, (shared, _), k, alpha = mat.args
    assert a.storage_offset() > 0 and (k, alpha) == (3, 1.5)
    assert a.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    outs = c.materialize_outputs("cpu")
    assert {str(i): _sha(t) for i, t in outs.items()} == expected["outputs"]
    # pack rewrites it in the current version with the same content
    packed = load_bundle(pack(DATA / "v1_bundle.kdump", tmp_path / "v2.kdump"))
    assert packed.version == FORMAT_VERSION
    again = packed.calls[0].materialize("cpu").tensors
    assert [_sha(t) for t in again] == [e["sha256"] for e in expected["tensors"]]


def test_writer_writes_version_2_sources_and_checksums(bundle_path: Path) -> None:
    _, manifest, _ = read_manifest(bundle_path)
    assert manifest["version"] == FORMAT_VERSION
    assert {s["source"] for s in manifest["calls"][0]["storages"]} == {"blob"}
    algo = fast_checksum()
    assert {b["checksum"] for b in manifest["blobs"].values()} == {algo.value}
    b = load_bundle(bundle_path)
    for sha, info in manifest["blobs"].items():
        if algo is Checksum.XXH3_128:  # the digest is the blob's xxh3-128, beside its name
            assert info["digest"] == blob_digests(b.blob_bytes(sha))[1]
            assert len(info["digest"]) == 32
        else:
            assert "digest" not in info


def _set_storage(m: dict, **kw: Any) -> None:
    m["calls"][0]["storages"][0].update(kw)


def _set_tensor(m: dict, **kw: Any) -> None:
    m["calls"][0]["tensors"][0].update(kw)


def _set_blob(m: dict, **kw: Any) -> None:
    for info in m["blobs"].values():
        info.update(kw)


STRICT = {
    "version true": (lambda m: m.update(version=True), K.UNSUPPORTED_VERSION),
    "version 2.0": (lambda m: m.update(version=2.0), K.UNSUPPORTED_VERSION),
    "index 0.0": (lambda m: m["calls"][0].update(index=0.0), K.SCHEMA),
    "index false": (lambda m: m["calls"][0].update(index=False), K.SCHEMA),
    "shape [true]": (lambda m: _set_tensor(m, shape=[True, 14]), K.SCHEMA),
    "data_ptr 1.5": (lambda m: _set_tensor(m, data_ptr=1.5), K.SCHEMA),
    "storage_offset 2.0": (lambda m: _set_tensor(m, storage_offset=2.0), K.SCHEMA),
    "requires_grad 1": (lambda m: _set_tensor(m, requires_grad=1), K.SCHEMA),
    "storage true": (lambda m: _set_tensor(m, storage=True), K.SCHEMA),
    "dtype 5": (lambda m: _set_tensor(m, dtype=5), K.SCHEMA),
    "span_start true": (lambda m: _set_storage(m, span_start=True), K.SCHEMA),
    "base_ptr 1e3": (lambda m: _set_storage(m, base_ptr=1e3), K.SCHEMA),
    "device 0": (lambda m: _set_storage(m, device=0), K.SCHEMA),
    "nbytes true": (lambda m: _set_blob(m, nbytes=True), K.SCHEMA),
    "names [1]": (lambda m: m["calls"][0].update(names=[1]), K.SCHEMA),
    "target 5": (lambda m: m["calls"][0].update(target=5), K.SCHEMA),
    "writer 1": (lambda m: m.update(writer=1), K.SCHEMA),
    "inplace [[0.0, 0]]": (
        lambda m: m["calls"][0].update(
            outputs={"storages": [], "tensors": [], "inplace": [[0.0, 0]], "returned": None}
        ),
        K.SCHEMA,
    ),
    "unknown source": (lambda m: _set_storage(m, source="compressed"), K.UNKNOWN_SOURCE),
    "v2 with missing": (
        lambda m: (m.update(version=2), _set_storage(m, source="missing", blob="")),
        K.UNKNOWN_SOURCE,
    ),
    "source list": (lambda m: _set_storage(m, source=["blob"]), K.UNKNOWN_SOURCE),
    "unknown checksum": (lambda m: _set_blob(m, checksum="md5"), K.SCHEMA),
    "checksum list": (lambda m: _set_blob(m, checksum=["sha256"]), K.SCHEMA),
    "where list": (lambda m: _set_blob(m, where=["inline"]), K.SCHEMA),
    "blob extra field": (lambda m: _set_blob(m, color="red"), K.SCHEMA),
    "v1 with a source": (lambda m: m.update(version=1), K.SCHEMA),
}


@pytest.mark.parametrize("case", list(STRICT))
def test_manifest_types_are_strict(bundle_path: Path, case: str) -> None:
    fn, kind = STRICT[case]
    edit_manifest(bundle_path, fn)
    with pytest.raises(BundleError) as err:
        load_bundle(bundle_path)
    assert err.value.kind is kind
    assert "\n" not in str(err.value) and str(bundle_path) in str(err.value)


def test_unknown_source_message_says_what_to_do(bundle_path: Path) -> None:
    edit_manifest(bundle_path, lambda m: _set_storage(m, source="compressed"))
    with pytest.raises(BundleError, match=r"source 'compressed', unknown .* upgrade kdump-gpu"):
        load_bundle(bundle_path)


def test_version_1_without_source_still_loads(bundle_path: Path) -> None:
    def to_v1(m: dict) -> None:
        m["version"] = 1
        for c in m["calls"]:
            for st in c["storages"]:
                del st["source"]
        for info in m["blobs"].values():
            del info["checksum"]
            info.pop("digest", None)

    x = load_bundle(bundle_path).calls[0].args[1]
    edit_manifest(bundle_path, to_v1)
    b = load_bundle(bundle_path)
    assert b.version == 1
    assert_exact(b.calls[0].args[1], x)


def test_error_kinds_of_checksum_and_missing_store(tmp_path: Path) -> None:
    x = rand((64,))
    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", [x])])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x41
    path.write_bytes(bytes(raw))
    with pytest.raises(BundleError) as err:
        load_bundle(path).verify()
    assert err.value.kind is K.CHECKSUM
    capdir = tmp_path / "cap"
    stored = save_calls(
        capdir / "p" / "s.kdump", [capture_call("m:f", [x])], store=BlobStore(capdir)
    )
    moved = shutil.copy(stored, tmp_path / "alone.kdump")
    with pytest.raises(BundleError) as err:
        load_bundle(moved).calls[0].materialize("cpu")
    assert err.value.kind is K.MISSING_BLOB
    assert BundleError("x").kind is K.INVALID


def test_reading_a_manifest_does_not_import_torch(bundle_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from kdump.bundle import load_bundle\n"
        "from kdump.bundle.inspect import describe_bundle\n"
        f"rep = describe_bundle(load_bundle({str(bundle_path)!r}))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(json.dumps([t['name'] for t in rep['calls'][0]['tensors']]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["args[0]", "args[1]"]


def _json_keys(node: Any, path: str = "") -> set[str]:
    """Every key path of a manifest; blob digests and list positions are folded into '*'."""
    keys: set[str] = set()
    if isinstance(node, dict):
        for k, v in node.items():
            name = "*" if path.endswith("blobs") else k
            keys.add(f"{path}.{name}")
            keys |= _json_keys(v, f"{path}.{name}")
    elif isinstance(node, list):
        for v in node:
            keys |= _json_keys(v, f"{path}[]")
    return keys


def test_format_doc_example_matches_the_writer(tmp_path: Path) -> None:
    doc = (Path(__file__).parent.parent / "docs" / "FORMAT.md").read_text()
    section = doc[doc.index("### 4.1 Example") :]
    example = json.loads(section[section.index("```json") + 7 : section.index("```\n", 10)])
    x, d = rand((4, 8)), rand((4, 4))
    args, kwargs = [x[1:], x], {"d": d}
    rec = capture_call("m:f", args, kwargs, names=["a", "b"], meta={"rank": 0})
    attach_outputs(rec, input_tensors(rec, args, kwargs), [2])
    path = save_calls(tmp_path / "b.kdump", [rec], env={"host": "h"}, info={"mode": "sync"})
    _, written, _ = read_manifest(path)
    # `digest` is written only with the xxh3-128 check (the xxhash module installed).
    optional = {".blobs.*.digest"}
    assert _json_keys(example) - optional == _json_keys(written) - optional
    assert example["version"] == written["version"] == kdump.bundle.FORMAT_VERSION
    c = load_bundle(path).calls[0]
    assert [t.storage_offset for t in c.tensors] == [
        t["storage_offset"] for t in example["calls"][0]["tensors"]
    ]


def test_iter_bundles_skips_only_stores_under_a_capture_root(tmp_path: Path) -> None:
    from kdump.bundle import iter_bundles

    rec = capture_call("m:f", [rand((4,))])
    root = tmp_path / "blobs" / "runs"  # a user folder that happens to be called blobs
    wanted = [
        save_calls(root / "a.kdump", [rec]),
        save_calls(root / "proc" / "b.kdump", [rec]),
        save_calls(root / "deeper" / "blobs" / "c.kdump", [rec]),  # not under a capture root
    ]
    (root / "proc" / "index.json").write_text("{}")
    save_calls(root / "blobs" / "ab" / "x.kdump", [rec])  # the root's store
    save_calls(root / "proc" / "blobs" / "cd" / "y.kdump", [rec])  # a process folder's store
    assert list(iter_bundles([root])) == sorted(wanted)
    # given directly, a store folder is an ordinary folder (the root whose store it is is not)
    assert list(iter_bundles([root / "blobs"])) == [root / "blobs" / "ab" / "x.kdump"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="holds no") as err:
        list(iter_bundles([tmp_path / "empty"]))
    assert err.value.kind is K.NOT_FOUND


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    from kdump.bundle import atomic_write

    target = tmp_path / "sub" / "f.bin"
    payload = bytes(rand((64,), torch.uint8).tolist())
    assert atomic_write(target, payload) == target and target.read_bytes() == payload

    def broken(f: Any) -> None:
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_bytes() == payload
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.bin"]
    atomic_write(target, lambda f: f.write(payload[::-1]))
    assert target.read_bytes() == payload[::-1]


def test_bundle_error_kind_survives_pickling() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(BundleError("bad blob: re-record", K.CHECKSUM)))
    assert (type(err), str(err), err.kind) == (BundleError, "bad blob: re-record", K.CHECKSUM)
