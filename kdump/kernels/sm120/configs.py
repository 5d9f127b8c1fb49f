"""Tile configurations of the packaged grouped GEMM, one table per architecture.

Pure Python so a CPU test can check that every configuration fits its shared-memory budget. The
byte counts mirror grouped_gemm.cu: per stage one A tile (BM x 128 bytes) and one B tile
(BN x 128 bytes) of FP8, plus 1 KiB of slack to align the dynamic shared memory to 1024 bytes
(128-byte TMA swizzle), plus the static shared memory (barriers and the tile decision).
"""

from __future__ import annotations

from dataclasses import dataclass

BK_BYTES = 128  # one 128-element FP8 K block per stage == one scale block == one swizzle row
ALIGN_SLACK = 1024
# Static __shared__ in the kernel: per slot two mbarriers (8 B each) and a StageJob (32 B), plus a
# counter (with padding).
STATIC_SMEM_BASE = 16
STATIC_SMEM_PER_SLOT = 48

# Opt-in maximum shared memory per block in bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SMEM_BUDGET: dict[int, int] = {
    90: 232_448,  # H100 / H200: 227 KiB
    120: 101_376,  # RTX PRO / GeForce Blackwell (sm_120): 99 KiB
}


@dataclass(frozen=True)
class TileConfig:
    """One compile-time tile shape; `defines` are the -D flags grouped_gemm.cu reads."""

    bm: int
    bn: int
    stages: int
    warps_m: int
    warps_n: int
    # Most stages in flight (0: stages). A stage takes only the A rows its tile needs, so with more
    # slots than stages thin (decode) tiles keep more B tiles in flight in the same ring.
    slots: int = 0
    unroll_blocks: int = 2  # warps with at most this many m16 blocks unroll the k32 steps fully
    kk_unroll: int = 4  # unroll of the four k32 steps of warps with more m16 blocks than that
    a_box: int = 16  # rows per A TMA box; a tile loads only the boxes that hold its rows
    l2_promote_b: int = 256  # L2 promotion of the B descriptor in bytes (0: none); host side
    # 1: the psum layout finds a tile's group with lane ballots over chunks of group ends, one
    # round of loads fetched a tile ahead (up to 993 groups); 0: a binary search per tile.
    psum_ballot: int = 1

    @property
    def threads(self) -> int:
        return (self.warps_m * self.warps_n + 4) * 32  # math warps + a producer warpgroup

    @property
    def dynamic_smem(self) -> int:
        return self.stages * (self.bm + self.bn) * BK_BYTES + ALIGN_SLACK

    @property
    def static_smem(self) -> int:
        return STATIC_SMEM_BASE + STATIC_SMEM_PER_SLOT * self.ring_slots

    @property
    def ring_slots(self) -> int:
        return max(self.slots, self.stages)

    @property
    def total_smem(self) -> int:
        return self.dynamic_smem + self.static_smem

    def defines(self) -> list[str]:
        return [
            f"KD_BM={self.bm}",
            f"KD_BN={self.bn}",
            f"KD_STAGES={self.stages}",
            f"KD_SLOTS={self.ring_slots}",
            f"KD_WARPS_M={self.warps_m}",
            f"KD_WARPS_N={self.warps_n}",
            f"KD_KK_UNROLL={self.kk_unroll}",
            f"KD_UNROLL_BLOCKS={self.unroll_blocks}",
            f"KD_A_BOX={self.a_box}",
            f"KD_PSUM_BALLOT={self.psum_ballot}",
        ]

    def check(self) -> None:
        """Raise ValueError when the shape breaks an assumption of the kernel."""
        wm, wn = self.bm // self.warps_m, self.bn // self.warps_n
        if self.bm % self.warps_m or self.bn % self.warps_n or wm % 16 or wn % 16:
            raise ValueError(f"{self}: each math warp needs whole 16x16 sub-tiles")
        if self.bm > 256 or self.bn > 256:
            raise ValueError(f"{self}: a TMA box dimension is at most 256")
        if 128 % self.bn and self.bn % 128:
            raise ValueError(f"{self}: BN must divide or be a multiple of 128 (B scale blocks)")
        if 128 % wn:
            raise ValueError(f"{self}: the fp32 B-scale path needs one scale block per math warp")
        if self.bm % self.a_box or self.a_box % 16:
            raise ValueError(f"{self}: A boxes must be whole m16 blocks that tile BM")
        if self.bm not in (64, 128):
            raise ValueError(f"{self}: M tiles must tile the 128-row group alignment (64 or 128)")
        if self.psum_ballot not in (0, 1):
            raise ValueError(f"{self}: psum_ballot is 0 or 1")
        if self.l2_promote_b not in (0, 64, 128, 256):
            raise ValueError(f"{self}: L2 promotion is 0 (none), 64, 128 or 256 bytes")


# The default configuration per compute-capability major*10+minor family. sm_120's 99 KiB allow
# three 32 KiB stages (five of a thin tile); Hopper's 227 KiB allow seven (twelve thin).
CONFIGS: dict[int, TileConfig] = {
    90: TileConfig(bm=128, bn=128, stages=7, slots=12, warps_m=2, warps_n=4, unroll_blocks=4),
    120: TileConfig(bm=128, bn=128, stages=3, slots=5, warps_m=2, warps_n=4),
}


def arch_family(cc: tuple[int, int]) -> int:
    """Map a compute capability to a key of CONFIGS / SMEM_BUDGET (sm_121 runs sm_120 code)."""
    major, minor = cc
    if major == 9 and minor == 0:
        return 90
    if major == 12:
        return 120
    raise ValueError(
        f"compute capability {major}.{minor} is not supported by the packaged kernel "
        "(it needs sm_90 or sm_120: TMA plus FP8 mma.sync)"
    )


def config_for(cc: tuple[int, int]) -> TileConfig:
    return CONFIGS[arch_family(cc)]
