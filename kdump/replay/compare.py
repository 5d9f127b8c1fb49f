"""Comparing a kernel's outputs: with the reference (DeepGEMM's calc_diff and per-element
tolerances), with the recorded output (bitwise when the setup matches), and with itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kdump.kernels.plugin import Tolerance
from kdump.replay.metrics import calc_diff


def poison(t: torch.Tensor) -> None:
    """Fill an output with all-ones bytes: a NaN in every float format whose bit pattern no
    arithmetic produces (computed NaNs are canonical), so unwritten elements are told apart from
    NaNs computed from poisoned inputs."""
    if t.dtype == torch.bool:
        t.fill_(True)
    else:
        _as_int(t, contiguous=False).fill_(-1)


def unwritten(t: torch.Tensor) -> torch.Tensor:
    """Elements that still hold the poison pattern."""
    if t.dtype == torch.bool:
        return torch.zeros(t.shape, dtype=torch.bool, device=t.device)
    return _as_int(t, contiguous=False) == -1


def _coord(flat_index: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(flat_index % n if n else 0)
        flat_index = flat_index // n if n else 0
    return list(reversed(out))


def _expand_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    return mask.to(like.device).bool().expand(like.shape)


@dataclass
class Comparison:
    ok: bool
    metrics: dict[str, Any]
    message: str


def compare_to_reference(
    actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None, tol: Tolerance
) -> Comparison:
    """Meaningful elements of `actual` against `expected`: calc_diff, max errors, NaN/Inf,
    unwritten elements (poison left), first and worst failing coordinates."""
    m = _expand_mask(mask, actual)
    a = actual.float()
    e = expected.to(actual.device).float()
    av = a[m]
    ev = e[m]
    n = int(av.numel())
    metrics: dict[str, Any] = {"elements": n}
    if n == 0:
        metrics["calc_diff"] = 0.0
        return Comparison(True, metrics, "no meaningful elements")
    # An element that is NaN (or the same infinity) in both agrees: the oracle computed it too.
    # Poison left in an output never does, and a NaN or Inf only one side has is a failure.
    left = unwritten(actual)[m] if actual.dtype.is_floating_point else torch.zeros_like(av).bool()
    same = ~left & (
        (torch.isnan(av) & torch.isnan(ev)) | (torch.isinf(av) & torch.isinf(ev) & (av == ev))
    )
    if actual.dtype.is_floating_point:
        metrics["unwritten"] = int(left.sum())
    nan = torch.isnan(av) & ~same
    inf = torch.isinf(av) & ~same
    metrics["nan"] = int(nan.sum())
    metrics["inf"] = int(inf.sum())
    if bool(same.any()):
        metrics["same_nonfinite"] = int(same.sum())
    finite = torch.isfinite(av) & torch.isfinite(ev)
    diff = (av - ev).abs()
    diff = torch.where(finite, diff, torch.full_like(diff, float("inf")))
    diff = torch.where(same, torch.zeros_like(diff), diff)
    rel = diff / ev.abs().clamp_min(1e-6)
    metrics["max_abs_err"] = float(diff[finite].max()) if bool(finite.any()) else 0.0
    metrics["max_rel_err"] = float(rel[finite].max()) if bool(finite.any()) else 0.0
    # calc_diff over the elements finite on both sides; the others are judged one by one below.
    zero = torch.zeros_like(av)
    metrics["calc_diff"] = calc_diff(torch.where(finite, av, zero), torch.where(finite, ev, zero))
    bad = diff > (tol.atol + tol.rtol * torch.where(finite, ev.abs(), zero))
    n_bad = int(bad.sum())
    metrics["failing_elements"] = n_bad
    coords = m.nonzero()  # meaningful coordinates, in the same order as av
    if n_bad:
        first = int(bad.nonzero()[0, 0])
        worst = int(torch.argmax(torch.where(finite | ~bad, diff, torch.full_like(diff, 1e30))))
        metrics["first_failure"] = _point(coords[first], a, e)
        metrics["worst"] = _point(coords[worst], a, e)
    cd_ok = metrics["calc_diff"] <= tol.calc_diff
    ok = cd_ok and n_bad == 0 and metrics["nan"] == 0 and metrics["inf"] == 0
    if ok:
        msg = f"calc_diff {metrics['calc_diff']:.2e}, max abs err {metrics['max_abs_err']:.3g}"
    elif metrics.get("unwritten"):
        where = metrics.get("first_failure", {}).get("index")
        msg = f"{metrics['unwritten']} of {n} meaningful elements never written; first at {where}"
    elif metrics["nan"] or metrics["inf"]:
        where = metrics.get("first_failure", {}).get("index")
        msg = (
            f"{metrics['nan']} NaN / {metrics['inf']} Inf of {n} meaningful elements (computed "
            f"from a NaN input: an out-of-bounds read of a poisoned halo?); first at {where}"
        )
    else:
        p = metrics.get("first_failure") or metrics.get("worst") or {}
        msg = (
            f"calc_diff {metrics['calc_diff']:.2e} (limit {tol.calc_diff:.0e}), {n_bad} of {n} "
            f"elements out of tolerance; first at {p.get('index')}: got {p.get('actual')}, "
            f"expected {p.get('expected')}"
        )
    return Comparison(ok, metrics, msg)


def _point(coord: torch.Tensor, a: torch.Tensor, e: torch.Tensor) -> dict[str, Any]:
    idx = tuple(int(c) for c in coord)
    return {"index": list(idx), "actual": float(a[idx]), "expected": float(e[idx])}


def bitwise_diff(
    a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, Any] | None:
    """None when the meaningful elements are bit-identical; else count and first difference."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {
            "count": -1,
            "message": f"shape/dtype differ: {tuple(a.shape)} {a.dtype} vs "
            f"{tuple(b.shape)} {b.dtype}",
        }
    b = b.to(a.device)
    ia = _as_int(a)
    ib = _as_int(b)
    neq = ia != ib
    if mask is not None:
        neq &= _expand_mask(mask, a)
    count = int(neq.sum())
    if count == 0:
        return None
    first = neq.nonzero()[0]
    idx = tuple(int(c) for c in first)
    return {
        "count": count,
        "index": list(idx),
        "a": _scalar(a[idx]),
        "b": _scalar(b[idx]),
        "message": f"{count} element(s) differ bitwise; first at {list(idx)}: "
        f"{_scalar(a[idx])} vs {_scalar(b[idx])}",
    }


def _as_int(t: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """Same bytes as a signed integer tensor (a view when `contiguous` is False)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    if t.dtype == int_dtype:
        return t
    return (t.contiguous() if contiguous else t).view(int_dtype)


def _scalar(x: torch.Tensor) -> Any:
    if x.dtype.is_floating_point:
        return float(x.float())
    return x.item()


# Per-dtype (atol, rtol) when a kernel's result is compared with another run of itself or with
# its recorded output: enough for reordered float sums (atomics), far below any real bug.
_DTYPE_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
_FP8_TOLERANCE = (1.25e-1, 1.25e-1)


def default_tolerance(dtype: torch.dtype) -> Tolerance:
    """The dtype-aware tolerance of repeat and recorded comparisons."""
    atol, rtol = _DTYPE_TOLERANCE.get(dtype, _FP8_TOLERANCE)
    return Tolerance(calc_diff=rtol, atol=atol, rtol=rtol)


# A Triton kernel compiled on a GPU against the same launch in Triton's interpreter (numpy on the
# CPU), per output dtype: (rtol, and atol as a fraction of the output's largest finite
# magnitude). The compiled kernel rounds fp32 `tl.dot` inputs to TF32 (10 mantissa bits; the
# interpreter multiplies in full fp32): each product is off by up to 2**-10 relatively, which in
# measured K = 16 .. 16384 dots stays under 5e-4 of the output's largest magnitude; 1e-2 leaves
# room for a second dot fed by the first (attention: QK^T, softmax, PV) and for GPU math
# functions (exp2, rsqrt) that differ from numpy's in the last bits. Float atomics only reorder
# sums (1e-6). fp16 / bf16 outputs add their own rounding: 1e-2 is ten fp16 ulps, 3.2e-2 four
# bf16 ulps; FP8 two ulps of e4m3. A wrong result (a changed constant, an element read from the
# wrong place, a missing mask) is far outside, and integers must be exact.
INTERPRETER_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-2,
    torch.float16: 1e-2,
    torch.bfloat16: 3.2e-2,
}
INTERPRETER_FP8_TOLERANCE = 2.5e-1
INTERPRETER_CALC_DIFF = 1e-3  # DeepGEMM's calc_diff: TF32 dots give about 1e-6


def interpreter_tolerance(reference: torch.Tensor, mask: torch.Tensor | None = None) -> Tolerance:
    """The tolerance between a compiled Triton kernel and Triton's interpreter (see
    INTERPRETER_TOLERANCE), its absolute part scaled by `reference`'s largest finite meaningful
    magnitude."""
    rel = INTERPRETER_TOLERANCE.get(reference.dtype, INTERPRETER_FP8_TOLERANCE)
    values = reference.float()[_expand_mask(mask, reference) & torch.isfinite(reference.float())]
    scale = float(values.abs().max()) if values.numel() else 0.0
    return Tolerance(calc_diff=INTERPRETER_CALC_DIFF, atol=max(rel * scale, 1e-30), rtol=rel)


@dataclass(frozen=True)
class Agreement:
    """Two results of the same inputs: identical, equal within tolerance (a note), or not."""

    ok: bool
    exact: bool
    metrics: dict[str, Any]
    message: str

    @property
    def note(self) -> str:
        """What an `ok` but inexact agreement means."""
        if self.ok and not self.exact:
            return (
                f"not bitwise reproducible: {self.metrics.get('differing', '?')} elements differ, "
                f"max rel {self.metrics.get('max_rel_err', 0.0):.1e} — float atomics?"
            )
        return ""


def agree(
    a: torch.Tensor,
    b: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bitwise: bool = False,
    tol: Tolerance | None = None,
) -> Agreement:
    """`a` against `b` under the tolerance policy: bit-identical meaningful elements agree; other
    float differences agree within `tol` (dtype default) unless `bitwise`; integers are exact."""
    diff = bitwise_diff(a, b, mask)
    if diff is None:
        return Agreement(True, True, {"differing": 0}, "bit-identical")
    exact_only = bitwise or not a.dtype.is_floating_point or diff["count"] < 0
    if exact_only:
        return Agreement(False, False, {"differing": diff["count"], **diff}, diff["message"])
    if tol is None:
        # Reordered sums err relative to the magnitude of the terms, not of the (maybe cancelled)
        # result: the absolute part scales with the output's largest finite magnitude.
        tol = default_tolerance(a.dtype)
        finite = b.float()[_expand_mask(mask, b) & torch.isfinite(b.float())]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        tol = Tolerance(tol.calc_diff, max(tol.atol, tol.rtol * scale), tol.rtol)
    cmp = compare_to_reference(a, b, mask, tol)
    metrics = {**cmp.metrics, "differing": diff["count"], "index": diff["index"]}
    if cmp.ok:
        msg = (
            f"equal within tolerance ({diff['count']} elements differ, max rel "
            f"{metrics['max_rel_err']:.1e})"
        )
        return Agreement(True, False, metrics, msg)
    worst = metrics.get("worst") or metrics.get("first_failure") or {}
    msg = (
        f"{metrics.get('failing_elements', diff['count'])} elements out of tolerance, max error "
        f"{metrics['max_abs_err']:.3g}; worst at {worst.get('index')}: got {worst.get('actual')}, "
        f"expected {worst.get('expected')}"
    )
    if metrics.get("nan") or metrics.get("inf"):
        msg = f"{metrics['nan']} NaN / {metrics['inf']} Inf; " + msg
    return Agreement(False, False, metrics, msg)


def distinct_results(
    runs: list[torch.Tensor], mask: torch.Tensor | None, *, bitwise: bool = False
) -> int:
    """How many results of `runs` differ beyond tolerance (greedy clustering on the first)."""
    reps: list[torch.Tensor] = []
    for r in runs:
        if not any(agree(r, p, mask, bitwise=bitwise).ok for p in reps):
            reps.append(r)
    return len(reps)
