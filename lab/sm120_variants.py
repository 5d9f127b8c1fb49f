"""Lab builds of the packaged kernel (kdump/kernels/sm120): its TileConfig's fields replaced, and
the code paths the product no longer ships, restored by lab/patches/sm120_variants.patch:

- probe (measurement only, results wrong): 1 = math warps release every stage unread (the load
  path alone), 2 = scale words are constants (no global loads there), 3 = no output stores,
  4 = no MMAs (everything else kept);
- split_thin=1: tiles of at most bm / warps_m rows split their K blocks over the two warp rows
  and add the sums at the end of the tile (decode). Not shipped: on the H200 the kernel without
  that code path measured 3-7% faster at every batch size, decode included
  (lab/results/RESULTS_sm120_tuning.md, 2026-11-30);
- pred_stores=0: a branch per row and column checks everywhere in the epilogue (the shipped one
  packs every output pair of a whole N tile, then stores rows with predicated stores).

`with lab_config(stages=5, split_thin=1): ...` runs the packaged kernel so (modules loaded inside
are dropped on exit); the sweep (sweep_sm120.py), psum_sm120.py and profile_case.py use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import unified_patch
from kdump.kernels.sm120 import build, configs, launch
from kdump.kernels.sm120.configs import TileConfig, arch_family

PATCH = Path(__file__).resolve().parent / "patches" / "sm120_variants.patch"


@dataclasses.dataclass(frozen=True)
class LabConfig(TileConfig):
    """A TileConfig with the lab's fields (built from the patched source)."""

    probe: int = 0
    split_thin: int = 0
    pred_stores: int = 1

    def defines(self) -> list[str]:
        return [
            *super().defines(),
            f"KD_SPLIT_THIN={self.split_thin}",
            f"KD_PRED_STORES={self.pred_stores}",
            f"KD_PROBE={self.probe}",
        ]

    def check(self) -> None:
        super().check()
        for flag in ("split_thin", "pred_stores"):
            if getattr(self, flag) not in (0, 1):
                raise ValueError(f"{self}: {flag} is 0 or 1")
        if self.probe not in range(5):
            raise ValueError(f"{self}: probe is 0 (off) to 4")


LAB_FIELDS = {f.name for f in dataclasses.fields(LabConfig)} - {
    f.name for f in dataclasses.fields(TileConfig)
}


def variant_source() -> str:
    """grouped_gemm.cu with the lab's code paths restored."""
    return unified_patch.apply(build.kernel_source(), PATCH.read_text(encoding="utf-8"))


def config_of(base: TileConfig, changes: dict[str, int]) -> TileConfig:
    """`base` with `changes`; a LabConfig when a lab field is among them."""
    if LAB_FIELDS.isdisjoint(changes):
        return dataclasses.replace(base, **changes)
    return LabConfig(**{**dataclasses.asdict(base), **changes})


@contextlib.contextmanager
def lab_config(**changes: int) -> Iterator[TileConfig]:
    """Run the packaged kernel with fields of the current device's TileConfig replaced (and the
    lab's patched source where a lab field is set); the default comes back on exit."""
    import torch

    family = arch_family(torch.cuda.get_device_capability())
    base = configs.CONFIGS[family]
    cfg = config_of(base, changes)
    cfg.check()
    source = build.kernel_source
    if isinstance(cfg, LabConfig):
        patched = variant_source()
        build.kernel_source = lambda: patched  # type: ignore[assignment]
    with launch._lock:
        configs.CONFIGS[family] = cfg
        launch._modules.clear()
    try:
        yield cfg
    finally:
        with launch._lock:
            configs.CONFIGS[family] = base
            launch._modules.clear()
        build.kernel_source = source  # type: ignore[assignment]
