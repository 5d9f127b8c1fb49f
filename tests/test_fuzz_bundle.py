"""Untrusted bundles: a fuzz campaign over mutated real bundles, and one named regression case
for every class of finding the campaign is there to keep out.

The campaign (`test_campaign`) mutates the sample captures and freshly written bundles (shared
storages, views at offsets, nested argument trees, several calls, a shared blob store) with byte
flips, truncations, JSON field mutations and store/blob cases, and runs each case in long-lived
worker processes under an address-space limit and a per-case alarm (tests/fuzz/). Every case must
end in a typed kdump error (exit 2, one line) or a correct load, and `kdump info --verify` must
exit 0 or 2 without a traceback or a raw ESC byte. A failing case is rebuilt in a folder named in
the assertion message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fuzz.mutate import BUNDLE_NAME, Case, build, campaign, join, split
from fuzz.pool import run_campaign

from kdump.bundle import (
    BlobStore,
    attach_outputs,
    capture_call,
    input_tensors,
    load_bundle,
    save_calls,
)
from kdump.errors import BundleError, BundleErrorKind
from kdump.format.records import PREFIX_LIMIT, Limits, StorageRecord
from kdump.format.validate import load_bytes

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = sorted((ROOT / "captures").glob("*.kdump"))
FUZZ_LOAD_BYTES = 512 << 20  # the workers' load cap (their address space is +2 GiB)
PER_KIND = 160  # 16 kinds × 160, store variants, store cases and specials: 3,364 cases


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu")


def _rich_calls() -> list[Any]:
    """Calls with shared storages, views at offsets, a blob shared by two storages, nested
    argument trees and recorded outputs."""
    base = _rand(8, 16, seed=1)
    twin_a = _rand(32, seed=2)
    twin_b = twin_a.clone()  # a different storage with the same bytes: one blob, two storages
    q = (_rand(64, seed=3) * 30).to(torch.float8_e4m3fn)
    sc = torch.empty_strided((6, 2), (1, 8), dtype=torch.float32, device="cpu")
    sc.copy_(_rand(6, 2, seed=4).abs() + 1)
    labels = torch.randint(
        -1, 3, (6,), dtype=torch.int32, generator=torch.Generator().manual_seed(5)
    )
    args = [
        (q[:48].view(6, 8), sc),
        base[1:, ::3],
        {"nested": [base[2:4, 4:], {"deeper": (labels, 3, 0.5)}], "twin": twin_a},
        twin_b[4:],
    ]
    kwargs = {"d": base.t(), "dt": torch.bfloat16, "e": torch.empty(0, 3), "s": torch.tensor(2.0)}
    rec = capture_call("m:f", args, kwargs, names=["a", "x", "tree", "twin_view"])
    live = input_tensors(rec, args, kwargs)
    base.add_(1.0)
    attach_outputs(rec, live, [1])
    small = capture_call("m:g", [torch.arange(1, 9, dtype=torch.int64).view(2, 4).t()], {})
    return [rec, small, capture_call("m:h", [_rand(4, 4, seed=6)[1:, 1:]], {"k": "v"})]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fuzzbases")
    for p in CAPTURES:
        (folder / p.name).symlink_to(p)
    calls = _rich_calls()
    save_calls(folder / "rich.kdump", calls)
    save_calls(folder / "single.kdump", calls[1:2])
    store = folder / "store_rich"
    save_calls(store / BUNDLE_NAME, calls, store=BlobStore(store))
    _slim_base(folder / "slim.kdump")
    _pieces_base(folder / "pieces.kdump")
    return folder


def _slim_base(path: Path) -> Path:
    """A version-4 bundle with a sparse storage and synthetic ones (what `kdump slim` writes)."""
    from kdump.bundle.manifest import call_entries
    from kdump.bundle.store import sha256_hex
    from kdump.bundle.writer import save_entries
    from kdump.format.records import GeneratorRecord, Source, Stats

    rec = capture_call("m:f", [_rand(64, 16, seed=7), _rand(40, 8, seed=8).half()], {})
    [entry] = call_entries([rec], ["0" * 64] * len(rec.inputs.storages))
    data = bytes(rec.inputs.data[0].numpy())
    ranges = ((0, 128), (1024, 2048))
    held = b"".join(data[b:e] for b, e in ranges)
    sparse = replace(entry.storages[0], source=Source.SPARSE, blob=sha256_hex(held), ranges=ranges)
    synth = replace(
        entry.storages[1],
        source=Source.SYNTHETIC,
        blob="",
        stats=Stats("float16", -2.0, 2.0, 0.0, 1.0),
        generator=GeneratorRecord("splitmix64-ih4", 1, 5),
    )
    return save_entries(path, [replace(entry, storages=(sparse, synth))], {sparse.blob: held})


PIECE = 1000  # the pieces of the fuzz base are small: the format sets no least piece size


def _pieces_base(path: Path) -> Path:
    """A version-5 bundle whose first storage is 3 pieces and a short one (the first and third
    equal: one blob), and whose outputs share those pieces (what the writer makes of a storage
    larger than the piece size)."""
    from kdump.bundle.manifest import call_entries
    from kdump.bundle.store import sha256_hex
    from kdump.bundle.writer import save_entries

    x = _rand(3 * PIECE // 4 + 50, seed=9)
    x[3 + PIECE // 2 : 3 + 3 * PIECE // 4] = x[3 : 3 + PIECE // 4]  # piece 2 repeats piece 0
    rec = capture_call("m:f", [x[3:], torch.arange(12)], {})
    live = input_tensors(rec, [x[3:], torch.arange(12)], {})
    attach_outputs(rec, live, [0])
    raw = bytes(rec.inputs.data[0].numpy())
    parts = [raw[lo : lo + PIECE] for lo in range(0, len(raw), PIECE)]
    pieces = tuple((sha256_hex(p), len(p)) for p in parts)
    small = sha256_hex(bytes(rec.inputs.data[1].numpy()))
    [entry] = call_entries([rec], [pieces, small, pieces])
    data = {sha256_hex(p): p for p in parts}
    data[small] = bytes(rec.inputs.data[1].numpy())
    return save_entries(path, [entry], data)


def _file_bases(bases: Path) -> list[str]:
    return [
        "rich.kdump",
        "single.kdump",
        "slim.kdump",
        "pieces.kdump",
        *[p.name for p in CAPTURES],
        "rich.kdump",
    ]


def test_campaign(bases: Path, tmp_path: Path) -> None:
    cases = campaign(_file_bases(bases), ["store_rich"], PER_KIND)
    assert len(cases) >= 3000
    env = {**os.environ, "KDUMP_MAX_LOAD_BYTES": str(FUZZ_LOAD_BYTES)}
    endings, findings = run_campaign(cases, bases, tmp_path / "failures", workers=2, env=env)
    by_why: dict[str, list[str]] = {}
    for f in findings:
        by_why.setdefault(f.why[:160], []).append(f"{f.case.name} (rebuilt in {f.saved})")
    shown = "; ".join(f"{why}: {len(c)} cases, e.g. {c[0]}" for why, c in by_why.items())
    assert not findings, f"{len(findings)} of {len(cases)} fuzz cases failed: {shown}"
    assert sum(endings.values()) == len(cases)
    # The campaign exercises both endings, not only rejections.
    assert endings.get("ok", 0) >= 50, endings
    assert sum(n for k, n in endings.items() if k.startswith("load: ")) >= 1000, endings


def test_console_script_sample(bases: Path, tmp_path: Path) -> None:
    """A sample of cases through the real console script, `python -m kdump info --verify`."""
    cases = campaign(_file_bases(bases), ["store_rich"], 2)[::3][:20]
    assert len(cases) == 20
    env = {**os.environ, "KDUMP_MAX_LOAD_BYTES": str(FUZZ_LOAD_BYTES)}
    codes = set()
    for case in cases:
        path = build(case, bases, tmp_path / case.name)
        proc = subprocess.run(
            [sys.executable, "-m", "kdump", "info", "--verify", str(path)],
            capture_output=True,
            timeout=120,
            env=env,
        )
        out = proc.stdout + proc.stderr
        where = f"case {case.name} (rebuilt in {tmp_path / case.name})"
        assert proc.returncode in (0, 2), f"{where}: exit {proc.returncode}: {out[-400:]!r}"
        assert b"Traceback" not in out and b"\x1b" not in out, where
        if proc.returncode == 2:
            assert proc.stderr.decode().count("\n") == 1, where
        codes.add(proc.returncode)
    assert codes == {0, 2}


SCRIPT_LAUNCHER = """\
import runpy, sys
sys.modules["kdump"] = None  # the repro script runs without kdump
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""
SCRIPT_AS_LIMIT = 8 << 30  # address space of the script's process: torch plus the byte cap
SCRIPT_MAX_BYTES = 256 << 20


def _limit_script_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (SCRIPT_AS_LIMIT, SCRIPT_AS_LIMIT))


def test_repro_script_sample(bases: Path, tmp_path: Path) -> None:
    """The standalone repro script (`kdump report --script`) on a sample of the campaign, every
    target allowed so that mutated calls get as far as materialising: each case ends in a
    clean run, a difference or a one-line refusal, never a traceback, a hang or a raw ESC."""
    from kdump.report.script import render_script

    script = tmp_path / "repro.py"
    script.write_text(render_script("unused.kdump", ["*"]))
    launcher = tmp_path / "nokdump.py"
    launcher.write_text(SCRIPT_LAUNCHER)
    cases = campaign(_file_bases(bases), ["store_rich"], 3)[1::5][:24]
    endings: dict[int, int] = {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    for case in cases:
        path = build(case, bases, tmp_path / case.name)
        where = f"case {case.name} (rebuilt in {tmp_path / case.name})"
        argv = [str(path), "--device", "cpu", "--max-bytes", str(SCRIPT_MAX_BYTES)]
        proc = subprocess.run(
            [sys.executable, "-I", str(launcher), str(script), *argv],
            capture_output=True,
            timeout=120,
            env=env,
            preexec_fn=_limit_script_memory,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode in (0, 1, 2, 3), f"{where}: exit {proc.returncode}: {out[-400:]!r}"
        assert b"Traceback" not in out and b"\x1b" not in out, f"{where}: {out[-400:]!r}"
        assert proc.stderr.count(b"\n") <= 1, f"{where}: {proc.stderr[-400:]!r}"
        if proc.returncode == 2:
            assert proc.stderr.startswith(b"repro: refused: "), f"{where}: {out[-400:]!r}"
        endings[proc.returncode] = endings.get(proc.returncode, 0) + 1
    assert endings.get(2, 0) >= 5, endings


def test_unmutated_bases_load(bases: Path) -> None:
    names = ["rich.kdump", "single.kdump", "slim.kdump", "pieces.kdump"]
    for name in [*names, f"store_rich/{BUNDLE_NAME}"]:
        b = load_bundle(bases / name)
        b.verify()
        for call in b.calls:
            call.materialize("cpu")


# --------------------------------------------------------------------------------------------
# Named regression cases


def _edit_manifest(src: Path, dst: Path, fn: Any) -> Path:
    header, manifest, data = split(src.read_bytes())
    fn(manifest)
    dst.write_bytes(join(header, json.dumps(manifest), data))
    return dst


def _rejects(path: Path, kind: BundleErrorKind, limits: Limits | None = None) -> BundleError:
    with pytest.raises(BundleError) as info:
        load_bundle(path, limits)
    assert info.value.kind is kind, str(info.value)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        (
            "float for int: storage_offset",
            lambda m: m["calls"][0]["tensors"][0].update(storage_offset=0.0),
        ),
        (
            "float for int: span_nbytes",
            lambda m: m["calls"][0]["storages"][0].update(
                span_nbytes=1.0 * m["calls"][0]["storages"][0]["span_nbytes"]
            ),
        ),
        ("index: 0.0", lambda m: m["calls"][0].update(index=0.0)),
        ("shape: [true]", lambda m: m["calls"][0]["tensors"][0].update(shape=[True], stride=[1])),
        ("blob nbytes: true", lambda m: next(iter(m["blobs"].values())).update(nbytes=True)),
    ],
)
def test_mistyped_fields_are_schema_errors(
    bases: Path, tmp_path: Path, name: str, edit: Any
) -> None:
    path = _edit_manifest(bases / "rich.kdump", tmp_path / "m.kdump", edit)
    _rejects(path, BundleErrorKind.SCHEMA)


def test_version_true(bases: Path, tmp_path: Path) -> None:
    path = _edit_manifest(
        bases / "rich.kdump", tmp_path / "v.kdump", lambda m: m.update(version=True)
    )
    _rejects(path, BundleErrorKind.UNSUPPORTED_VERSION)


def test_stride0_huge_dims_are_a_limit(bases: Path, tmp_path: Path) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["calls"][0]["tensors"][0].update(shape=[1 << 20] * 16, stride=[0] * 16)

    err = _rejects(
        _edit_manifest(bases / "rich.kdump", tmp_path / "s.kdump", edit), BundleErrorKind.LIMIT
    )
    assert "load limit" in str(err)


def test_broadcast_view_within_the_limit_loads(tmp_path: Path) -> None:
    x = _rand(3, seed=7)
    view = x.expand(1000, 3)  # stride 0: more elements than the span holds
    save_calls(tmp_path / "b.kdump", [capture_call("m:f", [view], {})])
    (t,) = load_bundle(tmp_path / "b.kdump").calls[0].materialize("cpu").tensors
    assert t.stride() == (0, 1) and torch.equal(t, view)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _without_blocking(fn: Any) -> BaseException | None:
    """Run fn in a thread; fail (instead of hanging the suite) when it does not return in 5 s."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5)
    assert out, "opening a FIFO blocked"
    return out[0]


def test_fifo_bundle_does_not_block(tmp_path: Path) -> None:
    path = _fifo(tmp_path / "fifo.kdump")
    exc = _without_blocking(lambda: load_bundle(path))
    assert isinstance(exc, BundleError) and exc.kind is BundleErrorKind.NOT_FOUND
    assert "regular file" in str(exc)


def test_fifo_blob_does_not_block(bases: Path, tmp_path: Path) -> None:
    path = build(Case("store_rich", "blob_fifo", 0), bases, tmp_path / "c")
    b = load_bundle(path)
    exc = _without_blocking(b.verify)
    assert isinstance(exc, BundleError) and exc.kind is BundleErrorKind.MISSING_BLOB
    assert "regular file" in str(exc)


def test_long_string_renders_in_bounded_time(tmp_path: Path) -> None:
    text = "\x1b[31m" + "E" * 200_000 + "[/]"
    rec = capture_call("m:f" + "t" * 200_000, [_rand(4, seed=8)], {})
    rec.meta["exception"] = text
    path = save_calls(tmp_path / "long.kdump", [rec], env={"hostname": text, "libraries": [text]})
    from kdump.cli import cli

    for args in (["info", "--verify", str(path)], ["info", "--json", str(path)]):
        start = time.process_time()
        result = CliRunner().invoke(cli, args, standalone_mode=False)
        took = time.process_time() - start
        assert result.exception is None, repr(result.exception)
        assert took < 2.0, f"kdump {' '.join(args[:2])} took {took:.1f} s of CPU"
        assert "\x1b" not in result.output
        assert "more characters]" in result.output
        assert len(result.output) < 100_000


def _shared_blob_bundle(tmp_path: Path, copies: int) -> Path:
    """A bundle whose one call names one blob from `copies` storages (what a hostile edit of a
    small file does); the file stays small."""
    x = _rand(1 << 16, seed=9)  # 256 KiB
    path = save_calls(tmp_path / "one.kdump", [capture_call("m:f", [x], {})])

    def edit(m: dict[str, Any]) -> None:
        c = m["calls"][0]
        c["storages"] = c["storages"] * copies
        c["tensors"] = [dict(c["tensors"][0], storage=i) for i in range(copies)]
        c["args"] = [[{"$tensor": i} for i in range(copies)]]
        c["names"] = None

    return _edit_manifest(path, tmp_path / "shared.kdump", edit)


def test_shared_blob_allocation_is_bounded_before_allocating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KDUMP_MAX_LOAD_BYTES", "64G")  # restored after: the flag below sets it
    path = _shared_blob_bundle(tmp_path, 4000)  # ~1 GiB of buffers from a 256 KiB blob
    assert path.stat().st_size < 2 << 20
    err = _rejects(path, BundleErrorKind.LIMIT, replace(Limits(), max_load_bytes=256 << 20))
    assert "would allocate" in str(err)
    # The same records are refused when the cap comes from the environment, via the CLI flag.
    from kdump.cli import cli

    result = CliRunner().invoke(
        cli, ["info", "--max-load-bytes", "256M", str(path)], standalone_mode=False
    )
    assert isinstance(result.exception, BundleError)
    assert result.exception.kind is BundleErrorKind.LIMIT
    assert os.environ["KDUMP_MAX_LOAD_BYTES"] == str(256 << 20)


def test_legitimate_shared_blob_loads(tmp_path: Path) -> None:
    path = _shared_blob_bundle(tmp_path, 3)
    call = load_bundle(path).calls[0]
    assert len({s.blob for s in call.storages}) == 1
    tensors = call.materialize("cpu").tensors
    assert len({t.data_ptr() for t in tensors}) == 3  # separate buffers, as recorded
    assert all(torch.equal(t, tensors[0]) for t in tensors[1:]) and len(tensors) == 3


def test_load_bytes_counts_every_storage_and_its_slack() -> None:
    st = StorageRecord("cpu", 4096, 1 << 20, 512, 1000, "a" * 64)
    assert load_bytes([st]) == 512 + 1000 + 1024
    assert load_bytes([st] * 5) == 5 * (512 + 1000 + 1024)
    assert load_bytes([st] * 5, halo=4096, keep_prefix=False) == 5 * (1000 + 1024 + 8192)
    far = replace(st, span_start=PREFIX_LIMIT + 1)
    assert load_bytes([far]) == 1000 + 1024  # a far prefix is not re-created


def test_prefix_limit_is_the_materialiser_s() -> None:
    import kdump.bundle.materialize as materialize

    assert materialize.PREFIX_LIMIT is PREFIX_LIMIT  # one limit: load_bytes and the materialiser


def test_materialise_checks_the_cap_with_the_placement(tmp_path: Path) -> None:
    from kdump.bundle.materialize import Placement

    path = save_calls(tmp_path / "h.kdump", [capture_call("m:f", [_rand(64, seed=10)], {})])
    b = load_bundle(path, replace(Limits(), max_load_bytes=64 << 10))
    b.calls[0].materialize("cpu")
    with pytest.raises(BundleError) as info:
        b.calls[0].materialize("cpu", Placement(halo=1 << 20))
    assert info.value.kind is BundleErrorKind.LIMIT


def test_counts_over_the_limits(bases: Path, tmp_path: Path) -> None:
    path = bases / "rich.kdump"
    _rejects(path, BundleErrorKind.LIMIT, replace(Limits(), max_calls=2))
    _rejects(path, BundleErrorKind.LIMIT, replace(Limits(), max_tensors=3))
    _rejects(path, BundleErrorKind.LIMIT, replace(Limits(), max_tree_nodes=5))
    _rejects(path, BundleErrorKind.LIMIT, replace(Limits(), max_string=2))
    _rejects(path, BundleErrorKind.LIMIT, replace(Limits(), max_load_bytes=1000))
    assert len(load_bundle(path).calls) == 3


def test_overlapping_header_blobs_are_rejected(bases: Path, tmp_path: Path) -> None:
    header, manifest, data = split((bases / "rich.kdump").read_bytes())
    entries = [k for k in header if k != "__metadata__"]
    big = max(entries, key=lambda k: header[k]["shape"][0])
    for k in entries:
        header[k] = dict(header[big])
    path = tmp_path / "o.kdump"
    path.write_bytes(join(header, json.dumps(manifest), data))
    _rejects(path, BundleErrorKind.LIMIT)


# --------------------------------------------------------------------------------------------
# The recorder keeps to the reader's limits


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def test_too_deep_argument_becomes_a_placeholder(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import kdump.log

    kdump.log._logged.discard("argtree:nested too deep")
    x = _rand(4, seed=11)
    deep = _nested(Limits().max_tree_depth + 10, x)
    calls = [capture_call("m:f", [deep, x], {}) for _ in range(2)]
    path = save_calls(tmp_path / "deep.kdump", calls)
    b = load_bundle(path)  # readable: the reader's own limits hold
    args = b.calls[0].materialize("cpu").args
    node = args[0]
    while isinstance(node, list):
        node = node[0]
    assert type(node).__name__ == "Opaque" and "nested too deep" in node.repr
    assert torch.equal(args[1], x)
    assert capfd.readouterr().err.count("nested too deep") == 1  # said once


def test_too_many_nodes_become_placeholders(tmp_path: Path) -> None:
    x = _rand(4, seed=12)
    n = Limits().max_tree_nodes
    rec = capture_call("m:f", [list(range(n + 50)), x], {"k": list(range(10))})
    path = save_calls(tmp_path / "wide.kdump", [rec])
    call = load_bundle(path).calls[0]
    args = call.materialize("cpu").args
    assert type(args[0][-1]).__name__ == "Opaque" and args[0][5] == 5
    assert type(args[1]).__name__ == "Opaque"  # the budget is spent: the tensor is dropped too
    assert len(call.tensors) == 0


def test_too_long_string_argument_becomes_a_placeholder(tmp_path: Path) -> None:
    rec = capture_call("m:f", ["s" * (Limits().max_string + 1), _rand(2, seed=13)], {})
    call = load_bundle(save_calls(tmp_path / "s.kdump", [rec])).calls[0]
    assert type(call.materialize("cpu").args[0]).__name__ == "Opaque"


# --------------------------------------------------------------------------------------------
# Version 4's storage kinds (sparse, synthetic): hostile ranges, counts, generators, stats


def _sparse(m: dict[str, Any]) -> dict[str, Any]:
    return m["calls"][0]["storages"][0]


def _synth(m: dict[str, Any]) -> dict[str, Any]:
    return m["calls"][0]["storages"][1]


_HOSTILE_V4 = [
    ("ranges unsorted", lambda m: _sparse(m).update(ranges=[[1024, 2048], [0, 128]]), "schema"),
    ("ranges overlap", lambda m: _sparse(m).update(ranges=[[0, 1100], [1024, 2048]]), "schema"),
    ("range empty", lambda m: _sparse(m).update(ranges=[[0, 0], [0, 1152]]), "schema"),
    ("range past span", lambda m: _sparse(m).update(ranges=[[0, 128], [4000, 5024]]), "schema"),
    ("range huge", lambda m: _sparse(m).update(ranges=[[0, 128], [1 << 80, 1 << 81]]), "schema"),
    ("range negative", lambda m: _sparse(m).update(ranges=[[-128, 0], [0, 1024]]), "schema"),
    ("range bools", lambda m: _sparse(m).update(ranges=[[False, True]]), "schema"),
    ("range floats", lambda m: _sparse(m).update(ranges=[[0.0, 128.0], [1024, 2048]]), "schema"),
    ("range triple", lambda m: _sparse(m).update(ranges=[[0, 128, 9], [1024, 2048]]), "schema"),
    ("ranges not a list", lambda m: _sparse(m).update(ranges={"0": 128}), "schema"),
    ("ranges missing", lambda m: _sparse(m).pop("ranges"), "schema"),
    ("ranges miss the blob size", lambda m: _sparse(m).update(ranges=[[0, 64]]), "missing-blob"),
    ("sparse without blob", lambda m: _sparse(m).update(blob=""), "schema"),
    ("ranges on a blob", lambda m: _sparse(m).update(source="blob"), "schema"),
    (
        "generator on sparse",
        lambda m: _sparse(m).update(generator=_synth(m)["generator"]),
        "schema",
    ),
    ("synthetic names a blob", lambda m: _synth(m).update(blob=_sparse(m)["blob"]), "schema"),
    ("synthetic without stats", lambda m: _synth(m).pop("stats"), "schema"),
    ("synthetic without generator", lambda m: _synth(m).pop("generator"), "schema"),
    ("generator unknown", lambda m: _synth(m)["generator"].update(name="mt19937"), "schema"),
    ("generator version", lambda m: _synth(m)["generator"].update(version=99), "schema"),
    ("generator version bool", lambda m: _synth(m)["generator"].update(version=True), "schema"),
    ("seed negative", lambda m: _synth(m)["generator"].update(seed=-1), "schema"),
    ("seed 2^64", lambda m: _synth(m)["generator"].update(seed=1 << 64), "schema"),
    ("seed huge", lambda m: _synth(m)["generator"].update(seed=10**400), "schema"),
    ("seed float", lambda m: _synth(m)["generator"].update(seed=1.5), "schema"),
    ("seed string", lambda m: _synth(m)["generator"].update(seed="7"), "schema"),
    ("generator extra field", lambda m: _synth(m)["generator"].update(code="x"), "schema"),
    ("generator not an object", lambda m: _synth(m).update(generator=[1, 2, 3]), "schema"),
    ("stats min > max", lambda m: _synth(m)["stats"].update(min=3.0, max=-3.0), "schema"),
    ("stats std < 0", lambda m: _synth(m)["stats"].update(std=-1.0), "schema"),
    ("stats nan", lambda m: _synth(m)["stats"].update(mean=float("nan")), "schema"),
    ("stats inf", lambda m: _synth(m)["stats"].update(max=float("inf")), "schema"),
    ("stats huge int", lambda m: _synth(m)["stats"].update(max=10**400), "schema"),
    ("stats dtype unproduced", lambda m: _synth(m)["stats"].update(dtype="complex64"), "schema"),
    ("stats dtype unknown", lambda m: _synth(m)["stats"].update(dtype="float128"), "schema"),
    (
        "span absurd",
        lambda m: _synth(m).update(span_nbytes=1 << 60, storage_nbytes=1 << 60),
        "limit",
    ),
    ("sparse in version 3", lambda m: m.update(version=3), "schema"),  # ranges came with 4
    (
        "kind of version 4 in version 3",
        lambda m: (m.update(version=3), _sparse(m).pop("ranges")),
        "unknown-source",
    ),
]


@pytest.mark.parametrize(("name", "edit", "kind"), _HOSTILE_V4, ids=[c[0] for c in _HOSTILE_V4])
def test_hostile_sparse_and_synthetic_storages_are_refused(
    bases: Path, tmp_path: Path, name: str, edit: Any, kind: str
) -> None:
    path = _edit_manifest(bases / "slim.kdump", tmp_path / "h.kdump", edit)
    _rejects(path, BundleErrorKind(kind), Limits(max_load_bytes=FUZZ_LOAD_BYTES))


def test_sparse_range_count_is_a_limit(bases: Path, tmp_path: Path) -> None:
    path = bases / "slim.kdump"
    err = _rejects(path, BundleErrorKind.LIMIT, Limits(max_ranges=1))
    assert "byte ranges" in str(err)

    def many(m: dict[str, Any]) -> None:  # a million and one ranges: refused before the blob
        _sparse(m).update(ranges=[[i, i + 1] for i in range(0, 2 * 1_000_001, 2)])

    _rejects(_edit_manifest(path, tmp_path / "n.kdump", many), BundleErrorKind.LIMIT)


def _pieced(m: dict[str, Any]) -> dict[str, Any]:
    return m["calls"][0]["storages"][0]


def _shift(m: dict[str, Any]) -> None:
    """Piece sizes that still add up to the span, each but the last off by one from its blob."""
    p = _pieced(m)["pieces"]
    p[0][1] -= 1
    p[1][1] += 1


_HOSTILE_PIECES = [
    ("pieces short of the span", lambda m: _pieced(m)["pieces"].pop(), "schema"),
    (
        "pieces past the span",
        lambda m: _pieced(m)["pieces"].append(list(_pieced(m)["pieces"][0])),
        "schema",
    ),
    (
        "piece size 0",
        lambda m: _pieced(m)["pieces"].insert(1, [_pieced(m)["pieces"][0][0], 0]),
        "schema",
    ),
    ("piece size negative", lambda m: _pieced(m)["pieces"][0].__setitem__(1, -PIECE), "schema"),
    ("piece size bool", lambda m: _pieced(m)["pieces"][0].__setitem__(1, True), "schema"),
    ("piece size float", lambda m: _pieced(m)["pieces"][0].__setitem__(1, 1000.0), "schema"),
    ("piece size huge", lambda m: _pieced(m)["pieces"][0].__setitem__(1, 1 << 80), "schema"),
    ("piece sizes off their blobs", _shift, "missing-blob"),
    (
        "piece blob unknown",
        lambda m: _pieced(m)["pieces"][0].__setitem__(0, "ab" * 32),
        "missing-blob",
    ),
    ("piece blob not hex", lambda m: _pieced(m)["pieces"][0].__setitem__(0, "zz" * 32), "schema"),
    ("piece blob not a string", lambda m: _pieced(m)["pieces"][0].__setitem__(0, 7), "schema"),
    ("piece not a pair", lambda m: _pieced(m)["pieces"][0].append(1), "schema"),
    ("piece an object", lambda m: _pieced(m)["pieces"].__setitem__(0, {"blob": "x"}), "schema"),
    ("pieces not a list", lambda m: _pieced(m).update(pieces={"0": 1}), "schema"),
    (
        "one piece",
        lambda m: _pieced(m).update(pieces=_pieced(m)["pieces"][:1], span_nbytes=PIECE),
        "schema",
    ),
    ("pieces missing", lambda m: _pieced(m).pop("pieces"), "schema"),
    (
        "pieces name a blob too",
        lambda m: _pieced(m).update(blob=_pieced(m)["pieces"][0][0]),
        "schema",
    ),
    ("pieces on a blob storage", lambda m: _pieced(m).update(source="blob"), "schema"),
    ("pieces on a sparse storage", lambda m: _pieced(m).update(source="sparse"), "schema"),
    ("pieces in version 4", lambda m: m.update(version=4), "schema"),  # pieces came with 5
    (
        "kind of version 5 in version 4",
        lambda m: (m.update(version=4), _pieced(m).pop("pieces")),
        "unknown-source",
    ),
    (
        "pieces of absurd size",
        lambda m: _pieced(m).update(
            pieces=[[_pieced(m)["pieces"][0][0], 1 << 59]] * 2,
            span_nbytes=1 << 60,
            storage_nbytes=1 << 60,
        ),
        "missing-blob",
    ),
]


@pytest.mark.parametrize(
    ("name", "edit", "kind"), _HOSTILE_PIECES, ids=[c[0] for c in _HOSTILE_PIECES]
)
def test_hostile_pieced_storages_are_refused(
    bases: Path, tmp_path: Path, name: str, edit: Any, kind: str
) -> None:
    path = _edit_manifest(bases / "pieces.kdump", tmp_path / "h.kdump", edit)
    _rejects(path, BundleErrorKind(kind), Limits(max_load_bytes=FUZZ_LOAD_BYTES))


def test_piece_count_is_a_limit(bases: Path, tmp_path: Path) -> None:
    path = bases / "pieces.kdump"
    err = _rejects(path, BundleErrorKind.LIMIT, Limits(max_pieces=3))
    assert "pieces" in str(err)

    def many(m: dict[str, Any]) -> None:  # a million and one pieces: refused before any is read
        sha = _pieced(m)["pieces"][0][0]
        _pieced(m).update(pieces=[[sha, 1]] * 1_000_001, span_nbytes=1_000_001)

    _rejects(_edit_manifest(path, tmp_path / "n.kdump", many), BundleErrorKind.LIMIT)


def test_pieced_storage_loads_and_shares_its_blobs(bases: Path) -> None:
    b = load_bundle(bases / "pieces.kdump")
    st = b.calls[0].storages[0]
    assert st.source.value == "pieces" and len(st.pieces) == 4
    assert len(b.blobs) == 4  # 3 distinct pieces (two equal) and the small storage
    x = b.calls[0].materialize("cpu").tensors[0]
    assert x.storage_offset() == 3
    assert torch.equal(x[: PIECE // 4], x[PIECE // 2 : 3 * PIECE // 4])
    assert torch.equal(b.calls[0].outputs["args[0]"], x)


def test_corrupt_piece_is_a_checksum_error(bases: Path, tmp_path: Path) -> None:
    src = bases / "pieces.kdump"
    header, manifest, data = split(src.read_bytes())
    sha = manifest["calls"][0]["storages"][0]["pieces"][1][0]
    b, _ = header[sha]["data_offsets"]
    data = bytearray(data)
    data[b + 17] ^= 0x40
    bad = tmp_path / "bad.kdump"
    bad.write_bytes(join(header, json.dumps(manifest), bytes(data)))
    bundle = load_bundle(bad)
    with pytest.raises(BundleError, match=f"checksum mismatch in blob {sha[:12]}") as info:
        bundle.calls[0].materialize("cpu")
    assert info.value.kind is BundleErrorKind.CHECKSUM
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(bad).verify()


def test_generator_fields_are_escaped_in_the_error(bases: Path, tmp_path: Path) -> None:
    """A campaign finding: a string version or seed reached the message raw (an ESC byte)."""

    def version(m: dict[str, Any]) -> None:
        m["calls"][0]["storages"][1]["generator"].update(version="\x1b" * 30)

    def seed(m: dict[str, Any]) -> None:
        m["calls"][0]["storages"][1]["generator"].update(seed="\x1b[31m")

    for edit in (version, seed):
        path = _edit_manifest(bases / "slim.kdump", tmp_path / "g.kdump", edit)
        err = _rejects(path, BundleErrorKind.SCHEMA)
        assert "\x1b" not in str(err)
