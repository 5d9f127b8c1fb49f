"""CPU checks of the packaged kernel's argument validation (no GPU needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kdump.errors import ContractViolation  # noqa: E402
from kdump.kernels.sm120 import api  # noqa: E402


def test_scale_strides_must_fit_32_bit_tile_offsets() -> None:
    # The kernel adds up to 127 rows of stride to a per-tile base in 32 bits.
    ok = torch.empty_strided((2, 1), ((1 << 24) - 1, 1), dtype=torch.int32)
    api._check_scale("a scale", ok, (2, 1), ok.device)
    big = torch.empty_strided((2, 1), (1 << 24, 1), dtype=torch.int32)
    with pytest.raises(ContractViolation, match="row stride"):
        api._check_scale("a scale", big, (2, 1), big.device)
    # a single row, or MN-major scales (stride(-2) == 1), may have any other stride
    one = torch.empty_strided((1, 1), (1 << 30, 1), dtype=torch.int32)
    api._check_scale("a scale", one, (1, 1), one.device)
    mn = torch.empty_strided((3, 2, 1), (2, 1, 1 << 30), dtype=torch.int32)
    api._check_scale("b scale", mn, (3, 2, 1), mn.device)
