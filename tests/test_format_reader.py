"""An independent reader written from docs/FORMAT.md alone (struct + json + hashlib + torch).

It must not import kdump.bundle or kdump.format: it proves the document is enough to read a
bundle. Only the writing side of the test uses kdump.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

try:  # the xxh3-128 check (§9.1); without the module the reader checks the SHA-256 name
    import xxhash
except ImportError:
    xxhash = None

# ---------------------------------------------------------------------------------------------
# The reader (FORMAT.md §2–§8)

MAX_HEADER = 100_000_000


class FormatError(Exception):
    pass


def read_container(path: Path) -> tuple[dict[str, Any], bytes, dict[str, Any]]:
    raw = path.read_bytes()
    if len(raw) < 8:
        raise FormatError("short file")
    (n,) = struct.unpack("<Q", raw[:8])
    if n == 0 or n > MAX_HEADER or n > len(raw) - 8:
        raise FormatError("bad header length")
    header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    data = raw[8 + n :]
    manifest = json.loads(header["__metadata__"]["kdump.manifest"])
    if manifest["format"] != "kdump" or manifest["version"] not in (1, 2, 3, 4, 5, 6):
        raise FormatError("not a kdump v1 to v6 manifest")
    return header, data, manifest


def read_blob(path: Path, header: dict[str, Any], data: bytes, manifest: dict, sha: str) -> bytes:
    info = manifest["blobs"][sha]
    algo = info.get("checksum", "sha256")
    if algo not in ("sha256", "xxh3-128"):  # §3: the algorithms defined
        raise FormatError("unknown checksum algorithm")
    if info["nbytes"] == 0:
        out = b""
    elif info["where"] == "inline":
        entry = header[sha]
        assert entry["dtype"] == "U8"
        b, e = entry["data_offsets"]
        assert 0 <= b <= e <= len(data) and e - b == entry["shape"][0] == info["nbytes"]
        out = data[b:e]
    else:
        folder = path.resolve().parent
        for cand in [folder, *list(folder.parents)[:3]]:
            if (cand / "blobs").is_dir():
                out = (cand / "blobs" / sha[:2] / sha).read_bytes()
                break
        else:
            raise FormatError("store not found")
    if algo == "xxh3-128" and xxhash is not None:
        if xxhash.xxh3_128_hexdigest(out) != info["digest"]:
            raise FormatError("checksum")
    elif hashlib.sha256(out).hexdigest() != sha:  # §9.1: the name checks any blob
        raise FormatError("checksum")
    return out


def extent(shape: list[int], stride: list[int], offset: int, itemsize: int) -> tuple[int, int]:
    if any(n == 0 for n in shape):
        return offset * itemsize, offset * itemsize
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
    return offset * itemsize, (last + 1) * itemsize


def decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if isinstance(node, list):
        return [decode(v, tensors) for v in node]
    if "$tensor" in node:
        return tensors[node["$tensor"]]
    if "$float" in node:
        return float(node["$float"])
    if "$tuple" in node:
        return tuple(decode(v, tensors) for v in node["$tuple"])
    if "$dict" in node:
        return {decode(k, tensors): decode(v, tensors) for k, v in node["$dict"]}
    if "$dtype" in node:
        return getattr(torch, node["$dtype"])
    if "$device" in node:
        return torch.device(node["$device"])
    if "$enum" in node:
        return ("enum", node["$enum"], node["name"])
    return ("opaque", node["$opaque"])


# §5.2.1: generator "splitmix64-ih4" version 1, element by element in plain Python.
M64 = (1 << 64) - 1
_FLOAT_FORMATS = {  # exponent bits, mantissa bits, bias, max finite
    "float16": (5, 10, 15, 65504.0),
    "bfloat16": (8, 7, 127, 3.3895313892515355e38),
    "float8_e4m3fn": (4, 3, 7, 448.0),
    "float8_e5m2": (5, 2, 15, 57344.0),
}
_INT_FORMATS = {  # struct code, low, high
    "int8": ("b", -128, 127),
    "int16": ("h", -32768, 32767),
    "int32": ("i", -(2**31), 2**31 - 1),
    "int64": ("q", -(2**63), 2**63 - 1024),
    "uint8": ("B", 0, 255),
    "uint16": ("H", 0, 65535),
    "uint32": ("I", 0, 2**32 - 1),
    "uint64": ("Q", 0, 2**64 - 2048),
}


def _splitmix(seed: int, i: int) -> int:
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _small_float(v: float, exp_bits: int, man_bits: int, bias: int) -> int:
    sign = 1 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a == 0:
        return sign << (exp_bits + man_bits)
    e = math.frexp(a)[1] - 1  # floor(log2 a)
    biased = max(e + bias, 1)
    q = round(math.ldexp(a, man_bits - (biased - bias)))  # Python rounds half to even
    return ((biased - 1) << man_bits) + q | sign << (exp_bits + man_bits)


def _encode(v: float, dtype: str) -> bytes:
    if dtype in _FLOAT_FORMATS:
        e, m, bias, top = _FLOAT_FORMATS[dtype]
        bits = _small_float(min(max(v, -top), top), e, m, bias)
        return bits.to_bytes((1 + e + m) // 8, "little")
    if dtype in _INT_FORMATS:
        code, lo, hi = _INT_FORMATS[dtype]
        return struct.pack("<" + code, int(min(max(round(v), lo), hi)))
    if dtype == "float32":
        return struct.pack("<f", min(max(v, -3.4028234663852886e38), 3.4028234663852886e38))
    if dtype == "float64":
        return struct.pack("<d", v)
    if dtype == "float8_e8m0fnu":
        return bytes([math.frexp(min(max(v, 2.0**-127), 2.0**127))[1] - 1 + 127])
    if dtype == "bool":
        return b"\x01" if v >= 0.5 else b"\x00"
    raise FormatError("the generator does not produce this dtype")


def synthetic_bytes(st: dict[str, Any]) -> bytes:
    gen, stats = st["generator"], st["stats"]
    if (gen["name"], gen["version"]) != ("splitmix64-ih4", 1):
        raise FormatError("unknown generator")
    size = getattr(torch, stats["dtype"]).itemsize
    out = bytearray()
    i = 0
    while len(out) < st["span_nbytes"]:
        w = _splitmix(gen["seed"], i)
        s = sum((w >> (16 * k)) & 0xFFFF for k in range(4))
        x = ((s + 2) / 65536 - 2) * 1.7320508075688772
        v = min(max(stats["mean"] + stats["std"] * x, stats["min"]), stats["max"])
        out += _encode(v, stats["dtype"])
        i += 1
    assert size
    return bytes(out[: st["span_nbytes"]])


def span_bytes(path: Path, header: dict, data: bytes, manifest: dict, st: dict) -> bytes:
    """§5.2: the span's bytes for the kinds this reader knows."""
    source = st.get("source", "blob")  # §5.2: no source means a blob
    if source == "blob":
        blob = read_blob(path, header, data, manifest, st["blob"])
        assert len(blob) == st["span_nbytes"]
        return blob
    if source == "sparse" and manifest["version"] >= 4:
        held = read_blob(path, header, data, manifest, st["blob"])
        out = bytearray(st["span_nbytes"])
        pos, end = 0, 0
        for b, e in st["ranges"]:
            assert end <= b < e <= st["span_nbytes"]
            out[b:e] = held[pos : pos + e - b]
            pos, end = pos + e - b, e
        assert pos == len(held)
        return bytes(out)
    if source == "synthetic" and manifest["version"] >= 4:
        return synthetic_bytes(st)
    if source == "pieces" and manifest["version"] >= 5:
        if st["blob"] != "" or len(st["pieces"]) < 2:
            raise FormatError("malformed pieces")
        parts = []
        for sha, n in st["pieces"]:
            piece = read_blob(path, header, data, manifest, sha)
            if n <= 0 or len(piece) != n:
                raise FormatError("piece size")
            parts.append(piece)
        out = b"".join(parts)
        if len(out) != st["span_nbytes"]:
            raise FormatError("pieces do not add up to the span")
        return out
    raise FormatError("unknown storage source")


def read_call(path: Path, index: int) -> tuple[list[Any], dict[str, Any], list[torch.Tensor]]:
    """Positional args, kwargs and the tensor table of call `index`."""
    header, data, manifest = read_container(path)
    call = manifest["calls"][index]
    assert call["index"] == index
    buffers = []
    for st in call["storages"]:
        # Re-create the storage from its original start: unrecorded prefix, then the span.
        blob = span_bytes(path, header, data, manifest, st)
        buf = bytearray(st["span_start"]) + bytearray(blob)
        buffers.append((st, torch.frombuffer(buf, dtype=torch.uint8) if buf else None))
    tensors = []
    for rec in call["tensors"]:
        st, buf = buffers[rec["storage"]]
        dtype = getattr(torch, rec["dtype"])
        lo, hi = extent(rec["shape"], rec["stride"], rec["storage_offset"], dtype.itemsize)
        if hi > lo:
            assert st["span_start"] <= lo and hi <= st["span_start"] + st["span_nbytes"]
        view = torch.empty(0, dtype=dtype)
        if buf is not None:
            view.set_(buf.untyped_storage(), rec["storage_offset"], rec["shape"], rec["stride"])
        else:
            view = torch.empty(rec["shape"], dtype=dtype)
        tensors.append(view)
    args = [decode(a, tensors) for a in call["args"]]
    kwargs = {k: decode(v, tensors) for k, v in call["kwargs"].items()}
    return args, kwargs, tensors


# ---------------------------------------------------------------------------------------------
# Tests (the writer is kdump)


def _bits(t: torch.Tensor) -> bytes:
    """Bytes of the logical values (bitwise, so NaN and fp8 compare exactly)."""
    c = t.detach().contiguous()
    return c.view(torch.uint8).numpy().tobytes() if c.numel() else b""


def _sample_args() -> tuple[list[Any], dict[str, Any], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 48, generator=g)
    m, kb = 30, 3
    scale = torch.empty_strided((m, kb), (1, 32), dtype=torch.float32)
    scale.copy_(torch.rand(m, kb, generator=g) + 0.5)
    a8 = (torch.randn(m, 256, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    labels = torch.randint(-1, 8, (m,), dtype=torch.int32, generator=g)
    bf = torch.randn(4, 6, generator=g).to(torch.bfloat16)
    tensors = [base[3:40:2, 5:], base.t(), a8, scale, labels, bf.expand(3, 4, 6), bf[1]]
    args = [(a8, scale), base[3:40:2, 5:], labels, 1.5, torch.bfloat16]
    kwargs = {"d": base.t(), "b": (bf.expand(3, 4, 6), bf[1]), "n": 3}
    return args, kwargs, tensors


def test_independent_reader_reconstructs_every_tensor(tmp_path: Path) -> None:
    from kdump import capture_call, save_calls

    args, kwargs, _ = _sample_args()
    rec = capture_call("pkg.mod:fn", args, kwargs, names=["a", "x", "labels", "alpha", "dt"])
    path = save_calls(tmp_path / "b.kdump", [rec, rec])

    from kdump.bundle import input_tensors

    originals = input_tensors(rec, args, kwargs)
    for index in (0, 1):
        got_args, got_kwargs, got = read_call(path, index)
        assert len(got) == len(originals)
        for o, t in zip(originals, got):
            assert t.dtype == o.dtype
            assert t.shape == o.shape
            assert t.stride() == o.stride()
            assert t.storage_offset() == o.storage_offset()
            assert _bits(t) == _bits(o)
        assert got_args[3] == 1.5 and got_args[4] is torch.bfloat16
        assert got_kwargs["n"] == 3
        # aliasing: x and d are views of one storage, so writing through one shows in the other
        got_args[1][0, 0] = 1234.0
        assert got_kwargs["d"][5, 3] == 1234.0


def test_independent_reader_store_bundle(tmp_path: Path) -> None:
    from kdump import capture_call, save_calls
    from kdump.bundle import BlobStore

    t = torch.arange(1, 1001, dtype=torch.int64).reshape(10, 100)[:, 7:90]
    rec = capture_call("m:f", [t], {})
    capdir = tmp_path / "cap"
    path = save_calls(capdir / "rank0" / "c.kdump", [rec], store=BlobStore(capdir))
    _, _, got = read_call(path, 0)
    assert torch.equal(got[0], t) and got[0].stride() == t.stride()


def test_independent_reader_detects_corruption(tmp_path: Path) -> None:
    from kdump import capture_call, save_calls

    rec = capture_call("m:f", [torch.randn(100)], {})
    path = save_calls(tmp_path / "b.kdump", [rec])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="checksum"):
        read_call(path, 0)


def test_safetensors_opens_the_bundle(tmp_path: Path) -> None:
    from safetensors import safe_open

    from kdump import capture_call, save_calls

    args, kwargs, _ = _sample_args()
    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", args, kwargs)])
    header, _, manifest = read_container(path)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        assert keys == {k for k in header if k != "__metadata__"}
        assert "kdump.manifest" in f.metadata()
        for sha in keys - {k for k in keys if k.startswith("kdump.pad.")}:  # §2: padding
            t = f.get_tensor(sha)
            assert t.dtype == torch.uint8 and t.dim() == 1
            assert hashlib.sha256(t.numpy().tobytes()).hexdigest() == sha
            assert manifest["blobs"][sha]["nbytes"] == t.numel()


DATA = Path(__file__).parent / "data"


def test_independent_reader_reads_version_1(tmp_path: Path) -> None:
    """A bundle written by the version-1 writer (tests/data) still reads bit for bit."""
    expected = json.loads((DATA / "v1_bundle.expected.json").read_text())
    _, _, manifest = read_container(DATA / "v1_bundle.kdump")
    assert manifest["version"] == expected["version"] == 1
    _, _, got = read_call(DATA / "v1_bundle.kdump", 0)
    assert len(got) == len(expected["tensors"]) == 4
    for t, exp in zip(got, expected["tensors"]):
        assert str(t.dtype) == f"torch.{exp['dtype']}"
        assert (list(t.shape), list(t.stride())) == (exp["shape"], exp["stride"])
        assert t.storage_offset() == exp["storage_offset"]
        assert hashlib.sha256(_bits(t)).hexdigest() == exp["sha256"]
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()


def test_independent_reader_rejects_unknown_source(tmp_path: Path) -> None:
    from kdump import capture_call, save_calls

    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", [torch.randn(9)], {})])
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    manifest = json.loads(header["__metadata__"]["kdump.manifest"])
    assert manifest["version"] == 6 and manifest["calls"][0]["storages"][0]["source"] == "blob"
    manifest["calls"][0]["storages"][0]["source"] = "compressed"
    header["__metadata__"]["kdump.manifest"] = json.dumps(manifest)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(FormatError, match="unknown storage source"):
        read_call(path, 0)


def _rewrite_manifest(path: Path, edit: Any) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    manifest = json.loads(header["__metadata__"]["kdump.manifest"])
    edit(manifest)
    header["__metadata__"]["kdump.manifest"] = json.dumps(manifest)
    text = json.dumps(header).encode()
    text += b" " * (n - len(text)) if len(text) <= n else b""
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


@pytest.mark.parametrize("algo", ["sha256", "xxh3-128"])
def test_independent_reader_reads_each_checksum_algorithm(tmp_path: Path, algo: str) -> None:
    """Version-2 bundles of either check (earlier 2.0 ones say sha256 and carry no digest)."""
    from kdump import capture_call, save_calls
    from kdump.bundle import load_bundle

    if algo == "xxh3-128" and xxhash is None:
        pytest.skip("xxhash is not installed: the xxh3-128 check cannot be computed here")
    t = torch.randn(300, 70)[5:, 3:]
    path = save_calls(tmp_path / "b.kdump", [capture_call("m:f", [t], {})])

    def set_algo(m: dict) -> None:
        for sha, info in m["blobs"].items():
            info["checksum"] = algo
            info.pop("digest", None)
            if algo == "xxh3-128":
                data = load_bundle(path, verify=False).blob_bytes(sha)
                info["digest"] = xxhash.xxh3_128_hexdigest(data)

    _rewrite_manifest(path, set_algo)
    _, _, manifest = read_container(path)
    assert {b["checksum"] for b in manifest["blobs"].values()} == {algo}
    _, _, got = read_call(path, 0)
    assert torch.equal(got[0], t) and got[0].storage_offset() == t.storage_offset()
    assert torch.equal(load_bundle(path).calls[0].args[0], t)
    if algo == "xxh3-128":  # a wrong digest is caught by both readers
        _rewrite_manifest(path, lambda m: [i.update(digest="0" * 32) for i in m["blobs"].values()])
        with pytest.raises(FormatError, match="checksum"):
            read_call(path, 0)
        from kdump.errors import BundleError

        with pytest.raises(BundleError, match="checksum mismatch"):
            load_bundle(path).calls[0].materialize()


def test_independent_reader_reads_sparse_and_synthetic(tmp_path: Path) -> None:
    """Version 4's kinds, read from the document alone, give the bytes kdump's reader gives."""
    from dataclasses import replace

    from kdump import capture_call
    from kdump.bundle import load_bundle
    from kdump.bundle.manifest import call_entries
    from kdump.bundle.store import sha256_hex
    from kdump.bundle.writer import save_entries
    from kdump.format.records import GeneratorRecord, Source, Stats

    tensors = [
        torch.randn(64, 16),
        torch.randn(40, 8).to(torch.bfloat16),
        torch.randn(300).to(torch.float8_e4m3fn),
        torch.arange(50, dtype=torch.int32),
    ]
    rec = capture_call("m:f", tensors, {})
    [entry] = call_entries([rec], ["0" * 64] * len(rec.inputs.storages))
    data = bytes(rec.inputs.data[0].numpy())
    ranges = ((0, 128), (1024, 2048), (4000, 4096))
    held = b"".join(data[b:e] for b, e in ranges)
    storages = [
        replace(entry.storages[0], source=Source.SPARSE, blob=sha256_hex(held), ranges=ranges)
    ]
    for j, dtype in ((1, "bfloat16"), (2, "float8_e4m3fn"), (3, "int32")):
        stats = Stats(dtype, -3.0, 3.0, 0.25, 1.5) if dtype != "int32" else Stats(dtype, 0, 9, 4, 3)
        gen = GeneratorRecord("splitmix64-ih4", 1, 1000 + j)
        storages.append(
            replace(entry.storages[j], source=Source.SYNTHETIC, blob="", stats=stats, generator=gen)
        )
    path = save_entries(
        tmp_path / "v4.kdump", [replace(entry, storages=tuple(storages))], {storages[0].blob: held}
    )
    _, _, got = read_call(path, 0)
    ours = load_bundle(path).calls[0].materialize("cpu").tensors
    for a, b in zip(got, ours):
        assert _bits(a) == _bits(b)
    assert _bits(got[0])[:128] == data[:128] and set(_bits(got[0])[128:1024]) == {0}


@pytest.mark.parametrize("stored", [False, True])
def test_independent_reader_reads_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: bool
) -> None:
    """§5.2 "pieces": a storage larger than the piece size is its pieces' blobs, in order."""
    from kdump import capture_call, save_calls
    from kdump.bundle import BlobStore

    monkeypatch.setenv("KDUMP_PIECE_BYTES", "1M")
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 * 1024 * 1024 // 4 + 999, generator=g)  # 3 pieces and a short one
    rec = capture_call("m:f", [big[5:], torch.arange(10)], {})
    capdir = tmp_path / "cap"
    kw = {"store": BlobStore(capdir)} if stored else {}
    path = save_calls(capdir / "c.kdump", [rec], **kw)
    _, _, manifest = read_container(path)
    st = manifest["calls"][0]["storages"][0]
    assert st["source"] == "pieces" and st["blob"] == ""
    assert [n for _, n in st["pieces"]] == [1 << 20] * 3 + [(big.numel() - 5) * 4 - (3 << 20)]
    _, _, got = read_call(path, 0)
    assert _bits(got[0]) == _bits(big[5:]) and got[0].storage_offset() == 5
    assert torch.equal(got[1], torch.arange(10))
