"""lab/flight_variants.py's kernels of case (i) (kd_floor, kd_floor_ring) are only ever launched
on a GPU: compile them here."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_flight_case_i_kernels_compile_under_nvrtc(lab_import: Any, arch: str) -> None:
    cuda_core = pytest.importorskip("cuda.core")
    flight = lab_import("flight_variants")
    opts = cuda_core.ProgramOptions(arch=arch, std="c++17")
    cubin = cuda_core.Program(flight._FLOOR_SRC, "c++", opts).compile("cubin")
    code = bytes(cubin.code)
    assert code[:4] == b"\x7fELF"
    for name in (b"kd_floor", b"kd_floor_ring"):  # each symbol, whole in the string table
        assert b"\x00" + name + b"\x00" in code, name
