"""Out-of-bounds reads named by the halo differential, on any device, in eager and graph mode.

Every storage sits between poisoned halos (kdump.replay.halo). After a run the call runs once more
with the second poison in every halo: output elements that change read a halo, unless a run
repeating either poison changes them too (nondeterminism, not a read). One run per storage and side
with only that halo changed names the argument read out of bounds (which memcheck may miss: TMA
loads), and runs that change only the halo bytes beyond the nearest N bound how far the read went
(to the element). The elements found are excluded from the mismatch and repeat verdicts of the same
run: the over-read is the verdict, a production mismatch there its symptom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kdump.bundle import MaterializedCall
from kdump.bundle.materialize import Allocation
from kdump.format.dtypes import dtype_from_name
from kdump.format.records import TensorRecord
from kdump.replay import halo
from kdump.replay.compare import _as_int, _expand_mask, default_tolerance
from kdump.replay.session import Session
from kdump.text import exact_bytes

# run(step) restores the inputs, poisons the outputs, runs the call once with the halos as they
# are and returns the outputs (None: it failed, a finding already says how).
Run = Callable[[str], "dict[str, torch.Tensor] | None"]


# Confirmation rounds of a single-halo trial when the controls showed nondeterminism (see
# `differential`): 0.25 ** 10 is about 1e-6 per element.
ROUNDS_NONDETERMINISTIC = 10


@dataclass(frozen=True)
class Overread:
    """Output elements that follow the poison of one halo."""

    storage: int
    names: tuple[str, ...]  # the arguments viewing that storage
    side: str  # "after" | "before"
    nbytes: int  # the farthest halo byte read, counted from the span's end (or start)
    where: tuple[str, ...]  # per output, its elements that follow: "out[252:256]"
    elements: int

    def describe(self) -> str:
        who = " / ".join(self.names) or f"storage {self.storage}"
        if self.side == "after":
            return (
                f"reads past the end of {who}: {', '.join(self.where)} follow the poison after "
                f"{who}, {exact_bytes(self.nbytes)}"
            )
        return (
            f"reads before the start of {who}: {', '.join(self.where)} follow the poison before "
            f"{who}, {exact_bytes(self.nbytes)}"
        )


@dataclass
class Differential:
    """What the halo differential of one run found."""

    follow: dict[str, torch.Tensor] = field(default_factory=dict)  # output -> elements read
    reads: list[Overread] = field(default_factory=list)
    unattributed: tuple[str, ...] = ()  # outputs' elements no single halo explains

    @property
    def found(self) -> bool:
        return bool(self.follow)


def differs(
    a: torch.Tensor,
    b: torch.Tensor,
    mask: torch.Tensor | None,
    bitwise: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Meaningful elements of `a` and `b` that differ under the tolerance policy: integers (and
    everything with `bitwise`) bit for bit, floats beyond the dtype tolerance of reordered sums
    (float atomics are not a read), NaN equal to NaN whatever its payload. `scale`: the
    outputs' magnitude, when `a` and `b` are a few elements picked from them."""
    m = _expand_mask(mask, a)
    if a.shape != b.shape or a.dtype != b.dtype:
        return m
    b = b.to(a.device)
    neq = _as_int(a) != _as_int(b)
    if bitwise or not a.dtype.is_floating_point or not bool(neq.any()):
        return neq & m  # bit-identical (the common case) needs no tolerance
    fa, fb = a.float(), b.float()
    tol = default_tolerance(a.dtype)
    # The absolute part scales with the outputs' magnitude; the smaller of the two, so that
    # the second poison (1.3e7) read into one run cannot widen the tolerance.
    if scale is None:
        scale = min(magnitude(fa, m), magnitude(fb, m))
    atol = max(tol.atol, tol.rtol * scale)
    finite = torch.isfinite(fa) & torch.isfinite(fb)
    close = finite & ((fa - fb).abs() <= atol + tol.rtol * fb.abs())
    same = (torch.isnan(fa) & torch.isnan(fb)) | (torch.isinf(fa) & (fa == fb))
    return neq & ~close & ~same & m


def magnitude(t: torch.Tensor, m: torch.Tensor) -> float:
    """The largest finite magnitude among the elements of `m` (0 without any)."""
    if not t.numel():
        return 0.0
    keep = m & torch.isfinite(t)
    return float(torch.where(keep, t.abs(), torch.zeros_like(t)).max())


def where(name: str, mask: torch.Tensor) -> str:
    """The elements of `mask` as an index expression: out[252:256], out[63:64] (whole rows), or
    the first and last when they are scattered."""
    flat = mask.reshape(-1).nonzero().flatten()
    n = int(flat.numel())
    lo, hi = int(flat[0]), int(flat[-1])
    if mask.dim() <= 1:
        if hi - lo + 1 == n:
            return f"{name}[{lo}:{hi + 1}]"
        return f"{n} elements of {name} in {name}[{lo}:{hi + 1}]"
    rows = mask.reshape(mask.shape[0], -1).any(1).nonzero().flatten()
    r0, r1 = int(rows[0]), int(rows[-1]) + 1
    if bool(mask[r0:r1].all()):
        return f"{name}[{r0}:{r1}]"
    first = [int(c) for c in mask.nonzero()[0]]
    last = [int(c) for c in mask.nonzero()[-1]]
    return f"{n} elements of {name} from {name}{first} to {name}{last}"


def differential(
    s: Session,
    mc: MaterializedCall,
    first: dict[str, torch.Tensor],
    masks: dict[str, torch.Tensor | None],
    run: Run,
    prefix: str,
) -> Differential | None:
    """The halo differential of a run whose outputs are `first` (halos at the first poison).
    Adds its steps; the caller reports `reads` (`report`) once the mismatch verdicts
    know which failures they explain. None when a run failed."""
    d = _Halos(s, mc, first, masks, run, prefix)
    try:
        return d.differential()
    except _RunFailed:
        return None
    finally:
        halo.fill(d.allocs, d.tensors)
        s.guards = halo.snapshot(d.allocs)


class _RunFailed(Exception):
    """A run of the differential failed (its finding says how): the differential ends."""


class _Halos:
    """One halo differential: its runs, the outputs at the first poison, and the elements that
    follow the poison."""

    def __init__(
        self,
        s: Session,
        mc: MaterializedCall,
        first: dict[str, torch.Tensor],
        masks: dict[str, torch.Tensor | None],
        run: Run,
        prefix: str,
    ) -> None:
        self.s, self.mc, self.first, self.masks, self._run = s, mc, first, masks, run
        self.prefix = prefix
        self.allocs = mc.materialized.allocations
        self.tensors = s.call.tensors
        self.step = f"{prefix}/halo differential"
        self.follow: dict[str, torch.Tensor] = {}
        self.picks: dict[str, torch.Tensor] = {}
        self.scales: dict[str, float] = {}

    def run(self, label: str) -> dict[str, torch.Tensor]:
        got = self._run(label)
        if got is None:
            raise _RunFailed(label)
        return got

    def changed(
        self, got: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in (self.first if base is None else base).items():
            # Never bitwise: what a halo feeds differs grossly (NaN / 1.3e7), atomics do not.
            d = differs(t, got[name], self.masks.get(name))
            if bool(d.any()):
                out[name] = d
        return out

    def differential(self) -> Differential:
        rounds = self.find_follow()
        if rounds is None:
            return Differential()
        s, follow = self.s, self.follow
        s.step(
            self.step,
            "fail",
            f"{', '.join(where(n, d) for n, d in follow.items())} change with the halo poison "
            "(NaN / 1.3e7), not between two runs with the same poison",
        )
        result = Differential(follow)
        explained = {n: torch.zeros_like(d) for n, d in follow.items()}
        # The trials below only ask about these elements: compare just them.
        self.picks = {n: d.reshape(-1).nonzero().flatten() for n, d in follow.items()}
        self.scales = {
            n: magnitude(self.first[n].float(), _expand_mask(self.masks.get(n), self.first[n]))
            for n in follow
        }
        for a in self.allocs:
            for side in ("after", "before"):
                read = self.trial(a, side, rounds) if halo.halo_bytes(a, side) else None
                if read is None:
                    continue
                hit, overread = read
                result.reads.append(overread)
                for n, d in hit.items():
                    explained[n] |= d
        if not result.reads:
            # No halo changed alone moves them the same way twice: the first comparison was
            # nondeterminism that happened to hold over the controls, not a read.
            s.step(
                f"{self.prefix}/halo (every one)",
                "ok",
                f"{', '.join(where(n, d) for n, d in follow.items())} moved with the halo poison "
                "once, but with no single halo when its poison alone changed: nondeterminism, "
                "not a read of a halo",
            )
            return Differential()
        left = {n: follow[n] & ~explained[n] for n in follow}
        result.unattributed = tuple(where(n, d) for n, d in left.items() if bool(d.any()))
        if result.unattributed:
            s.step(
                f"{self.prefix}/halo (every one)",
                "fail",
                f"{', '.join(result.unattributed)} follow the halo poison, but no single halo "
                "explains them",
            )
        return result

    def find_follow(self) -> int | None:
        """The output elements that move with the second poison and not between two runs with
        the same one (in `self.follow`), and how many rounds a trial repeats; None (a step
        says why) when none do."""
        s, allocs, tensors = self.s, self.allocs, self.tensors
        halo.fill(allocs, tensors, variant=1)
        other = self.run(self.step)
        moved = self.changed(other)
        if not moved:
            s.step(self.step, "ok", "no output element follows the halo poison (NaN / 1.3e7)")
            return None
        # Controls: each poison once more. What a read of a halo returns repeats with its
        # poison; a race or other nondeterminism does not (it moves in one of them).
        halo.fill(allocs, tensors)
        again = self.run(f"{self.prefix}/halo control")
        halo.fill(allocs, tensors, variant=1)
        other_again = self.run(f"{self.prefix}/halo control, second poison")
        noise = [self.changed(again), self.changed(other_again, other)]
        # Outputs that already changed between two runs of one poison are nondeterministic: an
        # element of such an output can follow a trial's poison by chance, and with hundreds of
        # elements some will. A read follows its poison every time, so there the trials below
        # must repeat it ROUNDS_NONDETERMINISTIC times (chance alone then survives with odds of
        # at most 1 in 4 per round and element).
        rounds = ROUNDS_NONDETERMINISTIC if any(n for n in noise) else 1
        for name, d in moved.items():
            keep = d.clone()
            for n in noise:
                if name in n:
                    keep &= ~n[name]
            if bool(keep.any()):
                self.follow[name] = keep
        if not self.follow:
            s.step(
                self.step,
                "ok",
                "outputs change from run to run, not with the halo poison: "
                + ", ".join(where(n, d) for n, d in moved.items()),
            )
            return None
        return rounds

    def moved_at(self, got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The followed elements that differ from the first run in `got`."""
        out = {}
        for n, idx in self.picks.items():
            first = self.first[n].reshape(-1)[idx]
            d = differs(first, got[n].reshape(-1)[idx], None, scale=self.scales[n])
            if bool(d.any()):
                full = torch.zeros(self.follow[n].numel(), dtype=torch.bool, device=d.device)
                full[idx[d]] = True
                out[n] = full.view(self.follow[n].shape)
        return out

    def trial(
        self, a: Allocation, side: str, rounds: int
    ) -> tuple[dict[str, torch.Tensor], Overread] | None:
        """The elements that read the halo on `side` of `a`, and the over-read (with its step);
        None when its poison alone moves none of them the same way every time."""
        allocs, tensors = self.allocs, self.tensors
        names = tuple(
            n for n, rec in zip(self.mc.tensor_names, tensors) if rec.storage == a.storage
        )
        byte = halo.fill_byte(tensors, a.storage, variant=1)
        same = halo.fill_byte(tensors, a.storage)
        trial = f"{self.prefix}/halo {'/'.join(names)} {side}"
        halo.fill(allocs, tensors)
        halo.fill_beyond(a, side, 0, byte)
        hit = self.moved_at(self.run(trial))
        if not hit:
            return None
        # A read of the halo follows its poison's value: the same operations with the first
        # poison's byte leave the elements where they were, and the second poison moves them
        # again. What fails either follows the work done before the run (block scheduling, the
        # order of atomics), not the halo.
        for k in range(rounds):
            for fill, label, keep in ((same, "first poison", False), (byte, "again", True)):
                halo.fill(allocs, tensors)
                halo.fill_beyond(a, side, 0, fill)
                got = self.run(f"{trial}, {label}" + (f" ({k + 1})" if k else ""))
                hit = _narrow(hit, self.moved_at(got), keep)
                if not hit:
                    return None
        reach = _reach(
            allocs,
            tensors,
            a,
            side,
            byte,
            self._run,
            trial,
            lambda g, hit=hit: bool(_narrow(hit, self.moved_at(g), True)),
        )
        if reach is None:
            raise _RunFailed(trial)
        read = Overread(
            a.storage,
            names,
            side,
            reach,
            tuple(where(n, d) for n, d in hit.items()),
            sum(int(d.sum()) for d in hit.values()),
        )
        self.s.step(trial, "fail", read.describe())
        return hit, read


def _narrow(
    hit: dict[str, torch.Tensor], moved: dict[str, torch.Tensor], keep: bool
) -> dict[str, torch.Tensor]:
    """The elements of `hit` that moved again (`keep`) or that stayed (not `keep`)."""
    out = {}
    for n, d in hit.items():
        m = moved.get(n)
        if keep:
            d = d & m if m is not None else torch.zeros_like(d)
        elif m is not None:
            d = d & ~m
        if bool(d.any()):
            out[n] = d
    return out


def _reach(
    allocs: Sequence[Allocation],
    tensors: Sequence[TensorRecord],
    a: Allocation,
    side: str,
    byte: int,
    run: Run,
    trial: str,
    moves: Callable[[dict[str, torch.Tensor]], bool],
) -> int | None:
    """The smallest N such that changing only the halo bytes farther than N from the span
    moves no output element that follows the poison: a bisection in whole elements of the
    storage's dtype (a NaN stays NaN when only its low bytes change)."""
    unit = max((dtype_from_name(r.dtype).itemsize for r in tensors if r.storage == a.storage),
               default=1)  # fmt: skip
    lo, hi = 0, -(-halo.halo_bytes(a, side) // unit)  # changing every unit beyond lo moves one
    while hi - lo > 1:
        mid = (lo + hi) // 2
        halo.fill(allocs, tensors)
        halo.fill_beyond(a, side, mid * unit, byte)
        got = run(f"{trial} beyond {mid * unit} bytes")
        if got is None:
            return None
        if moves(got):
            lo = mid
        else:
            hi = mid
    return min(hi * unit, halo.halo_bytes(a, side))


def report(s: Session, d: Differential, step: str, symptoms: list[str]) -> None:
    """Memory findings for what `d` found; `symptoms`: the failures of the same run that only the
    elements read from a halo show (never findings of their own). Each halo read is named once
    per replay (graph mode replays the same over-read every time)."""
    suffix = f"; symptom: {'; '.join(symptoms)}" if symptoms else ""
    for r in d.reads:
        if (r.storage, r.side) in s.overreads_named:
            continue
        s.overreads_named.add((r.storage, r.side))
        msg = f"{r.describe()} (evidence: the halo differential){suffix}"
        s.finding(
            "memory",
            step,
            msg,
            {
                "tensors": list(r.names),
                "side": r.side,
                "bytes": r.nbytes,
                "outputs": list(r.where),
                "elements": r.elements,
                "evidence": "halo differential",
                "symptoms": list(symptoms),
            },
        )
    if d.unattributed and not d.reads:
        msg = (
            f"reads outside its arguments: {', '.join(d.unattributed)} follow the halo poison, "
            f"but no single halo explains them (evidence: the halo differential){suffix}"
        )
        s.finding(
            "memory",
            step,
            msg,
            {"outputs": list(d.unattributed), "evidence": "halo differential"},
        )
