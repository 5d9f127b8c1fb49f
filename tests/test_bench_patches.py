"""bench/bench_snapshot_kernel.py's timing experiments (PATCHES) are text substitutions on
kdump/record/flight/snapshot.cu: each must still find its text exactly once in the shipped kernel,
and the patched kernels must still compile, or a refactor of the kernel breaks them silently."""

from __future__ import annotations

from typing import Any

import pytest

from kdump.record.flight import gather


@pytest.fixture
def bench(bench_import: Any) -> Any:
    return bench_import("bench_snapshot_kernel")


def test_every_patch_finds_its_text_once_in_the_shipped_kernel(bench):
    src = gather.kernel_source()
    assert bench.PATCHES
    for name, subs in bench.PATCHES.items():
        for old, new in subs:
            assert src.count(old) == 1, (name, old)
            assert old != new


def test_patches_are_applied_and_refused_by_name(bench):
    src = bench.variant_source("patch=fixed-rows+no-counter+no-copies")[0]
    assert "atomicAdd(&rec->row_counter" not in src
    assert "s_last = blockIdx.x == 0;" in src
    assert bench.variant_source("")[0] == gather.kernel_source()
    with pytest.raises(SystemExit, match="no patch 'nope'"):
        bench.variant_source("patch=nope")
    for alone in ("no-counter", "no-publication"):  # the row counter would never be reset
        with pytest.raises(SystemExit, match="needs fixed-rows"):
            bench.variant_source(f"patch={alone}")
    with pytest.raises(SystemExit, match="needs no-publication"):
        bench.variant_source("patch=fixed-rows+no-fence")


@pytest.mark.parametrize(
    "spec",
    [
        "patch=fixed-rows+no-counter+no-copies",
        "patch=fixed-rows+no-publication+no-fence+no-gather+no-host-writes",
        "KD_DENSE=0",  # scales read only where rows are touched (bench_flight --define)
        "KD_DENSE=0,patch=fixed-rows+no-gather",
        "KD_OVERLAP=0",  # a call's rows, then its scales (bench_flight --define)
        "KD_OVERLAP=0,patch=fixed-rows+no-gather",
    ],
)
def test_patched_kernels_compile_under_nvrtc(bench, spec):
    cuda_core = pytest.importorskip("cuda.core")
    src = bench.variant_source(spec)[0]
    opts = cuda_core.ProgramOptions(arch="sm_90a", std="c++17")
    cubin = cuda_core.Program(src, "c++", opts).compile("cubin")
    assert bytes(cubin.code)[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_flight_case_i_kernels_compile_under_nvrtc(bench_import, arch):
    """bench/bench_flight.py's kernels of case (i) (kd_floor, kd_floor_ring) are only ever
    launched on a GPU: compile them here."""
    cuda_core = pytest.importorskip("cuda.core")
    flight = bench_import("bench_flight")
    opts = cuda_core.ProgramOptions(arch=arch, std="c++17")
    cubin = cuda_core.Program(flight._FLOOR_SRC, "c++", opts).compile("cubin")
    code = bytes(cubin.code)
    assert code[:4] == b"\x7fELF"
    for name in (b"kd_floor", b"kd_floor_ring"):  # each symbol, whole in the string table
        assert b"\x00" + name + b"\x00" in code, name
