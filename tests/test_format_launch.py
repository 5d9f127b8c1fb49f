"""Format version 6: the call's `launch` record and the `$pointer` argument node, written, read
back, refused when malformed, and a call holding a raw pointer refused for replay."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from kdump.bundle import capture_call, load_bundle, save_calls
from kdump.errors import BundleError, ExitCode
from kdump.format import argtree
from kdump.format.records import FORMAT_VERSION, LaunchRecord
from kdump.replay import replay

LAUNCH = LaunchRecord(
    kind="triton",
    grid=(4, 1, 1),
    options={"num_warps": 4, "num_stages": 3, "maxnreg": None, "enable_fp_fusion": True},
    constexprs=("BLOCK",),
    source_sha256="ab" * 32,
    version="3.9.0",
)


def double(x: torch.Tensor, out: torch.Tensor, where: Any = None) -> None:
    out.copy_(x * 2)


TARGET = f"{double.__module__}:double"


def _write(path: Path, launch: LaunchRecord | None = LAUNCH, where: Any = None) -> Path:
    x, out = torch.arange(8.0), torch.zeros(8)
    call = capture_call(TARGET, [x, out], {"where": where}, names=["x", "out"])
    call.launch = launch
    save_calls(path, [call])
    return path


def _edit_manifest(path: Path, edit: Any) -> Path:
    """Rewrites the manifest JSON of a bundle (the header keeps its length: padded with spaces)."""
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    manifest = json.loads(header["__metadata__"]["kdump.manifest"])
    manifest["writer"] = ""  # room for an edit that lengthens a field
    edit(manifest)
    header["__metadata__"]["kdump.manifest"] = json.dumps(manifest, separators=(",", ":"))
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n, "the edit made the header longer than the original"
    raw[8 : 8 + n] = text.ljust(n)
    path.write_bytes(bytes(raw))
    return path


def test_a_launch_record_is_written_and_read_back(tmp_path: Path) -> None:
    b = load_bundle(_write(tmp_path / "a.kdump"))
    assert b.manifest.version == FORMAT_VERSION == 6
    assert b.call(0).launch == LAUNCH


def test_a_call_without_a_launch_writes_no_launch_field(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.kdump", launch=None)
    seen: list[Any] = []
    _edit_manifest(path, lambda m: seen.append(m["calls"][0]))
    assert "launch" not in seen[0]
    assert load_bundle(path).call(0).launch is None


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("grid", [1, 2, 3, 4], "grid"),
        ("grid", [-1], "grid"),
        ("grid", [True], "grid"),
        ("kind", "cuda-tile", "kind"),
        ("source_sha256", "AB" * 32, "source_sha256"),
        ("options", {"num_warps": [4]}, "options"),
        ("constexprs", [1], "constexprs"),
        ("version", 3, "version"),
    ],
)
def test_a_malformed_launch_record_is_refused(
    tmp_path: Path, field: str, value: Any, says: str
) -> None:
    path = _write(tmp_path / "a.kdump")
    _edit_manifest(path, lambda m: m["calls"][0]["launch"].__setitem__(field, value))
    with pytest.raises(BundleError, match=says):
        load_bundle(path)


def test_a_launch_record_in_a_version_5_bundle_is_refused(tmp_path: Path) -> None:
    path = _edit_manifest(_write(tmp_path / "a.kdump"), lambda m: m.__setitem__("version", 5))
    with pytest.raises(BundleError, match="version 6"):
        load_bundle(path)


def test_a_version_5_bundle_without_launch_records_still_loads(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.kdump", launch=None)
    _edit_manifest(path, lambda m: m.__setitem__("version", 5))
    assert load_bundle(path).call(0).launch is None


def test_a_pointer_is_encoded_checked_and_decoded() -> None:
    tensors: list[Any] = []
    tree = argtree.encode([argtree.Pointer(0x7F00_0000_1000), 5], tensors)
    assert tree == [{"$pointer": 0x7F00_0000_1000}, 5]
    argtree.check(tree, 0)
    assert argtree.decode(tree, lambda i: None) == [argtree.Pointer(0x7F00_0000_1000), 5]
    paths = argtree.pointer_paths(["ptrs"], [{"$tuple": [1, {"$pointer": 16}]}], {})
    assert paths == [("ptrs[1]", 16)]


@pytest.mark.parametrize("bad", [-1, 1 << 64, True, "0x10", 1.5])
def test_a_malformed_pointer_is_refused(bad: Any) -> None:
    with pytest.raises(BundleError, match="pointer"):
        argtree.check({"$pointer": bad}, 0)


def test_a_call_given_a_raw_pointer_is_refused_for_replay_in_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.kdump", launch=None, where=(argtree.Pointer(0xDEAD000),))
    [v] = replay([path], device="cpu", allow_targets=[TARGET])
    assert v.exit_code == ExitCode.CANNOT_RUN
    text = " ".join(f.message for f in v.findings)
    assert "where[0]" in text and "0xdead000" in text and "raw device address" in text
