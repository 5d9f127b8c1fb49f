"""The bytes kdump writes do not change by accident: bundles (one write, several calls, a blob
store, pack), a journal and its salvage, and the flight recorder's own journal and flush, all
written from fixed inputs (tests/golden.py), equal the files kept in tests/data/golden/."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kdump.bundle import load_bundle
from tests import golden

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fixed-address arena is Linux's")


def _files(root: Path) -> dict[str, bytes]:
    files = (p for p in root.rglob("*") if p.is_file() and p.name != "README.md")
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def test_written_bytes_equal_the_golden_files(tmp_path: Path) -> None:
    golden.write_all(tmp_path)
    want, got = _files(golden.HERE), _files(tmp_path)
    assert sorted(got) == sorted(want)
    changed = [name for name in want if want[name] != got[name]]
    assert not changed, f"bytes differ from tests/data/golden: {changed}"


def test_golden_bundles_load() -> None:
    bundles = [p for p in golden.HERE.rglob("*.kdump") if "store" not in p.parts]
    assert len(bundles) >= 8
    for p in bundles:
        with load_bundle(p) as b:
            for call in b.calls:
                assert call.target == golden.TARGET
                assert len(call.args) == 5


def test_writing_twice_in_one_process_gives_the_same_bytes(tmp_path: Path) -> None:
    golden.write_all(tmp_path / "a")
    golden.write_all(tmp_path / "b")
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
