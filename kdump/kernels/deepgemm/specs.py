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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from kdump.errors import CannotRunError, ContractViolation
from kdump.kernels.deepgemm import generators as gen_
from kdump.kernels.deepgemm import reference as ref_
from kdump.kernels.deepgemm import routing as routing_
from kdump.kernels.deepgemm.contract import (
    DEFAULT_MK_ALIGNMENT,
    SIGNATURES,
    Call,
    Signature,
    analyse,
    check_routing,
    mk_alignment_from,
)
from kdump.kernels.deepgemm.names import DEEPGEMM_ENTRY_POINTS, deepgemm_id
from kdump.kernels.deepgemm.params import params_of
from kdump.kernels.deepgemm.runtime_bound import RuntimeBound
from kdump.kernels.deepgemm.scales import ScaleFormat, align
from kdump.kernels.plugin import (
    KernelSpec,
    Mutation,
    RecordedArgs,
    RoutingSummary,
    RowsUsed,
    Tolerance,
    Touch,
    Violation,
)
from kdump.text import visible

# Per-element tolerance: 2 bf16 ulps relative, plus the same fraction of the output's rms.
ELEMENT_RTOL = 2.0**-7
FP8_CALC_DIFF = 1e-3  # DeepGEMM's test threshold for FP8 x FP8
BF16_CALC_DIFF = 1e-5  # bf16 inputs: only output rounding and accumulation order differ


class _MGroupedSpec(RuntimeBound, KernelSpec):
    """Shared logic of the m-grouped specs; subclasses name the entry point (`function`), which
    gives their id, aliases, parameters and signature (FP8 or bf16, masked or contiguous, NN or
    NT). FP8 signatures also take packed FP4 operands (the m_grouped_fp4_* aliases)."""

    function: str = ""
    mk_alignment: int = DEFAULT_MK_ALIGNMENT

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.id = deepgemm_id(cls.function)
        cls.aliases = DEEPGEMM_ENTRY_POINTS.get(cls.function, ())
        cls.sig = SIGNATURES[cls.function]
        cls.params = params_of(cls.function)

    sig: Signature = Signature()

    @property
    def fp8(self) -> bool:
        return self.sig.fp8

    @property
    def masked(self) -> bool:
        return self.sig.masked

    @property
    def nn(self) -> bool:
        return self.sig.nn

    # --- settings ------------------------------------------------------------------------------
    def with_settings(self, settings: Mapping[str, Any] | None) -> _MGroupedSpec:
        """A copy that uses the recorded DeepGEMM settings (env["libraries"]["deep_gemm"])."""
        alignment = mk_alignment_from(settings)
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

    # --- the KernelSpec interface --------------------------------------------------------------
    def validate(
        self, bound: Mapping[str, Any], settings: Mapping[str, Any] | None = None
    ) -> list[Violation]:
        """Contract violations. Reads routing values (CPU or GPU) but launches no kernel of the
        library. `settings`: DeepGEMM's recorded global state (mk alignment)."""
        alignment = mk_alignment_from(settings) or self.mk_alignment
        call, out = analyse(self.sig, bound)
        if call is not None:
            check_routing(self.sig, call, alignment, out)
        return out

    def _call(self, bound: Mapping[str, Any]) -> Call:
        call, out = analyse(self.sig, bound)
        if call is None:
            raise ContractViolation(f"{self.id}: {out[0]}" if out else f"{self.id}: invalid call")
        return call

    def _group_rows(self, call: Call) -> list[ref_.GroupRows]:
        if self.masked:
            return ref_.masked_groups(call.routing, call.m)
        if call.psum:
            return ref_.psum_groups(call.routing, self.mk_alignment, call.m)
        return ref_.label_groups(call.routing, call.groups)

    def _operands(self, call: Call) -> tuple[ref_.Operand, ref_.Operand]:
        a = ref_.Operand(call.a, call.sfa, call.gran_a.mn, call.gran_a.k)
        b = ref_.Operand(call.b, call.sfb, call.gran_b.mn, call.gran_b.k)
        return a, b

    def reference(self, bound: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """{"d": expected D}: float32 products of the dequantised operands per group, rounded to
        bf16; rows outside every group are 0. Invalid labels are skipped, counts clamped. A call
        with an epilogue has none: the reference does not model epilogues."""
        why = self.refusal(bound)
        if why:
            raise CannotRunError(why)
        if bound.get("epilogue") is not None:
            raise CannotRunError(
                f"{self.id}: the torch reference does not model the epilogue "
                f"{visible(repr(bound['epilogue']), 80)}; replay with --backend deep_gemm"
            )
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
        call, _ = analyse(self.sig, bound)
        rms = self._output_rms_estimate(call) if call is not None else 0.0
        return Tolerance(calc_diff=cd, atol=ELEMENT_RTOL * rms, rtol=ELEMENT_RTOL)

    def _output_rms_estimate(self, call: Call, sample_rows: int = 256) -> float:
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

    # --- routing: the report and slim ----------------------------------------------------------
    def summarize_routing(self, name: str, values: list[int], args: RecordedArgs) -> RoutingSummary:
        """Labels, psum ends or masked_m per group (kernels/deepgemm/routing.py)."""
        return routing_.summarize(name, values, args, self.mk_alignment)

    def rows_used(self, args: RecordedArgs) -> RowsUsed | None:
        return routing_.rows_used(args, self.mk_alignment)


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


def _sizes_of(spec: _MGroupedSpec, call: Call) -> list[int]:
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


def _routing_for(spec: _MGroupedSpec, call: Call, sizes: Sequence[int]) -> torch.Tensor:
    r = call.routing
    if spec.masked:
        t = torch.tensor(list(sizes), dtype=torch.int32)
    elif call.psum:
        t = gen_.psum_layout(sizes, spec.mk_alignment)
    else:
        t = gen_.label_layout(sizes, spec.mk_alignment, m=call.m)
    return t.to(device=r.device, dtype=r.dtype).reshape(r.shape)


def _mutations(spec: _MGroupedSpec, call: Call, seed: int, count: int) -> Iterator[Mutation]:
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


class MGroupedFP8NTContiguous(_MGroupedSpec):
    function = "m_grouped_fp8_gemm_nt_contiguous"


class MGroupedFP8NNContiguous(_MGroupedSpec):
    function = "m_grouped_fp8_gemm_nn_contiguous"


class MGroupedFP8NTMasked(_MGroupedSpec):
    function = "m_grouped_fp8_gemm_nt_masked"


class MGroupedBF16NTContiguous(_MGroupedSpec):
    function = "m_grouped_bf16_gemm_nt_contiguous"


class MGroupedBF16NNContiguous(_MGroupedSpec):
    function = "m_grouped_bf16_gemm_nn_contiguous"


class MGroupedBF16NTMasked(_MGroupedSpec):
    function = "m_grouped_bf16_gemm_nt_masked"


SPEC_CLASSES: tuple[type[_MGroupedSpec], ...] = (
    MGroupedFP8NTContiguous,
    MGroupedFP8NNContiguous,
    MGroupedFP8NTMasked,
    MGroupedBF16NTContiguous,
    MGroupedBF16NNContiguous,
    MGroupedBF16NTMasked,
)
