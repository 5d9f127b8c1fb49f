"""Specs of DeepGEMM's m-grouped GEMM entry points (FP8 with scales, and the bf16 twins).

Signatures mirror DeepGEMM's bindings (superset of the builds we know: recipe_a/recipe_b,
ensure_zero_padding, expected_m_for_psum_layout; older forks call grouped_layout `m_indices`).

Semantics implemented (from DeepGEMM's sources and tests):

* contiguous, label layout: A [M, K], B [G, N, K], D [M, N], grouped_layout int32 [M] with each
  row's group or -1 for padding. The kernel tiles M in blocks of the mk alignment A (128 unless
  set_mk_alignment_for_contiguous_layout changed it) and takes each tile's group from the tile's
  first row, so every group must start on a multiple of A and a tile may not mix groups.
* contiguous, psum layout (use_psum_layout=True): grouped_layout int32 [G] holds cumulative end
  offsets; group g occupies rows [align(end[g-1], A), end[g]) (group 0 starts at row 0). Rows
  between end[g-1] and the aligned start are gaps the kernel neither reads for results nor writes.
  An empty group has end[g] == align(end[g-1]); an end below the aligned start is a violation (the
  kernel's unsigned row count would wrap around).
* masked: A [G, max_m, K], D [G, max_m, N], masked_m int32 [G]; rows < masked_m[g] of batch g.
* NN variants: B is given N-major as [G, K, N] (scales [G, K-blocks, N-blocks] or packed
  [G, K-words, N]); DeepGEMM transposes B and its scales and runs the NT kernel, and so do we.
  (On SM90 DeepGEMM refuses NN FP8, which needs a K-major B; that is an architecture limit, not a
  property of the call, so validate() does not flag it.)

Only the rows above are meaningful: on SM120 padding rows are left untouched, on SM90 they are
written as zeros, so a comparison looks at valid rows only.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kdump.errors import ContractViolation
from kdump.kernels.deepgemm import generators as gen_
from kdump.kernels.deepgemm import reference as ref_
from kdump.kernels.deepgemm.names import (
    DEEPGEMM_ENTRY_POINTS,
    deepgemm_id,
)
from kdump.kernels.deepgemm.scales import (
    ScaleFormat,
    align,
    ceil_div,
    format_of,
    tma_aligned_size,
)

# DeepGEMM's global settings in the environment manifest (the plug-in's state provider),
# re-exported as `library_state`.
from kdump.kernels.deepgemm.state import state as library_state  # noqa: F401
from kdump.kernels.spec import (
    KernelSpec,
    Mutation,
    Param,
    Role,
    Tolerance,
    Touch,
    Violation,
)

DEFAULT_MK_ALIGNMENT = 128
FP8_BLOCK_K = 128  # DeepGEMM's FP8 kernels step K by 128 with one scale per block
TMA_BYTES = 16
MAX_REPORTED = 3  # violations of one kind listed before summarising the rest
# Per-element tolerance: 2 bf16 ulps relative, plus the same fraction of the output's rms.
ELEMENT_RTOL = 2.0**-7
FP8_CALC_DIFF = 1e-3  # DeepGEMM's test threshold for FP8 x FP8
BF16_CALC_DIFF = 1e-5  # bf16 inputs: only output rounding and accumulation order differ


_EMPTY = inspect.Parameter.empty


def _param(name: str, role: Role, default: Any = _EMPTY, aliases: tuple[str, ...] = ()) -> Param:
    return Param(name, role, default, aliases)


_A = _param("a", Role.INPUT)
_B = _param("b", Role.WEIGHT)  # the experts' weights (and their scales)
_D = _param("d", Role.OUTPUT)
_LAYOUT = _param("grouped_layout", Role.ROUTING, aliases=("m_indices",))
_MASKED_M = _param("masked_m", Role.ROUTING)
_EXPECTED_M = _param("expected_m", Role.HINT)
_RECIPES = (
    _param("recipe", Role.SCALAR, None),
    _param("recipe_a", Role.SCALAR, None),
    _param("recipe_b", Role.SCALAR, None),
)
_COMPILED_DIMS = _param("compiled_dims", Role.HINT, "nk")
_NO_CAST = _param("disable_ue8m0_cast", Role.SCALAR, False)
_PSUM = (
    _param("use_psum_layout", Role.SCALAR, False),
    _param("ensure_zero_padding", Role.SCALAR, True),
    _param("expected_m_for_psum_layout", Role.HINT, None),
)


@dataclass(frozen=True)
class _Granularity:
    mn: int
    k: int


@dataclass(frozen=True)
class _Call:
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
    gran_a: _Granularity
    gran_b: _Granularity


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _first_true(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


class _MGroupedSpec(KernelSpec):
    """Shared logic of the m-grouped specs; subclasses set the entry point and three flags."""

    fp8: bool = True
    masked: bool = False
    nn: bool = False
    mk_alignment: int = DEFAULT_MK_ALIGNMENT

    # --- settings ------------------------------------------------------------------------------
    def with_settings(self, settings: Mapping[str, Any] | None) -> _MGroupedSpec:
        """A copy that uses the recorded DeepGEMM settings (env["libraries"]["deep_gemm"])."""
        alignment = _mk_alignment_from(settings)
        if alignment is None or alignment == self.mk_alignment:
            return self
        spec = copy.copy(self)
        spec.mk_alignment = alignment
        return spec

    def library(self) -> str | None:
        return "deep_gemm"

    def has_reference(self) -> bool:
        return True

    def touches(self, bound: Mapping[str, Any]) -> tuple[Touch, ...]:
        """A's rows (and its scales' rows) that the routing names: padding rows (label -1),
        rows at or past masked_m[g], psum gaps are never read."""
        if self.masked:
            return (Touch("a", "masked", "masked_m", row_dims=2),)
        if bound.get("use_psum_layout") is True:
            return (Touch("a", "psum", "grouped_layout", alignment=self.mk_alignment),)
        return (Touch("a", "labels", "grouped_layout"),)

    # --- structure -----------------------------------------------------------------------------
    def _operand(
        self, bound: Mapping[str, Any], name: str, out: list[Violation]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        v = bound.get(name)
        if not self.fp8:
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

    def check_operands(self, bound: Mapping[str, Any]) -> list[Violation]:
        """The structural contract every implementation of this signature shares (pairs, dtypes,
        ranks, shapes, majors, A/B TMA alignment, the routing tensor, scalars), without
        DeepGEMM's own limits (K in whole 128-blocks, recipes, its scale and D layouts). Reads
        no tensor values, so it is safe during CUDA-graph capture."""
        return self._analyse(bound, self.mk_alignment, library_limits=False)[1]

    def _analyse(
        self, bound: Mapping[str, Any], alignment: int, library_limits: bool = True
    ) -> tuple[_Call | None, list[Violation]]:
        out: list[Violation] = []
        a, sfa = self._operand(bound, "a", out)
        b, sfb = self._operand(bound, "b", out)
        d = bound.get("d")
        if not _is_tensor(d):
            out.append(Violation("d", f"expected a tensor, got {type(d).__name__}"))
            d = None
        rname = "masked_m" if self.masked else "grouped_layout"
        routing = bound.get(rname)
        if not _is_tensor(routing):
            out.append(Violation(rname, f"expected an int32 tensor, got {type(routing).__name__}"))
            routing = None
        if a is None or b is None or d is None or routing is None:
            return None, out

        in_dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        for name, t in (("a", a), ("b", b)):
            label = f"{name}[0]" if self.fp8 else name
            if t.dtype != in_dtype:
                out.append(Violation(label, f"dtype {_dtype(t)}, expected {str(in_dtype)[6:]}"))
        if d.dtype != torch.bfloat16:
            out.append(Violation("d", f"dtype {_dtype(d)}, expected bfloat16"))

        a_dims = 3 if self.masked else 2
        an = "a[0]" if self.fp8 else "a"
        bn = "b[0]" if self.fp8 else "b"
        ok = True
        for name, t, want in ((an, a, a_dims), (bn, b, 3), ("d", d, a_dims)):
            if t.dim() != want:
                out.append(
                    Violation(name, f"has {t.dim()} dimensions {_shape(t)}, expected {want}")
                )
                ok = False
        if not ok:
            return None, out

        b_nt = b.transpose(1, 2) if self.nn else b
        sfb_nt = sfb.transpose(-1, -2) if (self.nn and sfb is not None and sfb.dim() >= 2) else sfb
        groups, n, k = b_nt.shape
        m = a.shape[-2]
        b_desc = "[G, K, N]" if self.nn else "[G, N, K]"
        if a.shape[-1] != k:
            out.append(
                Violation(an, f"K = {a.shape[-1]} but b has K = {k} ({bn} is {b_desc} {_shape(b)})")
            )
        want_d = (groups, m, n) if self.masked else (m, n)
        if tuple(d.shape) != want_d:
            out.append(Violation("d", f"shape {_shape(d)}, expected {list(want_d)} from a and b"))
        if self.masked and a.shape[0] != groups:
            out.append(Violation(an, f"has {a.shape[0]} groups, b has {groups}"))
        if groups <= 0 or n <= 0 or k <= 0:
            out.append(Violation(bn, f"empty problem: G = {groups}, N = {n}, K = {k}"))
        if library_limits and self.fp8 and k % FP8_BLOCK_K:
            out.append(
                Violation(
                    an,
                    f"K = {k} is not a multiple of {FP8_BLOCK_K}: DeepGEMM's FP8 kernels step K in "
                    f"{FP8_BLOCK_K}-element blocks with one scale each",
                )
            )
        self._check_layout(an, a, b_nt, bn, d, out, library_limits)

        per_group = self.masked or bound.get("use_psum_layout") is True
        want_r, rdesc = (groups, "[G]") if per_group else (m, "[M]")
        if routing.dtype != torch.int32:
            out.append(Violation(rname, f"dtype {_dtype(routing)}, expected int32"))
        if routing.dim() != 1 or routing.numel() != want_r:
            out.append(Violation(rname, f"shape {_shape(routing)}, expected {rdesc} = [{want_r}]"))
        elif not routing.is_contiguous():
            out.append(Violation(rname, "must be contiguous"))

        self._check_scalars(bound, out)
        gran_a = _Granularity(1, FP8_BLOCK_K)
        gran_b = _Granularity(1, FP8_BLOCK_K)
        if library_limits and self.fp8 and sfa is not None and sfb is not None:
            grans = _resolve_recipe(bound, sfa, sfb, out)
            if grans is not None:
                gran_a, gran_b = grans
                g_a = groups if self.masked else None
                _check_scale("a[1]", sfa, m, k, g_a, gran_a, out, transposed=False)
                _check_scale("b[1]", sfb_nt, n, k, groups, gran_b, out, transposed=self.nn)
        if out:
            return None, out
        call = _Call(
            a=a,
            sfa=sfa,
            b=b_nt,
            sfb=sfb_nt,
            d=d,
            routing=routing,
            groups=groups,
            m=m,
            n=n,
            k=k,
            psum=bool(bound.get("use_psum_layout")) and not self.masked,
            gran_a=gran_a,
            gran_b=gran_b,
        )
        return call, out

    def _check_layout(
        self,
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
            major = "N-major" if self.nn else "K-major"
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

    def _check_scalars(self, bound: Mapping[str, Any], out: list[Violation]) -> None:
        for name in ("use_psum_layout", "ensure_zero_padding", "disable_ue8m0_cast"):
            if name in bound and not isinstance(bound[name], bool):
                out.append(Violation(name, f"expected a bool, got {bound[name]!r}"))
        if "compiled_dims" in bound and not isinstance(bound["compiled_dims"], str):
            out.append(
                Violation("compiled_dims", f"expected a str, got {bound['compiled_dims']!r}")
            )
        if self.masked:
            em = bound.get("expected_m")
            if not _is_int(em) or em <= 0:
                out.append(Violation("expected_m", f"expected a positive int, got {em!r}"))
        em = bound.get("expected_m_for_psum_layout")
        if em is not None and (not _is_int(em) or em <= 0):
            out.append(
                Violation(
                    "expected_m_for_psum_layout", f"expected None or a positive int, got {em!r}"
                )
            )

    # --- routing values ------------------------------------------------------------------------
    def _check_routing(self, call: _Call, alignment: int, out: list[Violation]) -> None:
        r = call.routing
        if self.masked:
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

    # --- the KernelSpec interface --------------------------------------------------------------
    def validate(
        self, bound: Mapping[str, Any], settings: Mapping[str, Any] | None = None
    ) -> list[Violation]:
        """Contract violations. Reads routing values (CPU or GPU) but launches no kernel of the
        library. `settings`: DeepGEMM's recorded global state (mk alignment)."""
        alignment = _mk_alignment_from(settings) or self.mk_alignment
        call, out = self._analyse(bound, alignment)
        if call is not None:
            self._check_routing(call, alignment, out)
        return out

    def _call(self, bound: Mapping[str, Any]) -> _Call:
        call, out = self._analyse(bound, self.mk_alignment)
        if call is None:
            raise ContractViolation(f"{self.id}: {out[0]}" if out else f"{self.id}: invalid call")
        return call

    def _group_rows(self, call: _Call) -> list[ref_.GroupRows]:
        if self.masked:
            return ref_.masked_groups(call.routing, call.m)
        if call.psum:
            return ref_.psum_groups(call.routing, self.mk_alignment, call.m)
        return ref_.label_groups(call.routing, call.groups)

    def _operands(self, call: _Call) -> tuple[ref_.Operand, ref_.Operand]:
        a = ref_.Operand(call.a, call.sfa, call.gran_a.mn, call.gran_a.k)
        b = ref_.Operand(call.b, call.sfb, call.gran_b.mn, call.gran_b.k)
        return a, b

    def reference(self, bound: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """{"d": expected D}: float32 products of the dequantised operands per group, rounded to
        bf16; rows outside every group are 0. Invalid labels are skipped, counts clamped."""
        call = self._call(bound)
        a, b = self._operands(call)
        return {"d": ref_.grouped_gemm(a, b, call.d, self._group_rows(call))}

    def meaningful(self, bound: Mapping[str, Any], output: str) -> torch.Tensor | None:
        if output != "d":
            return None
        call = self._call(bound)
        r = call.routing
        if self.masked:
            rows = torch.arange(call.m, device=r.device)
            return (rows.unsqueeze(0) < r.to(torch.int64).unsqueeze(1)).unsqueeze(-1)
        if call.psum:
            return ref_.psum_row_mask(r, self.mk_alignment, call.m).unsqueeze(-1)
        return ((r >= 0) & (r < call.groups)).unsqueeze(-1)

    def tolerance(self, bound: Mapping[str, Any]) -> Tolerance:
        """calc_diff ≤ 1e-3 for FP8 (DeepGEMM's threshold), 1e-5 for bf16 inputs; per element
        |x - y| ≤ atol + rtol·|y| with rtol = 2^-7 (two bf16 ulps: both sides round an fp32 sum
        to bf16, and sums differ in accumulation order) and atol = 2^-7 · an estimate of the
        output's rms (so values that cancel to near zero are not held to a relative bound; a wrong
        group or row is off by about the rms and still fails)."""
        cd = FP8_CALC_DIFF if self.fp8 else BF16_CALC_DIFF
        call, _ = self._analyse(bound, self.mk_alignment)
        rms = self._output_rms_estimate(call) if call is not None else 0.0
        return Tolerance(calc_diff=cd, atol=ELEMENT_RTOL * rms, rtol=ELEMENT_RTOL)

    def _output_rms_estimate(self, call: _Call, sample_rows: int = 256) -> float:
        """sqrt(K) · rms(deq A rows) · rms(deq B of one group), from a bounded sample."""
        groups = self._group_rows(call)
        if not groups:
            return 0.0
        a, b = self._operands(call)
        xa = []
        left = sample_rows
        for gr in groups:
            rows = a.rows(gr.sel, gr.batch)[:left]
            xa.append(rows)
            left -= rows.shape[0]
            if left <= 0:
                break
        xa_t = torch.cat(xa)
        xb = b.rows(slice(None), groups[0].group)
        rms_a = float(xa_t.pow(2).mean().sqrt())
        rms_b = float(xb.pow(2).mean().sqrt())
        return float(call.k) ** 0.5 * rms_a * rms_b

    # --- synthesis -----------------------------------------------------------------------------
    def generate(
        self, seed: int = 0, device: str = "cpu", **shape: Any
    ) -> tuple[list[Any], dict[str, Any]]:
        """A DeepGEMM-test-like call. Shape keywords (defaults): num_groups (4), n (256), k (512),
        expected_m (64), group_sizes (drawn), empty_groups (0), scale_format ("ue8m0" or "fp32"),
        alignment (the spec's mk alignment), use_psum_layout (False, contiguous only), max_m
        (masked; fits the largest group), d_pad_cols (0: D a strided view when > 0), d_fill
        (None: torch.empty), explicit_recipe (False: pass recipe= matching the format)."""
        return _generate(self, seed, device, dict(shape))

    def mutations(
        self, bound: Mapping[str, Any], seed: int = 0, count: int = 0
    ) -> Iterator[Mutation]:
        """New routing metadata of the same shape, dtype and device, each itself valid:
        permuted, all_empty, one_hot, max_skew, align_minus_one, align_plus_one (masked also
        all_full), then `count` random draws."""
        call = self._call(bound)
        yield from _mutations(self, call, seed, count)


# ------------------------------------------------------------------------------------------------
# Checks


def _mk_alignment_from(settings: Mapping[str, Any] | None) -> int | None:
    if not settings:
        return None
    for key in ("mk_alignment", "set_mk_alignment_for_contiguous_layout"):
        v = settings.get(key)
        if _is_int(v) and v > 0:
            return v
    return None


def _resolve_recipe(
    bound: Mapping[str, Any], sfa: torch.Tensor, sfb: torch.Tensor, out: list[Violation]
) -> tuple[_Granularity, _Granularity] | None:
    """Granularities of A's and B's scales from recipe / recipe_a+recipe_b / the default."""
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
        return isinstance(v, (tuple, list)) and len(v) == n and all(_is_int(x) and x > 0 for x in v)

    if recipe is not None:
        if ra is not None or rb is not None:
            out.append(Violation("recipe", "give either recipe or recipe_a + recipe_b, not both"))
            return None
        if not ints(recipe, 3):
            out.append(Violation("recipe", f"expected (gran_m, gran_n, gran_k), got {recipe!r}"))
            return None
        ga, gb = _Granularity(recipe[0], recipe[2]), _Granularity(recipe[1], recipe[2])
    elif ra is not None or rb is not None:
        if not (ints(ra, 2) and ints(rb, 2)):
            out.append(
                Violation(
                    "recipe_a",
                    f"recipe_a and recipe_b must both be (gran_mn, gran_k), got {ra!r} and {rb!r}",
                )
            )
            return None
        ga, gb = _Granularity(ra[0], ra[1]), _Granularity(rb[0], rb[1])
    elif sfb.dtype == torch.int32:
        ga, gb = _Granularity(1, 128), _Granularity(1, 128)  # 1D1D kernels
    else:
        ga, gb = _Granularity(1, 128), _Granularity(128, 128)  # SM90 format
    if ga.mn != 1:
        out.append(Violation("recipe", f"A's scales must be per token (gran_m = 1), got {ga.mn}"))
    if gb.mn not in (1, 128):
        out.append(Violation("recipe", f"B's scale granularity in N must be 1 or 128, got {gb.mn}"))
    for g in (ga, gb):
        if g.k not in (32, 128):
            out.append(Violation("recipe", f"scale granularity in K must be 32 or 128, got {g.k}"))
            return None
    return (ga, gb) if not out else None


def _check_scale(
    name: str,
    sf: torch.Tensor,
    mn: int,
    k: int,
    groups: int | None,
    gran: _Granularity,
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
        if gran.mn != 1:
            out.append(
                Violation(
                    name, f"packed UE8M0 scales need granularity 1 in MN, recipe says {gran.mn}"
                )
            )
            return
        rows = tma_aligned_size(mn, 4)
        kw = want[-1]
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


# ------------------------------------------------------------------------------------------------
# Generation


def _generate(
    spec: _MGroupedSpec, seed: int, device: str, shape: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    g = int(shape.pop("num_groups", 4))
    n = int(shape.pop("n", 256))
    k = int(shape.pop("k", 512))
    expected_m = int(shape.pop("expected_m", 64))
    sizes = shape.pop("group_sizes", None)
    empty = int(shape.pop("empty_groups", 0))
    fmt = ScaleFormat(shape.pop("scale_format", "ue8m0"))
    alignment = int(shape.pop("alignment", spec.mk_alignment))
    psum = bool(shape.pop("use_psum_layout", False))
    max_m = shape.pop("max_m", None)
    pad_cols = int(shape.pop("d_pad_cols", 0))
    fill = shape.pop("d_fill", None)
    explicit_recipe = bool(shape.pop("explicit_recipe", False))
    if shape:
        raise TypeError(f"{spec.id}: unknown shape keywords {sorted(shape)}")
    if psum and spec.masked:
        raise TypeError(f"{spec.id}: use_psum_layout applies to the contiguous layout only")

    rng = torch.Generator().manual_seed(seed)
    if sizes is None:
        sizes = gen_.draw_group_sizes(rng, g, expected_m, empty)
    sizes = [int(s) for s in sizes]
    if len(sizes) != g:
        raise ValueError(f"group_sizes has {len(sizes)} entries for {g} groups")

    if spec.masked:
        max_m = int(max_m) if max_m is not None else align(max([*sizes, 1]), 64)
        if max(sizes) > max_m:
            raise ValueError(f"a group of {max(sizes)} rows does not fit max_m = {max_m}")
        a = gen_.normal(rng, g, max_m, k)
        row = torch.arange(max_m)
        valid = row.unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)
        routing = torch.tensor(sizes, dtype=torch.int32)
        d_shape: tuple[int, ...] = (g, max_m, n)
    else:
        if psum:
            routing = gen_.psum_layout(sizes, alignment)
            m = gen_.psum_rows(routing.tolist(), alignment)
            valid = ref_.psum_row_mask(routing, alignment, m)
        else:
            routing = gen_.label_layout(sizes, alignment)
            m = routing.numel()
            valid = routing >= 0
        a = gen_.normal(rng, m, k)
        d_shape = (m, n)
    a = a * valid.unsqueeze(-1)  # padding rows are zero, as in DeepGEMM's tests
    b = gen_.normal(rng, g, n, k)

    if spec.fp8:
        q = gen_.quantize_pair(a, b, fmt)
        sfa, sfb = gen_.format_scales(q, fmt, n)
        a_data, b_data = q.a, q.b
    else:
        a_data, b_data = a.to(torch.bfloat16), b.to(torch.bfloat16)
        sfa = sfb = None
    if spec.nn:
        b_data = b_data.transpose(1, 2).contiguous()  # N-major [G, K, N]
        if sfb is not None:
            sfb = sfb.transpose(-1, -2)  # DeepGEMM transposes it back to the NT layout

    dev = torch.device(device)
    a_data, b_data, routing = a_data.to(dev), b_data.to(dev), routing.to(dev)
    d = gen_.empty_output(d_shape, dev, pad_cols, fill)
    if spec.fp8:
        assert sfa is not None and sfb is not None
        sfa, sfb = _to_device_keep_strides(sfa, dev), _to_device_keep_strides(sfb, dev)
        args: list[Any] = [(a_data, sfa), (b_data, sfb), d, routing]
    else:
        args = [a_data, b_data, d, routing]
    kwargs: dict[str, Any] = {}
    if spec.masked:
        args.append(expected_m)
    elif psum:
        kwargs["use_psum_layout"] = True
    if spec.fp8 and explicit_recipe:
        kwargs["recipe"] = (1, 1, 128) if fmt == ScaleFormat.UE8M0 else (1, 128, 128)
    return args, kwargs


def _to_device_keep_strides(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Move a strided view with its exact strides (padding included)."""
    if t.device == dev:
        return t
    base = torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=dev)
    flat = torch.as_strided(t, (base.numel(),), (1,), 0)
    base.copy_(flat)
    return torch.as_strided(base, t.shape, t.stride(), t.storage_offset())


# ------------------------------------------------------------------------------------------------
# Mutations


def _sizes_of(spec: _MGroupedSpec, call: _Call) -> list[int]:
    r = call.routing
    if spec.masked:
        return [min(max(int(x), 0), call.m) for x in r.cpu().tolist()]
    if call.psum:
        sizes = [0] * call.groups
        for g, s, e in ref_.psum_bounds(r.cpu().tolist(), spec.mk_alignment, call.m):
            sizes[g] = e - s
        return sizes
    lab = r.to(torch.int64)
    lab = lab[(lab >= 0) & (lab < call.groups)]
    return torch.bincount(lab, minlength=call.groups).cpu().tolist()


def _fit(sizes: Sequence[int], alignment: int, capacity: int) -> list[int]:
    """Greedy: each group in turn keeps min(size, room left); later groups may end up empty."""
    out = []
    left = capacity
    for s in sizes:
        take = max(0, min(s, left))
        out.append(take)
        left -= align(take, alignment)
    return out


def _routing_for(spec: _MGroupedSpec, call: _Call, sizes: Sequence[int]) -> torch.Tensor:
    r = call.routing
    if spec.masked:
        t = torch.tensor(list(sizes), dtype=torch.int32)
    elif call.psum:
        t = gen_.psum_layout(sizes, spec.mk_alignment)
    else:
        t = gen_.label_layout(sizes, spec.mk_alignment, m=call.m)
    return t.to(device=r.device, dtype=r.dtype).reshape(r.shape)


def _mutations(spec: _MGroupedSpec, call: _Call, seed: int, count: int) -> Iterator[Mutation]:
    rng = torch.Generator().manual_seed(seed)
    g = call.groups
    a = spec.mk_alignment
    name = "masked_m" if spec.masked else "grouped_layout"
    if spec.masked:
        per_group = call.m  # every group holds up to max_m rows of its own

        def fit(sizes: Sequence[int]) -> list[int]:
            return [max(0, min(int(s), per_group)) for s in sizes]

        capacity = per_group
    else:
        capacity = call.m // a * a if call.m >= a else call.m

        def fit(sizes: Sequence[int]) -> list[int]:
            return _fit(sizes, a, capacity)

    current = _sizes_of(spec, call)
    perm = torch.randperm(g, generator=rng).tolist()
    permuted = [current[i] for i in perm]
    if permuted == current and g > 1:
        permuted = current[1:] + current[:1]
    hot = int(torch.randint(g, (1,), generator=rng))
    one_hot = [0] * g
    one_hot[hot] = capacity
    if spec.masked:
        skew = [1] * g
        skew[hot] = capacity
    else:
        others = min(g - 1, max(0, (capacity - a) // a))
        skew = [0] * g
        order = [hot] + [i for i in range(g) if i != hot]
        for i in order[1 : 1 + others]:
            skew[i] = 1
        skew[hot] = capacity - others * a
    cases: list[tuple[str, list[int]]] = [
        ("permuted", permuted),
        ("all_empty", [0] * g),
        ("one_hot", one_hot),
        ("max_skew", skew),
        ("align_minus_one", [a - 1] * g),
        ("align_plus_one", [a + 1] * g),
    ]
    if spec.masked:
        cases.append(("all_full", [per_group] * g))
    nonempty = [s for s in current if s > 0]
    mean = max(1, sum(nonempty) // len(nonempty)) if nonempty else max(1, capacity // max(g, 1))
    for i in range(count):
        empties = int(torch.randint(g + 1, (1,), generator=rng)) // 4
        cases.append((f"random_{i}", gen_.draw_group_sizes(rng, g, mean, empties)))
    for label, sizes in cases:
        yield Mutation(label, {name: _routing_for(spec, call, fit(sizes))})


# ------------------------------------------------------------------------------------------------
# The entry points


def _aliases(name: str) -> tuple[str, ...]:
    return DEEPGEMM_ENTRY_POINTS.get(name, ())


class MGroupedFP8NTContiguous(_MGroupedSpec):
    id = deepgemm_id("m_grouped_fp8_gemm_nt_contiguous")
    aliases = _aliases("m_grouped_fp8_gemm_nt_contiguous")
    params = (_A, _B, _D, _LAYOUT, *_RECIPES, _COMPILED_DIMS, _NO_CAST, *_PSUM)


class MGroupedFP8NNContiguous(_MGroupedSpec):
    nn = True
    id = deepgemm_id("m_grouped_fp8_gemm_nn_contiguous")
    aliases = _aliases("m_grouped_fp8_gemm_nn_contiguous")
    params = (_A, _B, _D, _LAYOUT, *_RECIPES, _COMPILED_DIMS, _NO_CAST, *_PSUM)


class MGroupedFP8NTMasked(_MGroupedSpec):
    masked = True
    id = deepgemm_id("m_grouped_fp8_gemm_nt_masked")
    aliases = _aliases("m_grouped_fp8_gemm_nt_masked")
    params = (_A, _B, _D, _MASKED_M, _EXPECTED_M, *_RECIPES, _COMPILED_DIMS, _NO_CAST)


class MGroupedBF16NTContiguous(_MGroupedSpec):
    fp8 = False
    id = deepgemm_id("m_grouped_bf16_gemm_nt_contiguous")
    aliases = _aliases("m_grouped_bf16_gemm_nt_contiguous")
    params = (_A, _B, _D, _LAYOUT, _COMPILED_DIMS, *_PSUM)


class MGroupedBF16NNContiguous(_MGroupedSpec):
    fp8 = False
    nn = True
    id = deepgemm_id("m_grouped_bf16_gemm_nn_contiguous")
    aliases = _aliases("m_grouped_bf16_gemm_nn_contiguous")
    params = (_A, _B, _D, _LAYOUT, _COMPILED_DIMS, *_PSUM)


class MGroupedBF16NTMasked(_MGroupedSpec):
    fp8 = False
    masked = True
    id = deepgemm_id("m_grouped_bf16_gemm_nt_masked")
    aliases = _aliases("m_grouped_bf16_gemm_nt_masked")
    params = (_A, _B, _D, _MASKED_M, _EXPECTED_M, _COMPILED_DIMS)


SPEC_CLASSES: tuple[type[_MGroupedSpec], ...] = (
    MGroupedFP8NTContiguous,
    MGroupedFP8NNContiguous,
    MGroupedFP8NTMasked,
    MGroupedBF16NTContiguous,
    MGroupedBF16NNContiguous,
    MGroupedBF16NTMasked,
)
