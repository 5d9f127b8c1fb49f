"""DeepGEMM-compatible entry points of kdump's packaged m-grouped FP8 GEMM.

Semantics implemented (what a replay against this kernel can rely on):

* Contiguous, label layout: `grouped_layout` int32 [M] holds the expert of every row, -1 for
  padding. Each M-tile (128 rows) takes the expert of its FIRST row (groups start on multiples of
  128). A tile whose first label is -1 (or out of range) is skipped and its D rows are left
  untouched, as DeepGEMM's SM120 kernels do (DeepGEMM on SM90 writes zeros there instead). An
  active tile runs up to its LAST row whose label is >= 0: the rows after it are neither loaded,
  computed nor written (left untouched, like skipped tiles), in whole 16-row MMA blocks, which
  is what makes decode batches cheap. A -1 row before a tile's last labelled row is computed
  as A_row x B[expert] and written.
* Contiguous, psum layout (`use_psum_layout=True`): `grouped_layout` int32 [G] holds cumulative END
  rows in the padded row space; group g owns rows [align_up(end[g-1], 128), end[g]) (group 0 starts
  at 0). Only those rows are written; padding rows between groups are left untouched.
* Masked: A [G, max_m, K], D [G, max_m, N], `masked_m` int32 [G]: rows < min(masked_m[g], max_m)
  of group g are computed and written, the others left untouched. `expected_m` is a hint only.
* Scales: float32 tensors select the SM90 format (A per row per 128-K block, B per 128x128 block),
  int32 tensors the packed UE8M0 format of SM100/SM120 (4 exponents per int32, 1x128 granularity on
  both operands). Any strides are accepted for scales (read with ordinary loads); DeepGEMM's
  MN-major TMA-aligned layouts are simply one case. fp32 scales are used as they are, never rounded
  to UE8M0, i.e. like DeepGEMM with `disable_ue8m0_cast=True`.
* All routing metadata is read on the device at every launch; the grid depends on shapes and the
  SM count only (persistent CTAs, one per SM, stride over all M x N tiles and skip inactive ones),
  so the call is safe to capture in a CUDA graph and replay after the metadata changed in place.
  No host synchronisation and no allocation happen in a call (the fault variant allocates its
  workspace on its first call per buffer pair). The first call per device builds (or loads from
  the cubin cache) and loads the module: make it before capturing, as any warm-up does.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, NoReturn

from kdump.errors import ContractViolation

from .build import PackagedKernelError
from .launch import KdParams, encode_tma_3d, get_module, launch_gemm, launch_plan

if TYPE_CHECKING:
    import torch

    from .configs import TileConfig


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def is_available() -> tuple[bool, str]:
    """Whether the packaged kernel can run on the current CUDA device, and if not, why."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible to torch"
    cc = torch.cuda.get_device_capability()
    try:
        from kdump.cuda.nvrtc import check_nvrtc_vs_driver, nvrtc_version

        from .build import cuda_include_dir, cutlass_include_dir
        from .configs import arch_family

        arch_family(cc)
        nvrtc_version()
        cutlass_include_dir()
        cuda_include_dir()
        check_nvrtc_vs_driver()
        import cuda.core  # noqa: F401
    except (PackagedKernelError, ValueError, ImportError) as exc:
        return False, str(exc)
    return True, f"sm_{cc[0]}{cc[1]}a"


# ----------------------------------------------------------------------------- argument checks


def _fail(msg: str) -> NoReturn:
    raise ContractViolation(f"packaged grouped GEMM: {msg}")


def _check_contract(function: str, bound: dict[str, Any]) -> None:
    """The structural contract this kernel shares with every implementation of DeepGEMM's
    signature (kdump.kernels.deepgemm.contract: the contract alone, never DeepGEMM's plug-in)."""
    from kdump.kernels.deepgemm.contract import check_operands

    violations = check_operands(function, bound)
    if violations:
        _fail("; ".join(str(v) for v in violations[:3]))


def _check_cuda(dev: torch.device, tensors: dict[str, torch.Tensor]) -> None:
    if dev.type != "cuda":
        _fail("a must be on a CUDA device")
    for name, t in tensors.items():
        if t.device != dev:
            _fail(f"{name} is on {t.device}, expected {dev}")


def _check_b_k_major(b: torch.Tensor) -> None:
    # The spec also allows N-major B for NT; this kernel's TMA box reads K-major rows.
    if b.stride(-1) != 1:
        _fail(f"b must be K-major (stride(-1) == 1), got strides {b.stride()}")


def _check_d_words(d: torch.Tensor) -> None:
    # bf16 pairs are stored as 4-byte words.
    if d.data_ptr() % 4 or any(d.stride(i) % 2 for i in range(d.dim() - 1)) or d.size(-1) % 2:
        _fail("d needs a 4-byte aligned base, even row strides and an even N")


def _scale_format(sfa: torch.Tensor, sfb: torch.Tensor) -> bool:
    """True for packed UE8M0 (int32), False for SM90 fp32."""
    import torch

    if sfa.dtype == torch.float32 and sfb.dtype == torch.float32:
        return False
    if sfa.dtype == torch.int32 and sfb.dtype == torch.int32:
        return True
    _fail(
        f"scales must both be float32 (SM90 format) or both int32 (packed UE8M0), "
        f"got {sfa.dtype} and {sfb.dtype}"
    )


_MAX_SCALE_STRIDE = 1 << 24


def _check_scale(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(t.shape) != shape:
        _fail(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, expected {device}")
    if any(s < 0 for s in t.stride()):
        _fail(f"{name} has a negative stride {t.stride()}")
    # The kernel steps over a tile's 128 rows / columns of scales with 32-bit offsets.
    if t.size(-2) > 1 and t.stride(-2) >= _MAX_SCALE_STRIDE:
        _fail(f"{name} has a row stride >= 2^24 elements {t.stride()}; make it contiguous")


def _check_recipe(recipe: Any, recipe_a: Any, recipe_b: Any, ue8m0: bool) -> None:
    def norm(r: Any) -> tuple[int, ...] | None:
        return None if r is None else tuple(int(x) for x in r)

    ok_recipe = {None, (1, 1, 128)} if ue8m0 else {None, (1, 128, 128)}
    if norm(recipe) not in ok_recipe:
        _fail(f"recipe {recipe} does not match the {'UE8M0' if ue8m0 else 'fp32'} scales")
    if norm(recipe_a) not in (None, (1, 128)):
        _fail(f"recipe_a {recipe_a} is not supported (only (1, 128))")
    ok_b = {None, (1, 128)} if ue8m0 else {None, (128, 128)}
    if norm(recipe_b) not in ok_b:
        _fail(f"recipe_b {recipe_b} does not match the {'UE8M0' if ue8m0 else 'fp32'} scales")


# ----------------------------------------------------------------------------- launch plumbing


def _params(
    sfa: torch.Tensor, sfb: torch.Tensor, layout: torch.Tensor, d: torch.Tensor, masked: bool
) -> KdParams:
    p = KdParams()
    p.sfa, p.sfb, p.layout, p.d = sfa.data_ptr(), sfb.data_ptr(), layout.data_ptr(), d.data_ptr()
    p.sched = None
    if masked:
        p.sfa_stride_g, p.sfa_stride_m, p.sfa_stride_k = sfa.stride()
        p.d_stride_g, p.d_stride_m = d.stride(0), d.stride(1)
    else:
        p.sfa_stride_g = 0
        p.sfa_stride_m, p.sfa_stride_k = sfa.stride()
        p.d_stride_g, p.d_stride_m = 0, d.stride(0)
    p.sfb_stride_g, p.sfb_stride_n, p.sfb_stride_k = sfb.stride()
    return p


def _tmaps(a: torch.Tensor, b: torch.Tensor, config: TileConfig) -> tuple[Any, Any]:
    k = a.size(-1)
    if a.dim() == 2:
        ta = encode_tma_3d(
            a.data_ptr(),
            (k, a.size(0), 1),
            (a.stride(0), a.stride(0) * a.size(0)),
            (128, config.a_box),
        )
    else:
        ta = encode_tma_3d(
            a.data_ptr(), (k, a.size(1), a.size(0)), (a.stride(1), a.stride(0)), (128, config.a_box)
        )
    tb = encode_tma_3d(
        b.data_ptr(),
        (k, b.size(1), b.size(0)),
        (b.stride(1), b.stride(0)),
        (128, config.bn),
        config.l2_promote_b,
    )
    return ta, tb


def _tiles(
    a_fp8: torch.Tensor, b_fp8: torch.Tensor, p: KdParams, rows: int
) -> tuple[Any, Any, Any]:
    """The device's module, p's tile counts for its configuration (`rows` per group) and the
    A / B descriptors."""
    mod = get_module(a_fp8.device)
    p.m_tiles = _ceil_div(rows, mod.config.bm)
    p.n_tiles = _ceil_div(p.n, mod.config.bn)
    ta, tb = _tmaps(a_fp8, b_fp8, mod.config)
    return mod, ta, tb


def _stream(device: torch.device) -> int:
    import torch

    return torch.cuda.current_stream(device).cuda_stream


def _grid(device: torch.device, total_tiles: int) -> int:
    """Persistent grid: one CTA per SM (384 threads, math warps at 232 registers), never
    more CTAs than tiles. Depends on shapes and the device only, never on routing metadata."""
    import torch

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(0, min(total_tiles, sms))


def _on_device(device: torch.device):  # -> context manager
    """The module's context must be current when launching; torch keeps one per device."""
    import torch

    return torch.cuda.device(device)


# ----------------------------------------------------------------------------- contiguous


def _prepare_contiguous(
    a: Any,
    b: Any,
    d: torch.Tensor,
    grouped_layout: torch.Tensor,
    recipe: Any,
    recipe_a: Any,
    recipe_b: Any,
    use_psum_layout: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool, KdParams]:
    _check_contract(
        "m_grouped_fp8_gemm_nt_contiguous",
        dict(a=a, b=b, d=d, grouped_layout=grouped_layout, use_psum_layout=use_psum_layout),
    )
    (a_fp8, sfa), (b_fp8, sfb) = a, b
    m, k = a_fp8.shape
    g, n, _ = b_fp8.shape
    dev = a_fp8.device
    _check_cuda(dev, {"b": b_fp8, "d": d, "grouped_layout": grouped_layout})
    _check_b_k_major(b_fp8)
    _check_d_words(d)
    ue8m0 = _scale_format(sfa, sfb)
    _check_recipe(recipe, recipe_a, recipe_b, ue8m0)
    if ue8m0:
        _check_scale("a scale", sfa, (m, _ceil_div(k, 512)), dev)
        _check_scale("b scale", sfb, (g, n, _ceil_div(k, 512)), dev)
    else:
        _check_scale("a scale", sfa, (m, _ceil_div(k, 128)), dev)
        _check_scale("b scale", sfb, (g, _ceil_div(n, 128), _ceil_div(k, 128)), dev)
    p = _params(sfa, sfb, grouped_layout, d, masked=False)
    p.m, p.n, p.k, p.num_groups = m, n, k, g
    p.k_blocks = _ceil_div(k, 128)
    return a_fp8, b_fp8, sfa, sfb, ue8m0, p


def m_grouped_fp8_gemm_nt_contiguous(
    a: Any,
    b: Any,
    d: torch.Tensor,
    grouped_layout: torch.Tensor,
    recipe: Any = None,
    recipe_a: Any = None,
    recipe_b: Any = None,
    compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False,
    use_psum_layout: bool = False,
    ensure_zero_padding: bool = True,
    expected_m_for_psum_layout: int | None = None,
) -> None:
    """d[M, N] = a[M, K] @ b[group(m), N, K]^T with block scales; see the module docstring.

    `compiled_dims`, `disable_ue8m0_cast`, `ensure_zero_padding` and `expected_m_for_psum_layout`
    are accepted for signature compatibility; they do not change what this kernel computes.
    """
    a_fp8, b_fp8, _, _, ue8m0, p = _prepare_contiguous(
        a, b, d, grouped_layout, recipe, recipe_a, recipe_b, use_psum_layout
    )
    if expected_m_for_psum_layout is not None and not use_psum_layout:
        _fail("expected_m_for_psum_layout is only meaningful with use_psum_layout=True")
    if p.m == 0:
        return
    mod, ta, tb = _tiles(a_fp8, b_fp8, p, p.m)
    kernel = f"kd_gemm_{'psum' if use_psum_layout else 'labels'}_{'ue8m0' if ue8m0 else 'fp32'}"
    dev = a_fp8.device
    with _on_device(dev):
        launch_gemm(mod, kernel, ta, tb, p, _grid(dev, p.m_tiles * p.n_tiles), _stream(dev))


# ----------------------------------------------------------------------------- masked


def m_grouped_fp8_gemm_nt_masked(
    a: Any,
    b: Any,
    d: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    recipe: Any = None,
    recipe_a: Any = None,
    recipe_b: Any = None,
    compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False,
) -> None:
    """d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g]^T with block scales; other rows untouched."""
    _check_contract(
        "m_grouped_fp8_gemm_nt_masked",
        dict(a=a, b=b, d=d, masked_m=masked_m, expected_m=expected_m),
    )
    (a_fp8, sfa), (b_fp8, sfb) = a, b
    g, max_m, k = a_fp8.shape
    n = b_fp8.shape[1]
    dev = a_fp8.device
    _check_cuda(dev, {"b": b_fp8, "d": d, "masked_m": masked_m})
    _check_b_k_major(b_fp8)
    _check_d_words(d)
    ue8m0 = _scale_format(sfa, sfb)
    _check_recipe(recipe, recipe_a, recipe_b, ue8m0)
    kdiv = 512 if ue8m0 else 128
    _check_scale("a scale", sfa, (g, max_m, _ceil_div(k, kdiv)), dev)
    if ue8m0:
        _check_scale("b scale", sfb, (g, n, _ceil_div(k, 512)), dev)
    else:
        _check_scale("b scale", sfb, (g, _ceil_div(n, 128), _ceil_div(k, 128)), dev)
    if max_m == 0:
        return
    p = _params(sfa, sfb, masked_m, d, masked=True)
    p.m, p.n, p.k, p.num_groups = max_m, n, k, g
    p.k_blocks = _ceil_div(k, 128)
    mod, ta, tb = _tiles(a_fp8, b_fp8, p, max_m)
    kernel = f"kd_gemm_masked_{'ue8m0' if ue8m0 else 'fp32'}"
    with _on_device(dev):
        launch_gemm(mod, kernel, ta, tb, p, _grid(dev, g * p.m_tiles * p.n_tiles), _stream(dev))


# ----------------------------------------------------------------------------- fault injection


class StaleScheduleContiguous:
    """Fault-injection twin of `m_grouped_fp8_gemm_nt_contiguous` (label layout only).

    The bug, deliberately: on the FIRST call for a given (d.data_ptr(), grouped_layout.data_ptr())
    pair a planning kernel compacts the active M-tiles (first label >= 0) into a device workspace
    `[count, tile[0..T), expert[0..T)]` (T = number of M-tiles) and fills the unused slots with
    "unreachable" sentinels: tile T, T+1, ... i.e. tiles just past the end of D. Later calls with
    the same buffers reuse that schedule without replanning. The GEMM kernel recounts the active
    tiles from the CURRENT labels on every launch (count_now) and runs slots [0, count_now) of the
    stale schedule, and it trusts scheduled tiles to lie inside D (no row clamp). Consequences:

    * eager call with fresh buffers: planned from the current labels -> correct;
    * graph capture after an eager warm-up, identical replay: same labels -> correct;
    * replay (or eager re-call) after the labels changed in place:
      - same or fewer active tiles: stale tiles/experts -> wrong rows and values, no OOB;
      - MORE active tiles (count_now > count_planned): slot count_planned + j writes D rows
        [M + 128*j, M + 128*(j+1)) for every N tile, i.e. 128 * N bf16 values per extra tile
        written past d's end (out-of-bounds global stores; A loads there are TMA zero-filled, so
        those rows hold zeros; scale reads are clamped and stay in bounds).

    Never the default: construct it explicitly (`make_faulty_contiguous()`).
    """

    def __init__(self) -> None:
        self._schedules: dict[tuple[int, int, int], torch.Tensor] = {}

    def workspace(self, d: torch.Tensor, grouped_layout: torch.Tensor) -> torch.Tensor | None:
        """The cached schedule for this buffer pair (for inspection in tests), or None."""
        for (dp, lp, _), ws in self._schedules.items():
            if dp == d.data_ptr() and lp == grouped_layout.data_ptr():
                return ws
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        """The contiguous signature: `m_grouped_fp8_gemm_nt_contiguous`'s parameters."""
        bound = _CONTIGUOUS.bind(*args, **kwargs)
        bound.apply_defaults()
        self._run(**bound.arguments)

    def _run(
        self,
        a: Any,
        b: Any,
        d: torch.Tensor,
        grouped_layout: torch.Tensor,
        recipe: Any,
        recipe_a: Any,
        recipe_b: Any,
        use_psum_layout: bool,
        **hints: Any,
    ) -> None:
        import torch

        if use_psum_layout:
            _fail("the stale-schedule fault variant supports the label layout only")
        a_fp8, b_fp8, _, _, ue8m0, p = _prepare_contiguous(
            a, b, d, grouped_layout, recipe, recipe_a, recipe_b, False
        )
        if p.m == 0:
            return
        dev = a_fp8.device
        stream = _stream(dev)
        mod, ta, tb = _tiles(a_fp8, b_fp8, p, p.m)
        key = (d.data_ptr(), grouped_layout.data_ptr(), p.m_tiles)
        ws = self._schedules.get(key)
        kernel = f"kd_gemm_labels_{'ue8m0' if ue8m0 else 'fp32'}_stale"
        with _on_device(dev):
            if ws is None:
                # First call for this buffer pair: plan from the current labels (and never again).
                ws = torch.empty(1 + 2 * p.m_tiles, dtype=torch.int32, device=dev)
                launch_plan(mod, grouped_layout.data_ptr(), p.m_tiles, ws.data_ptr(), stream)
                self._schedules[key] = ws
            p.sched = ws.data_ptr()
            launch_gemm(mod, kernel, ta, tb, p, _grid(dev, p.m_tiles * p.n_tiles), stream)


_CONTIGUOUS = inspect.signature(m_grouped_fp8_gemm_nt_contiguous)


def make_faulty_contiguous() -> StaleScheduleContiguous:
    """A callable with the contiguous signature that carries the stale-schedule bug."""
    return StaleScheduleContiguous()


# DeepGEMM exposes the same function objects under both names.
m_grouped_fp8_fp4_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
m_grouped_fp8_fp4_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
