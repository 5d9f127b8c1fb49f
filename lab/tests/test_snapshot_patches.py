"""lab/bench_snapshot_kernel.py's variants of the snapshot kernel: its timing experiments and the
switches the shipped kernel no longer has (PATCHES) are text substitutions on
kdump/record/flight/snapshot.cu, its other variants -D flags replaced. Each patch must still find
its text exactly once in the shipped kernel and the variant builds must still compile, or a
refactor of the kernel breaks them silently."""

from __future__ import annotations

from typing import Any

import pytest

from kdump.record.flight import gather


@pytest.fixture
def bench(lab_import: Any) -> Any:
    return lab_import("bench_snapshot_kernel")


def test_every_patch_finds_its_text_once_in_the_shipped_kernel(bench):
    src = gather.kernel_source()
    assert bench.PATCHES
    for name, subs in bench.PATCHES.items():
        for old, new in subs:
            assert src.count(old) == 1, (name, old)
            assert old != new


def test_patches_are_applied_and_refused_by_name(bench):
    v = bench.variant("patch=fixed-rows+no-counter+no-copies")
    assert "atomicAdd(&rec->row_counter" not in v.source
    assert "s_last = blockIdx.x == 0;" in v.source
    shipped = bench.variant("")
    assert shipped.source == gather.kernel_source() and shipped.defines == gather.DEFINES
    assert (shipped.smem, shipped.split_bytes) == (gather.SMEM_BYTES, gather.SPLIT_BYTES)
    with pytest.raises(SystemExit, match="no patch 'nope'"):
        bench.variant("patch=nope")
    for alone in ("no-counter", "no-publication"):  # the row counter would never be reset
        with pytest.raises(SystemExit, match="needs fixed-rows"):
            bench.variant(f"patch={alone}")
    with pytest.raises(SystemExit, match="needs no-publication"):
        bench.variant("patch=fixed-rows+no-fence")
    with pytest.raises(SystemExit, match="no -D KD_NOPE"):
        bench.variant("KD_NOPE=1")


def test_defines_and_the_old_switches(bench):
    v = bench.variant("KD_UNROLL=8u,min_blocks=2,KD_BULK_STAGES=8,KD_SPLIT_BYTES=65536")
    assert v.defines["KD_UNROLL"] == "8u" and v.defines["KD_MIN_BLOCKS"] == "2"
    assert v.chunk == v.threads * 16 * 8 and v.defines["KD_CHUNK"] == f"{v.chunk}ull"
    assert v.smem == 4 * int(v.defines["KD_BUF_WORDS"]) == 4 * 8 * gather.BULK_STAGE
    assert v.split_bytes == 65536 and v.source == gather.kernel_source()
    for spec, patch in (("KD_DENSE=0", "no-dense"), ("KD_OVERLAP=0", "no-overlap")):
        assert bench.variant(spec).source == bench.patched(gather.kernel_source(), patch)
    assert bench.variant("KD_DENSE=1,KD_BULK=1,KD_EARLY_LAUNCH=0").source == gather.kernel_source()


@pytest.mark.parametrize(
    "spec",
    [
        "patch=fixed-rows+no-counter+no-copies",
        "patch=fixed-rows+no-publication+no-fence+no-gather+no-host-writes",
        "KD_DENSE=0",  # scales read only where rows are touched (flight_variants --define)
        "KD_DENSE=0,patch=fixed-rows+no-gather",
        "KD_OVERLAP=0",  # a call's rows, then its scales (flight_variants --define)
        "KD_OVERLAP=0,patch=fixed-rows+no-gather",
        "KD_BULK=0",
        "KD_EARLY_LAUNCH=1",
        "KD_EARLY_LAUNCH=2",
        "KD_UNROLL=8u,KD_BULK_STAGES=8",
    ],
)
def test_variant_kernels_compile_under_nvrtc(bench, spec):
    cuda_core = pytest.importorskip("cuda.core")
    v = bench.variant(spec)
    flags = gather.define_flags(v.defines)
    opts = cuda_core.ProgramOptions(arch="sm_90a", std="c++17", define_macro=flags)
    cubin = cuda_core.Program(v.source, "c++", opts).compile("cubin")
    assert bytes(cubin.code)[:4] == b"\x7fELF"
