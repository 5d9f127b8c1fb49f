"""Torch reference of m-grouped GEMMs: dequantise, multiply in float32 per group, round once.

D[r, n] = bf16( Σ_k deq(A)[r, k] · deq(B[g(r)])[n, k] ), with deq(x) = float32(x) · scale and the
product accumulated by torch.mm in float32. FP8 values and UE8M0 scales are exact in float32; an
SM90 float32 scale is applied with one float32 multiply (relative error ≤ 2^-24 per element).
The only rounding to bf16 is the final one (round-to-nearest-even, torch's `.to(bfloat16)`), so the
result is within one bf16 ulp of the float64 value of the same dequantised product, up to fp32
accumulation error.

Only rows the kernel must write are computed (rows of each group, gathered per group); rows outside
every group stay 0. B is dequantised one group at a time and only for groups that have rows, so a
decode call with most experts empty costs little. Runs on the tensors' device (CPU or CUDA).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from kdump.kernels.deepgemm.scales import (
    align,
    ceil_div,
    is_packed_fp4,
    logical_k,
    unpack_fp4,
    unpack_ue8m0,
)

# A group's rows: a slice when they are one run (the common case), else an index tensor.
RowSelection = slice | torch.Tensor


@dataclass(frozen=True)
class Operand:
    """One operand in NT orientation: data [.., MN, K] (FP8, bf16, or packed FP4 [.., MN, K/2])
    and its scales.

    `scale` is None (bf16), float32 [.., ceil(MN/gran_mn), ceil(K/gran_k)], or packed UE8M0 int32
    [.., MN, ceil(K/(4·gran_k))] (gran_mn must then be 1). Any strides.
    """

    data: torch.Tensor
    scale: torch.Tensor | None = None
    gran_mn: int = 1
    gran_k: int = 128

    def rows(
        self, sel: RowSelection, group: int | None = None, buf: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 dequantised rows `sel` (of group `group` for a 3-D operand): [r, K].

        With `buf` (a float32 workspace of at least r·K elements on the same device) the result
        is written into it, which saves a fresh allocation (and its page faults) per group.
        """
        data = self.data[group] if group is not None else self.data
        src = data[sel]
        if is_packed_fp4(src):
            x = unpack_fp4(src)  # two e2m1 values a byte
        elif buf is not None and buf.numel() >= src.numel():
            x = buf.view(-1)[: src.numel()].view(src.shape).copy_(src)
        else:
            x = src.to(torch.float32)
        if self.scale is None:
            return x
        sc = self.scale[group] if group is not None else self.scale
        r, k = x.shape
        kb = ceil_div(k, self.gran_k)
        if sc.dtype == torch.int32:
            s = unpack_ue8m0(sc[sel], kb)
        elif self.gran_mn == 1:
            s = sc[sel].to(torch.float32)
        else:
            idx = torch.arange(data.shape[0], device=sc.device)[sel] // self.gran_mn
            s = sc.index_select(0, idx).to(torch.float32)
        s = s[:, :kb]
        if k == kb * self.gran_k:
            x.view(r, kb, self.gran_k).mul_(s.unsqueeze(-1))
            return x
        return x.mul_(s.repeat_interleave(self.gran_k, dim=1)[:, :k])


@dataclass(frozen=True)
class GroupRows:
    """Rows of one group: `sel` within A (and D), of A's group `batch` when A is 3-D (masked)."""

    group: int
    sel: RowSelection
    batch: int | None = None


def grouped_gemm(
    a: Operand,
    b: Operand,
    d: torch.Tensor,
    groups: Iterable[GroupRows],
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The reference output: a new tensor shaped like `d` (its dtype, or `out_dtype`, e.g. float32
    to see the sums before rounding; d's device), 0 outside the groups' rows."""
    out = torch.zeros(d.shape, dtype=out_dtype or d.dtype, device=d.device)
    groups = list(groups)
    if not groups:
        return out
    # Workspaces reused by every group: one B group, and A's largest group.
    n, k = b.data.shape[-2], logical_k(b.data)
    b_buf = torch.empty(n * k, dtype=torch.float32, device=b.data.device)
    a_buf = torch.empty(0, dtype=torch.float32, device=a.data.device)
    for gr in groups:
        rows = _count(gr.sel, a.data.shape[-2])
        if rows == 0:
            continue
        if a_buf.numel() < rows * k:
            a_buf = torch.empty(rows * k, dtype=torch.float32, device=a.data.device)
        xa = a.rows(gr.sel, gr.batch, a_buf)
        xb = b.rows(slice(None), gr.group, b_buf)
        res = torch.mm(xa, xb.t())
        target = out[gr.batch] if gr.batch is not None else out
        target[gr.sel] = res.to(out.dtype)
    return out


def _count(sel: RowSelection, length: int) -> int:
    if isinstance(sel, slice):
        return len(range(*sel.indices(length)))
    return int(sel.numel())


# ------------------------------------------------------------------------------------------------
# Group partitions of the three routing layouts


def label_groups(labels: torch.Tensor, num_groups: int) -> list[GroupRows]:
    """Contiguous layout: rows labelled g (0 ≤ g < G) form group g; -1 and out-of-range labels are
    skipped. One host transfer for the whole partition."""
    lab = labels.reshape(-1).to(torch.int64)
    valid = (lab >= 0) & (lab < num_groups)
    idx = torch.nonzero(valid).flatten()
    glab = lab[idx]
    order = torch.argsort(glab, stable=True)
    idx = idx[order]
    counts = torch.bincount(glab, minlength=num_groups)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    nonempty = torch.nonzero(counts).flatten()
    if nonempty.numel() == 0:
        return []
    first = idx[starts[nonempty]]
    last = idx[ends[nonempty] - 1]
    info = torch.stack([nonempty, starts[nonempty], counts[nonempty], first, last]).cpu().tolist()
    out = []
    for g, s, c, f, l_ in zip(*info):
        if l_ - f + 1 == c:  # one run of rows: a slice avoids the gather
            out.append(GroupRows(g, slice(f, l_ + 1)))
        else:
            out.append(GroupRows(g, idx[s : s + c]))
    return out


def psum_bounds(ends: list[int], alignment: int, m: int) -> Iterator[tuple[int, int, int]]:
    """psum layout: group g occupies rows [align(end[g-1], alignment), end[g]) (group 0 from row 0);
    yields (g, start, stop) with stop clamped to m and empty groups skipped."""
    prev = 0
    for g, end in enumerate(ends):
        start = align(prev, alignment) if g > 0 else 0
        stop = min(end, m)
        if stop > start:
            yield g, start, stop
        prev = end


def psum_groups(ends: torch.Tensor, alignment: int, m: int) -> list[GroupRows]:
    return [
        GroupRows(g, slice(s, e))
        for g, s, e in psum_bounds(ends.reshape(-1).cpu().tolist(), alignment, m)
    ]


def masked_groups(masked_m: torch.Tensor, max_m: int) -> list[GroupRows]:
    """Masked layout: the first masked_m[g] rows (clamped to [0, max_m]) of batch g."""
    counts = masked_m.reshape(-1).cpu().tolist()
    return [
        GroupRows(g, slice(0, min(int(c), max_m)), batch=g) for g, c in enumerate(counts) if c > 0
    ]


def psum_row_mask(ends: torch.Tensor, alignment: int, m: int) -> torch.Tensor:
    """Bool [m]: rows inside some psum group."""
    mask = torch.zeros(m, dtype=torch.bool, device=ends.device)
    for _, s, e in psum_bounds(ends.reshape(-1).cpu().tolist(), alignment, m):
        mask[s:e] = True
    return mask
