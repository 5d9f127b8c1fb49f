from __future__ import annotations

from pathlib import Path

import pytest

from kdump.errors import CannotRunError
from kdump.replay.sanitizer import PlacedTensor, find_sanitizer, locate, parse_report

DATA = Path(__file__).parent / "data"

SAMPLE = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 2 bytes
=========     at kd_gemm_labels_fp32_stale+0x1a30 in /tmp/kd/grouped_gemm.cu:312
=========     by thread (5,0,0) in block (3,0,0)
=========     Address 0x7f0c2e041000 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f0c2e000000 of size 266240 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cuLaunchKernel [0x2a5b1] in libcuda.so.1
=========
========= Invalid __global__ read of size 16 bytes
=========     at void at::native::vectorized_elementwise_kernel<4>(int)+0x90
=========     by thread (1,0,0) in block (0,0,0)
=========     Access to 0x7f0c2f000000 is out of bounds
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure"
=========
========= ERROR SUMMARY: 1,024 errors
"""


def test_parse_records_and_summary() -> None:
    rep = parse_report(SAMPLE)
    assert rep.errors == 1024
    assert len(rep.records) == 2
    w = rep.records[0]
    assert (w.access, w.size, w.kernel, w.pc) == ("write", 2, "kd_gemm_labels_fp32_stale", "0x1a30")
    assert w.source.endswith("grouped_gemm.cu:312")
    assert (w.thread, w.block) == ("5,0,0", "3,0,0")
    assert w.address == 0x7F0C2E041000
    assert w.nearest == {
        "distance": 1,
        "direction": "after",
        "allocation": 0x7F0C2E000000,
        "allocation_size": 266240,
    }
    r = rep.records[1]
    assert r.access == "read" and r.size == 16 and r.address == 0x7F0C2F000000


def test_parse_clean_and_empty_reports() -> None:
    assert (
        parse_report("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n").errors == 0
    )
    rep = parse_report("")
    assert rep.errors is None and rep.records == []


def test_locate_maps_addresses_to_elements() -> None:
    d = PlacedTensor("d", 0x10000, 2, (128, 256), (256, 1))
    a = PlacedTensor("a[0]", 0x80000, 1, (128, 512), (512, 1))
    assert locate(0x10000 + 2 * (3 * 256 + 7), [d, a]) == "d[3, 7]"
    end = 0x10000 + 128 * 256 * 2
    assert locate(end + 16, [d, a]) == "17 bytes past the end of d"
    assert locate(0x80000 - 4, [d, a]) == "4 bytes before a[0]"
    t = PlacedTensor("t", 0x1000, 4, (8, 4), (1, 8))  # column-major
    assert locate(0x1000 + 4 * (2 * 8 + 5), [t]) == "t[5, 2]"


def test_missing_sanitizer_is_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CannotRunError):
        find_sanitizer(str(tmp_path / "nope"))


@pytest.mark.parametrize("log", sorted(DATA.glob("*.log")), ids=lambda p: p.name)
def test_parse_real_reports(log: Path) -> None:
    """Reports captured on the H200 (see tests/data/README.md)."""
    text = log.read_text()
    rep = parse_report(text)
    assert rep.errors is not None
    if rep.errors:
        assert rep.records and all(r.kind for r in rep.records)
        assert any(r.address is not None for r in rep.records)
    else:
        assert rep.records == []


def test_real_fault_report_fields() -> None:
    rep = parse_report((DATA / "memcheck-sm120-faulty.log").read_text())
    assert rep.errors == 1340 and len(rep.records) == 4
    r = rep.records[0]
    assert (r.access, r.size, r.kernel) == ("write", 4, "kd_gemm_labels_fp32_stale")
    assert (r.thread, r.block) == ("64,0,0", "17,0,0")
    assert r.address == 0x7F6F4ED00190
    assert r.nearest == {
        "distance": 401,
        "direction": "after",
        "allocation": 0x7F6F4EC00000,
        "allocation_size": 1048576,
    }
    # D of the script: 2048 x 256 bf16 = 1 MiB at the nearest allocation's address
    d = PlacedTensor("d", 0x7F6F4EC00000, 2, (2048, 256), (256, 1))
    assert locate(r.address, [d]) == "401 bytes past the end of d"
