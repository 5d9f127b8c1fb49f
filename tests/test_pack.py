"""`kdump pack`: self-contained copies written next to the capture folder, never inside it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kdump.bundle import BlobStore, capture_call, iter_bundles, load_bundle, save_calls
from kdump.cli import main

GEN = torch.Generator().manual_seed(4711)


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, device="cpu")


@pytest.fixture
def capture(tmp_path: Path) -> tuple[Path, dict[str, list[torch.Tensor]]]:
    """A capture directory: two process folders sharing one blob store."""
    cap = tmp_path / "dumps"
    store = BlobStore(cap)
    w = _rand(64, 32)
    args = {"p1/a.kdump": [_rand(8, 32), w], "p2/b.kdump": [_rand(4, 32), w]}
    for rel, tensors in args.items():
        save_calls(cap / rel, [capture_call("m:f", tensors)], store=store)
    return cap, args


def _exit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def _assert_packed(path: Path, want: list[torch.Tensor]) -> None:
    b = load_bundle(path)
    assert {info.where.value for info in b.blobs.values()} == {"inline"}
    b.verify()
    got = b.calls[0].args
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


def _listed(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in iter_bundles([folder]))


def test_default_is_beside_the_capture_folder(
    capture: tuple[Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    cap, args = capture
    code, out, _ = _exit(capsys, "pack", str(cap / "p1" / "a.kdump"))
    assert code == 0
    packed = cap.with_name("dumps.packed") / "p1" / "a.kdump"
    assert f"wrote {packed}" in out
    assert _listed(cap) == ["p1/a.kdump", "p2/b.kdump"]  # a replay of dumps/ sees no copy
    shutil.rmtree(cap / "blobs")  # the copy needs no store
    _assert_packed(packed, args["p1/a.kdump"])


def test_folder_packs_every_bundle(
    capture: tuple[Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    cap, args = capture
    assert _exit(capsys, "pack", str(cap))[0] == 0
    packed = cap.with_name("dumps.packed")
    assert _listed(packed) == ["p1/a.kdump", "p2/b.kdump"]
    assert _listed(cap) == ["p1/a.kdump", "p2/b.kdump"]
    shutil.rmtree(cap / "blobs")
    for rel, want in args.items():
        _assert_packed(packed / rel, want)


def test_process_folder_goes_beside_the_capture_root(
    capture: tuple[Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    cap, args = capture
    assert _exit(capsys, "pack", str(cap / "p2"))[0] == 0
    assert _listed(cap.with_name("dumps.packed")) == ["p2/b.kdump"]
    _assert_packed(cap.with_name("dumps.packed") / "p2" / "b.kdump", args["p2/b.kdump"])


def test_output_folder_receives_the_bundle(
    capture: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cap, args = capture
    out = tmp_path / "attach"
    out.mkdir()
    assert _exit(capsys, "pack", str(cap / "p1" / "a.kdump"), "-o", str(out))[0] == 0
    _assert_packed(out / "a.kdump", args["p1/a.kdump"])
    assert _exit(capsys, "pack", str(cap), "-o", str(out))[0] == 0
    assert _listed(out) == ["a.kdump", "p1/a.kdump", "p2/b.kdump"]


def test_output_file(
    capture: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cap, args = capture
    dst = tmp_path / "issue-4711.kdump"
    assert _exit(capsys, "pack", str(cap / "p2" / "b.kdump"), "-o", str(dst))[0] == 0
    _assert_packed(dst, args["p2/b.kdump"])


def test_refusals_write_nothing(
    capture: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cap, _ = capture
    before = sorted(p for p in tmp_path.rglob("*"))
    inside = cap / "p1" / "copy.kdump"
    code, _, err = _exit(capsys, "pack", str(cap / "p1" / "a.kdump"), "-o", str(inside))
    assert code == 2 and "inside" in err and "-o" in err
    code, _, err = _exit(capsys, "pack", str(cap), "-o", str(tmp_path / "one.kdump"))
    assert code == 2 and "existing folder" in err
    src = cap / "p1" / "a.kdump"
    code, _, err = _exit(capsys, "pack", str(src), "-o", str(src))
    assert code == 2
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert _exit(capsys, "pack", str(tmp_path / "missing.kdump"))[0] == 2


def test_bundle_outside_a_capture_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = [_rand(16, 8), _rand(8)]
    src = save_calls(tmp_path / "solo" / "x.kdump", [capture_call("m:f", tensors)])
    assert _exit(capsys, "pack", str(src))[0] == 0
    _assert_packed(tmp_path / "solo.packed" / "x.kdump", tensors)
    assert _listed(tmp_path / "solo") == ["x.kdump"]


def test_bundle_at_the_file_system_root_needs_an_output() -> None:
    """A bundle directly under / has no folder beside its own for the default copy: a usage
    error that says to pass -o (not an internal error)."""
    from kdump.bundle.packing import pack_destination
    from kdump.errors import UsageError

    with pytest.raises(UsageError, match="pass -o"):
        pack_destination("/call.kdump")
