"""`kdump info` and `kdump pack` through the real entry point (kdump.cli.main)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdump.bundle import BlobStore, capture_call, load_bundle, save_calls
from kdump.cli import main
from kdump.format.records import ALIGN_MOD, FORMAT_VERSION

GEN = torch.Generator().manual_seed(3)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def _call_args() -> tuple[list, dict]:
    base = torch.randn(64, 32, generator=GEN)
    q = (torch.randn(32, 128, generator=GEN) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    sc = torch.empty_strided((32, 1), (1, 32), dtype=torch.float32).copy_(torch.rand(32, 1) + 1)
    return [(q, sc), base[8:40], base.t()], {"labels": torch.randint(0, 4, (32,), generator=GEN)}


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    args, kwargs = _call_args()
    rec = capture_call("deep_gemm:m_grouped", args, kwargs, names=["a", "b", "d"], meta={"rank": 1})
    return save_calls(tmp_path / "b.kdump", [rec, rec], env={"hostname": "node7", "pid": 42})


def test_info_table(capsys: pytest.CaptureFixture[str], bundle: Path) -> None:
    code, out, err = run(capsys, "info", str(bundle))
    assert code == 0, err
    flat = " ".join(out.split())  # the header line wraps with the terminal's width
    assert f"format v{FORMAT_VERSION}" in flat and "2 call(s)" in flat and "node7" in out
    assert "deep_gemm:m_grouped" in out
    for col in ("arg", "dtype", "shape", "stride", "offset", "align", "bytes"):
        assert col in out
    assert "float8_e4m3fn" in out and "32×128" in out and "1,32" in out
    assert "shared storage: b = d" in out


def test_info_json(capsys: pytest.CaptureFixture[str], bundle: Path) -> None:
    code, out, _ = run(capsys, "info", "--json", str(bundle))
    assert code == 0
    [rep] = json.loads(out)  # a list, also for one bundle
    assert rep["format_version"] == FORMAT_VERSION and len(rep["calls"]) == 2
    assert rep["file_bytes"] == bundle.stat().st_size
    assert rep["blob_bytes"] * 2 == rep["logical_bytes"]  # the second call is deduplicated
    call = rep["calls"][1]
    assert call["index"] == 1 and call["meta"] == {"rank": 1}
    by_name = {t["name"]: t for t in call["tensors"]}
    assert set(by_name) == {"a[0]", "a[1]", "b", "d", "labels"}
    a1 = by_name["a[1]"]
    assert (a1["dtype"], a1["shape"], a1["stride"], a1["storage_offset"]) == (
        "float32",
        [32, 1],
        [1, 32],
        0,
    )
    b = by_name["b"]
    assert (b["shape"], b["stride"], b["storage_offset"]) == ([32, 32], [32, 1], 256)
    assert b["bytes"] == 32 * 32 * 4 and by_name["a[0]"]["bytes"] == 32 * 128
    recorded = load_bundle(bundle).calls[1].tensors
    for t, rec in zip(call["tensors"], recorded):
        assert t["alignment"] == rec.data_ptr % ALIGN_MOD
        assert int(t["data_ptr"], 16) == rec.data_ptr
    assert call["aliasing"] == [["b", "d"]]


def test_info_verify(capsys: pytest.CaptureFixture[str], bundle: Path) -> None:
    code, out, _ = run(capsys, "info", "--verify", str(bundle))
    assert code == 0 and "checksums OK" in out
    raw = bytearray(bundle.read_bytes())
    raw[-3] ^= 0x10
    bundle.write_bytes(bytes(raw))
    code, out, err = run(capsys, "info", str(bundle))
    assert code == 0  # without --verify the manifest is all that is read
    code, out, err = run(capsys, "info", "--verify", str(bundle))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdump: error:") and "checksum" in lines[0]
    assert "Traceback" not in err + out


def test_info_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args, kwargs = _call_args()
    store = BlobStore(tmp_path)
    for i in range(2):
        save_calls(tmp_path / f"r{i}" / "c.kdump", [capture_call("m:f", args, kwargs)], store=store)
    code, out, _ = run(capsys, "info", "--json", "--verify", str(tmp_path))
    assert code == 0
    reps = json.loads(out)
    assert len(reps) == 2 and all(r["blobs_in_store"] == r["blobs"] > 0 for r in reps)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: p / "missing.kdump", "no such file"),
        (lambda p: p, "folder holds no .kdump bundles"),
        (lambda p: (p / "x.kdump").write_bytes(b"\x01\x02") and p / "x.kdump", "too short"),
        (
            lambda p: (p / "t.kdump").write_text("hello world, not a bundle") and p / "t.kdump",
            "header length",
        ),
    ],
)
def test_info_bad_paths(capsys: pytest.CaptureFixture[str], tmp_path: Path, make, match) -> None:
    target = make(tmp_path)
    code, out, err = run(capsys, "info", str(target))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdump: error: ") and match in lines[0]
    assert "Traceback" not in err and out == ""


def test_pack(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args, kwargs = _call_args()
    cap = tmp_path / "cap"
    src = save_calls(cap / "c.kdump", [capture_call("m:f", args, kwargs)], store=BlobStore(cap))
    out_path = tmp_path / "issue.kdump"
    code, out, _ = run(capsys, "pack", str(src), "-o", str(out_path))
    assert code == 0 and f"wrote {out_path}" in out and "kdump replay" in out
    code, out, _ = run(capsys, "pack", str(src))
    # beside the capture folder, not inside it: a replay of cap/ must not see the copy
    assert code == 0 and (tmp_path / "cap.packed" / "c.kdump").is_file()
    assert not (cap / "c.packed.kdump").exists()
    shutil.rmtree(cap)
    got = load_bundle(out_path).calls[0]
    assert torch.equal(got.args[1], args[1]) and got.args[1].stride() == args[1].stride()
    code, _, err = run(capsys, "pack", str(src))
    assert code == 2 and err.startswith("kdump: error: ") and len(err.strip().splitlines()) == 1


def test_python_dash_m_entry_point(bundle: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kdump", "info", "--json", str(bundle)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    [rep] = json.loads(proc.stdout)
    assert rep["calls"][0]["target"] == "deep_gemm:m_grouped"
    proc = subprocess.run(
        [sys.executable, "-m", "kdump", "info", str(bundle.parent / "nope.kdump")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"kdump: error: {bundle.parent / 'nope.kdump'}: no such file"
    ]
