"""The contract of DeepGEMM's m-grouped GEMM signatures, checked on a call's bound arguments.

Two levels:

* the structural contract every implementation of a signature shares (pairs, dtypes, ranks,
  shapes, majors, A/B TMA alignment, the routing tensor, scalars): `check_operands`. It reads no
  tensor values, so it is safe during CUDA-graph capture. kdump's packaged kernel
  (kernels/sm120), which implements these signatures, checks its calls with it;
* DeepGEMM's own limits on top (K in whole 128-blocks, recipes, its scale and D layouts) and the
  routing values (labels, psum ends, masked_m): what the spec's `validate` adds.

The semantics themselves are described in deepgemm/specs.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kdump.kernels.deepgemm.scales import (
    FP4_BLOCK_K,
    align,
    ceil_div,
    format_of,
    is_packed_fp4,
    logical_k,
    tma_aligned_size,
)
from kdump.kernels.plugin import Violation

DEFAULT_MK_ALIGNMENT = 128
FP8_BLOCK_K = 128  # DeepGEMM's FP8 kernels step K by 128 with one scale per block
TMA_BYTES = 16


@dataclass(frozen=True)
class Signature:
    """What the contract of an m-grouped entry point depends on: FP8 (data, scale) pairs or bf16
    tensors, the masked layout or the contiguous one, B given N-major (NN)."""

    fp8: bool = True
    masked: bool = False
    nn: bool = False

    @property
    def routing(self) -> str:
        """The routing argument's name."""
        return "masked_m" if self.masked else "grouped_layout"


# Canonical entry-point name -> its signature.
SIGNATURES: dict[str, Signature] = {
    "m_grouped_fp8_gemm_nt_contiguous": Signature(),
    "m_grouped_fp8_gemm_nn_contiguous": Signature(nn=True),
    "m_grouped_fp8_gemm_nt_masked": Signature(masked=True),
    "m_grouped_bf16_gemm_nt_contiguous": Signature(fp8=False),
    "m_grouped_bf16_gemm_nn_contiguous": Signature(fp8=False, nn=True),
    "m_grouped_bf16_gemm_nt_masked": Signature(fp8=False, masked=True),
}


@dataclass(frozen=True)
class Granularity:
    mn: int
    k: int


@dataclass(frozen=True)
class Call:
    """A call's tensors in NT orientation with its shapes, once the structure checked out."""

    a: torch.Tensor  # [M, K] or [G, max_m, K]
    sfa: torch.Tensor | None
    b: torch.Tensor  # [G, N, K] (NN: a transposed view)
    sfb: torch.Tensor | None  # NT orientation as well
    d: torch.Tensor
    routing: torch.Tensor
    groups: int
    m: int  # rows of A (contiguous) or max_m (masked)
    n: int
    k: int
    psum: bool
    gran_a: Granularity
    gran_b: Granularity


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _first_true(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


def mk_alignment_from(settings: Mapping[str, Any] | None) -> int | None:
    """The mk alignment DeepGEMM's recorded settings set (None: they set none)."""
    if not settings:
        return None
    for key in ("mk_alignment", "set_mk_alignment_for_contiguous_layout"):
        v = settings.get(key)
        if is_int(v) and v > 0:
            return v
    return None


def check_operands(function: str, bound: Mapping[str, Any]) -> list[Violation]:
    """The structural contract of the entry point `function` (a canonical name of SIGNATURES)
    that every implementation shares, without DeepGEMM's own limits. Reads no tensor values."""
    return analyse(SIGNATURES[function], bound, library_limits=False)[1]


# ------------------------------------------------------------------------------------------------
# Structure


def analyse(
    sig: Signature, bound: Mapping[str, Any], library_limits: bool = True
) -> tuple[Call | None, list[Violation]]:
    """The call in NT orientation when its structure (and with `library_limits` DeepGEMM's own
    limits) checks out, and every violation found. Reads no tensor values."""
    out: list[Violation] = []
    tensors = _tensors(sig, bound, out)
    if tensors is None:
        return None, out
    a, sfa, b, sfb, d, routing = tensors
    an = "a[0]" if sig.fp8 else "a"
    bn = "b[0]" if sig.fp8 else "b"
    if not _check_kinds(sig, an, a, bn, b, d, out, allow_fp4=library_limits):
        return None, out
    fp4 = is_packed_fp4(a) or is_packed_fp4(b)
    if fp4 and sig.nn:
        out.append(Violation(bn, "packed FP4 operands must be K-major: an NN call cannot take one"))
        return None, out
    b_nt = b.transpose(1, 2) if sig.nn else b
    sfb_nt = sfb.transpose(-1, -2) if (sig.nn and sfb is not None and sfb.dim() >= 2) else sfb
    groups, n = b_nt.shape[0], b_nt.shape[1]
    k = logical_k(b_nt)
    m = a.shape[-2]
    _check_shapes(sig, an, a, bn, b, d, groups, n, k, out)
    _check_k_blocks(sig, an, k, fp4, library_limits, out)
    _check_layout(sig, an, a, b_nt, bn, d, out, library_limits)
    _check_routing_tensor(sig, bound, routing, groups, m, out)
    _check_scalars(sig, bound, out)
    gran_a = gran_b = Granularity(1, FP8_BLOCK_K)
    if library_limits and sig.fp8 and sfa is not None and sfb is not None:
        grans = _resolve_recipe(bound, sfa, sfb, out, k if fp4 else None)
        if grans is not None:
            gran_a, gran_b = grans
            g_a = groups if sig.masked else None
            _check_scale("a[1]", sfa, m, k, g_a, gran_a, out, transposed=False)
            _check_scale("b[1]", sfb_nt, n, k, groups, gran_b, out, transposed=sig.nn)
    if out:
        return None, out
    psum = bool(bound.get("use_psum_layout")) and not sig.masked
    return Call(a, sfa, b_nt, sfb_nt, d, routing, groups, m, n, k, psum, gran_a, gran_b), out


def _check_k_blocks(
    sig: Signature, an: str, k: int, fp4: bool, library_limits: bool, out: list[Violation]
) -> None:
    """K in whole scale blocks: 128 for FP8 operands, 32 (the e2m1 scale block) with FP4."""
    if not (library_limits and sig.fp8):
        return
    block = FP4_BLOCK_K if fp4 else FP8_BLOCK_K
    if k % block:
        kind = "FP4" if fp4 else "FP8"
        out.append(
            Violation(
                an,
                f"K = {k} is not a multiple of {block}: DeepGEMM's {kind} kernels step K in "
                f"{block}-element blocks with one scale each",
            )
        )


def _operand(
    sig: Signature, bound: Mapping[str, Any], name: str, out: list[Violation]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    v = bound.get(name)
    if not sig.fp8:
        if not _is_tensor(v):
            out.append(Violation(name, f"expected a bf16 tensor, got {type(v).__name__}"))
            return None, None
        return v, None
    if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(map(_is_tensor, v))):
        out.append(
            Violation(name, f"expected a (data, scale) pair of tensors, got {type(v).__name__}")
        )
        return None, None
    return v[0], v[1]


def _tensors(
    sig: Signature, bound: Mapping[str, Any], out: list[Violation]
) -> tuple[Any, ...] | None:
    """(a, sfa, b, sfb, d, routing), or None when one of them is not a tensor (or pair)."""
    a, sfa = _operand(sig, bound, "a", out)
    b, sfb = _operand(sig, bound, "b", out)
    d = bound.get("d")
    if not _is_tensor(d):
        out.append(Violation("d", f"expected a tensor, got {type(d).__name__}"))
        d = None
    rname = sig.routing
    routing = bound.get(rname)
    if not _is_tensor(routing):
        out.append(Violation(rname, f"expected an int32 tensor, got {type(routing).__name__}"))
        routing = None
    if a is None or b is None or d is None or routing is None:
        return None
    return a, sfa, b, sfb, d, routing


def _check_kinds(
    sig: Signature,
    an: str,
    a: torch.Tensor,
    bn: str,
    b: torch.Tensor,
    d: torch.Tensor,
    out: list[Violation],
    allow_fp4: bool = False,
) -> bool:
    """Dtypes, and ranks (False when a rank is wrong: shapes cannot be read then). With
    `allow_fp4` (DeepGEMM's own contract) an FP8 signature also takes packed FP4 operands."""
    in_dtype = torch.float8_e4m3fn if sig.fp8 else torch.bfloat16
    for name, t in (("a", a), ("b", b)):
        label = f"{name}[0]" if sig.fp8 else name
        if t.dtype != in_dtype and not (sig.fp8 and allow_fp4 and is_packed_fp4(t)):
            also = " or packed FP4 (int8, two e2m1 values a byte)" if sig.fp8 and allow_fp4 else ""
            out.append(Violation(label, f"dtype {_dtype(t)}, expected {str(in_dtype)[6:]}{also}"))
    if d.dtype != torch.bfloat16:
        out.append(Violation("d", f"dtype {_dtype(d)}, expected bfloat16"))
    a_dims = 3 if sig.masked else 2
    ok = True
    for name, t, want in ((an, a, a_dims), (bn, b, 3), ("d", d, a_dims)):
        if t.dim() != want:
            out.append(Violation(name, f"has {t.dim()} dimensions {_shape(t)}, expected {want}"))
            ok = False
    return ok


def _check_shapes(
    sig: Signature,
    an: str,
    a: torch.Tensor,
    bn: str,
    b: torch.Tensor,
    d: torch.Tensor,
    groups: int,
    n: int,
    k: int,
    out: list[Violation],
) -> None:
    m = a.shape[-2]
    b_desc = "[G, K, N]" if sig.nn else "[G, N, K]"
    if logical_k(a) != k:
        packed = " (packed FP4: two values a byte)" if is_packed_fp4(a) or is_packed_fp4(b) else ""
        out.append(
            Violation(
                an,
                f"K = {logical_k(a)} but b has K = {k} ({bn} is {b_desc} {_shape(b)}){packed}",
            )
        )
    want_d = (groups, m, n) if sig.masked else (m, n)
    if tuple(d.shape) != want_d:
        out.append(Violation("d", f"shape {_shape(d)}, expected {list(want_d)} from a and b"))
    if sig.masked and a.shape[0] != groups:
        out.append(Violation(an, f"has {a.shape[0]} groups, b has {groups}"))
    if groups <= 0 or n <= 0 or k <= 0:
        out.append(Violation(bn, f"empty problem: G = {groups}, N = {n}, K = {k}"))


def _check_layout(
    sig: Signature,
    an: str,
    a: torch.Tensor,
    b_nt: torch.Tensor,
    bn: str,
    d: torch.Tensor,
    out: list[Violation],
    library_limits: bool = True,
) -> None:
    """Majors and TMA alignment: 16-byte aligned base addresses and non-unit strides (D's
    only with `library_limits`: DeepGEMM stores D with TMA)."""
    if a.stride(-1) != 1:
        out.append(Violation(an, f"must be K-major (stride(-1) = 1), strides {a.stride()}"))
    if b_nt.stride(-1) != 1 and b_nt.stride(-2) != 1:
        major = "N-major" if sig.nn else "K-major"
        out.append(Violation(bn, f"must be {major}, strides {b_nt.stride()}"))
    if d.stride(-1) != 1:
        out.append(Violation("d", f"must be row-major (stride(-1) = 1), strides {d.stride()}"))
    tma = ((an, a), (bn, b_nt), ("d", d)) if library_limits else ((an, a), (bn, b_nt))
    for name, t in tma:
        esize = t.element_size()
        if t.data_ptr() % TMA_BYTES:
            out.append(
                Violation(name, f"data address {t.data_ptr():#x} is not 16-byte aligned (TMA)")
            )
        for dim in range(t.dim()):
            if t.stride(dim) != 1 and t.shape[dim] > 1 and (t.stride(dim) * esize) % TMA_BYTES:
                out.append(
                    Violation(
                        name,
                        f"stride({dim}) = {t.stride(dim)} elements is not a multiple of 16 "
                        "bytes (TMA)",
                    )
                )
                break


def _check_routing_tensor(
    sig: Signature,
    bound: Mapping[str, Any],
    routing: torch.Tensor,
    groups: int,
    m: int,
    out: list[Violation],
) -> None:
    rname = sig.routing
    per_group = sig.masked or bound.get("use_psum_layout") is True
    want_r, rdesc = (groups, "[G]") if per_group else (m, "[M]")
    if routing.dtype != torch.int32:
        out.append(Violation(rname, f"dtype {_dtype(routing)}, expected int32"))
    if routing.dim() != 1 or routing.numel() != want_r:
        out.append(Violation(rname, f"shape {_shape(routing)}, expected {rdesc} = [{want_r}]"))
    elif not routing.is_contiguous():
        out.append(Violation(rname, "must be contiguous"))


def _check_scalars(sig: Signature, bound: Mapping[str, Any], out: list[Violation]) -> None:
    for name in ("use_psum_layout", "ensure_zero_padding", "disable_ue8m0_cast"):
        if name in bound and not isinstance(bound[name], bool):
            out.append(Violation(name, f"expected a bool, got {bound[name]!r}"))
    if "compiled_dims" in bound and not isinstance(bound["compiled_dims"], str):
        out.append(Violation("compiled_dims", f"expected a str, got {bound['compiled_dims']!r}"))
    if sig.masked:
        em = bound.get("expected_m")
        if not is_int(em) or em <= 0:
            out.append(Violation("expected_m", f"expected a positive int, got {em!r}"))
    em = bound.get("expected_m_for_psum_layout")
    if em is not None and (not is_int(em) or em <= 0):
        out.append(
            Violation("expected_m_for_psum_layout", f"expected None or a positive int, got {em!r}")
        )


# ------------------------------------------------------------------------------------------------
# DeepGEMM's scale recipes and layouts


def _resolve_recipe(
    bound: Mapping[str, Any],
    sfa: torch.Tensor,
    sfb: torch.Tensor,
    out: list[Violation],
    fp4_k: int | None = None,
) -> tuple[Granularity, Granularity] | None:
    """Granularities of A's and B's scales from recipe / recipe_a+recipe_b / the default. A call
    with an FP4 operand (`fp4_k`: its K) and no recipe takes each operand's K granularity from
    its packed scales' width (32 or 128 per scale), as DeepGEMM's FP8xFP4 path does."""
    for name, t in (("a[1]", sfa), ("b[1]", sfb)):
        if format_of(t) is None:
            out.append(
                Violation(
                    name,
                    f"scale dtype {_dtype(t)}: DeepGEMM takes float32 (SM90 format) or int32 "
                    "(packed UE8M0, SM100/SM120 format)",
                )
            )
    if out and any(v.argument in ("a[1]", "b[1]") for v in out):
        return None
    recipe, ra, rb = bound.get("recipe"), bound.get("recipe_a"), bound.get("recipe_b")

    def ints(v: Any, n: int) -> bool:
        return isinstance(v, (tuple, list)) and len(v) == n and all(is_int(x) and x > 0 for x in v)

    if recipe is not None:
        if ra is not None or rb is not None:
            out.append(Violation("recipe", "give either recipe or recipe_a + recipe_b, not both"))
            return None
        if not ints(recipe, 3):
            out.append(Violation("recipe", f"expected (gran_m, gran_n, gran_k), got {recipe!r}"))
            return None
        ga, gb = Granularity(recipe[0], recipe[2]), Granularity(recipe[1], recipe[2])
    elif ra is not None or rb is not None:
        if not (ints(ra, 2) and ints(rb, 2)):
            out.append(
                Violation(
                    "recipe_a",
                    f"recipe_a and recipe_b must both be (gran_mn, gran_k), got {ra!r} and {rb!r}",
                )
            )
            return None
        ga, gb = Granularity(ra[0], ra[1]), Granularity(rb[0], rb[1])
    elif sfb.dtype == torch.int32 and fp4_k is not None:
        ga = Granularity(1, _packed_gran_k(sfa, fp4_k))
        gb = Granularity(1, _packed_gran_k(sfb, fp4_k))
    elif sfb.dtype == torch.int32:
        ga, gb = Granularity(1, 128), Granularity(1, 128)  # 1D1D kernels
    else:
        ga, gb = Granularity(1, 128), Granularity(128, 128)  # SM90 format
    if ga.mn != 1:
        out.append(Violation("recipe", f"A's scales must be per token (gran_m = 1), got {ga.mn}"))
    if gb.mn not in (1, 128):
        out.append(Violation("recipe", f"B's scale granularity in N must be 1 or 128, got {gb.mn}"))
    for g in (ga, gb):
        if g.k not in (32, 128):
            out.append(Violation("recipe", f"scale granularity in K must be 32 or 128, got {g.k}"))
            return None
    return (ga, gb) if not out else None


def _packed_gran_k(sf: torch.Tensor, k: int) -> int:
    """32 when packed UE8M0 scales are exactly as wide as per-32 K blocks need, else 128."""
    if sf.dtype == torch.int32 and sf.dim() >= 2 and sf.shape[-1] == ceil_div(k, 4 * FP4_BLOCK_K):
        return FP4_BLOCK_K
    return FP8_BLOCK_K


def _check_scale(
    name: str,
    sf: torch.Tensor,
    mn: int,
    k: int,
    groups: int | None,
    gran: Granularity,
    out: list[Violation],
    transposed: bool,
) -> None:
    """DeepGEMM's check_sf_layout for the format the dtype says, plus the layout its kernels
    need where DeepGEMM does not copy the scales into shape itself."""
    packed = sf.dtype == torch.int32
    fmt = "packed UE8M0" if packed else "float32"
    per = gran.k * (4 if packed else 1)
    want = [ceil_div(mn, gran.mn), ceil_div(k, per)]
    if groups is not None:
        want.insert(0, groups)
    if transposed:  # NN: report in the orientation the caller gave
        shown = [*want[:-2], want[-1], want[-2]]
        got = list(sf.transpose(-1, -2).shape) if sf.dim() >= 2 else list(sf.shape)
    else:
        shown, got = want, list(sf.shape)
    if list(sf.shape) != want:
        out.append(
            Violation(
                name,
                f"{fmt} scales of shape {got}, expected {shown} (granularity ({gran.mn}, {gran.k})"
                + (", 4 exponents per int32" if packed else "")
                + ")",
            )
        )
        return
    if packed:
        _check_packed_layout(name, sf, mn, groups, gran, want[-1], out)
        return
    if gran.mn == 128:  # B's 128x128 block scales: DeepGEMM uses them as given (no copy)
        nb, kb = want[-2], want[-1]
        row_major = sf.stride(-1) == 1 and sf.stride(-2) == kb
        col_major = sf.stride(-1) == nb and sf.stride(-2) == 1
        dense_groups = groups is None or groups == 1 or sf.stride(-3) == nb * kb
        if not ((row_major or col_major or nb * kb == 1) and dense_groups):
            out.append(
                Violation(
                    name, f"128x128 block scales must be dense per group, strides {sf.stride()}"
                )
            )
    # Per-token float32 scales may have any strides: DeepGEMM copies them into MN-major
    # TMA-aligned layout (get_mn_major_tma_aligned_tensor) before the kernel.


def _check_packed_layout(
    name: str,
    sf: torch.Tensor,
    mn: int,
    groups: int | None,
    gran: Granularity,
    kw: int,
    out: list[Violation],
) -> None:
    """Packed UE8M0 scales: granularity 1 in MN, and DeepGEMM's MN-major TMA-aligned layout."""
    if gran.mn != 1:
        out.append(
            Violation(name, f"packed UE8M0 scales need granularity 1 in MN, recipe says {gran.mn}")
        )
        return
    rows = tma_aligned_size(mn, 4)
    bad = []
    if sf.stride(-2) != 1 and mn != 1:
        bad.append(f"stride(MN) = {sf.stride(-2)}, expected 1 (MN-major)")
    if sf.stride(-1) != rows and kw > 1:
        bad.append(f"stride(K) = {sf.stride(-1)}, expected align(MN, 4) = {rows}")
    if groups is not None and groups > 1 and sf.stride(-3) != sf.stride(-1) * kw:
        bad.append(f"stride(G) = {sf.stride(-3)}, expected {sf.stride(-1) * kw}")
    if bad:
        out.append(
            Violation(name, "packed UE8M0 scales not TMA-aligned MN-major: " + "; ".join(bad))
        )


# ------------------------------------------------------------------------------------------------
# Routing values


def check_routing(sig: Signature, call: Call, alignment: int, out: list[Violation]) -> None:
    """The routing values: masked_m within [0, max_m], labels in range and whole groups per
    tile, psum ends that never fall before a group's aligned start. Reads the values."""
    r = call.routing
    if sig.masked:
        bad = (r < 0) | (r > call.m)
        if bool(bad.any()):
            g = _first_true(bad)
            n_bad = int(bad.sum())
            out.append(
                Violation(
                    "masked_m",
                    f"masked_m[{g}] = {int(r[g])} is outside [0, max_m = {call.m}]"
                    + (f" ({n_bad} groups affected)" if n_bad > 1 else ""),
                )
            )
        return
    if call.psum:
        _check_psum(r, call.m, alignment, out)
    else:
        _check_labels(r, call.groups, alignment, out)


def _list_more(n_bad: int, what: str) -> str:
    return f" ({n_bad} {what} affected)" if n_bad > 1 else ""


def _check_labels(labels: torch.Tensor, groups: int, alignment: int, out: list[Violation]) -> None:
    lab = labels.to(torch.int64)
    bad = (lab < -1) | (lab >= groups)
    if bool(bad.any()):
        r = _first_true(bad)
        out.append(
            Violation(
                "grouped_layout",
                f"row {r} has label {int(lab[r])}, outside [-1, {groups}) for {groups} groups"
                + _list_more(int(bad.sum()), "rows"),
            )
        )
        return
    m = lab.numel()
    if m == 0:
        return
    padded = torch.full((align(m, alignment),), -1, dtype=torch.int64, device=lab.device)
    padded[:m] = lab
    tiles = padded.view(-1, alignment)
    first = tiles[:, :1]
    mixed = (tiles >= 0) & (tiles != first)
    if not bool(mixed.any()):
        return
    r = _first_true(mixed)
    t0 = r // alignment * alignment
    g, f = int(padded[r]), int(padded[t0])
    n_tiles = int(mixed.any(dim=1).sum())
    if f < 0:
        why = "whose first row is padding (-1); DeepGEMM takes a tile's group from its first row"
    else:
        why = f"which belongs to group {f}"
    out.append(
        Violation(
            "grouped_layout",
            f"group {g} has row {r} in the {alignment}-row tile starting at row {t0}, {why}: each "
            f"group must start on a multiple of the mk alignment {alignment}"
            + _list_more(n_tiles, "tiles"),
        )
    )


def _check_psum(ends: torch.Tensor, m: int, alignment: int, out: list[Violation]) -> None:
    e = ends.reshape(-1).cpu().tolist()
    prev = 0
    for g, end in enumerate(e):
        start = align(prev, alignment) if g > 0 else 0
        if end < start:
            out.append(
                Violation(
                    "grouped_layout",
                    f"psum end offset of group {g} is {end}, before the group's aligned start "
                    f"{start} (= align({prev}, {alignment})): offsets must not decrease and an "
                    "empty group's end must equal its aligned start",
                )
            )
            return
        prev = end
    if e and e[-1] > m:
        out.append(
            Violation("grouped_layout", f"last psum end offset {e[-1]} exceeds M = {m} rows of a")
        )
