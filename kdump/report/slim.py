"""`kdump slim`: a small bundle that still reproduces its failure.

The call under test is replayed first for its verdict (the headline finding: kind and step).
Tiers then rewrite the storages of every call of the bundle (a graph replay may use the others),
each on top of the last one that held, and the result is replayed after each (through
`kdump.replay.replay`: child processes, the allow-list):

1. content the call cannot touch is dropped (`sparse` storages; shapes and layouts identical):
   the spec says from the routing which activation rows and weight groups the call reads
   (`KernelSpec.rows_used`; DeepGEMM: groups with tokens, rows that are not padding);
2. floating-point activations, scales and the outputs' prior contents become `synthetic`
   storages with the recorded per-tensor statistics (integer data, routing above all, stays
   exact); the recorded outputs are dropped: they no longer belong to the inputs;
3. floating-point weights become synthetic as well.

Up to tier 1 "still reproduces" means the same finding kind at the same step; from tier 2 on the
finding must also come from an oracle other than the recorded output (reference, fresh eager,
sanitizer, halos). `keep` protects arguments from every tier. The output is the last bundle that
held; its `info.slim` records every tier (what was replaced, how, with which seed).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kdump.bundle import Bundle, Call, load_bundle
from kdump.bundle.store import sha256_hex
from kdump.bundle.writer import save_entries
from kdump.errors import (
    CannotRunError,
    FindingKind,
    InternalError,
    UsageError,
    precedence_rank,
)
from kdump.format.records import (
    GeneratorRecord,
    Source,
    Stats,
    StorageRecord,
    TensorRecord,
)
from kdump.format.synthetic import DEFAULT_GENERATOR, DEFAULT_VERSION, SEED_LIMIT, splitmix64
from kdump.format.synthetic import DTYPES as SYNTHETIC_DTYPES
from kdump.kernels.plugin import KernelSpec, Role
from kdump.replay.options import ReplayOptions
from kdump.replay.verdict import Finding, Verdict

Progress = Callable[[str, int, int], None]
TIERS = {
    1: "drop untouched rows (sparse)",
    2: "synthetic activations and scales",
    3: "synthetic weights",
}
MAX_TIER = max(TIERS)
_MARKER_MAX = 256 << 20  # elements: the largest interleaved view whose touched bytes are mapped
_FLOAT_DTYPES = frozenset(
    d for d in SYNTHETIC_DTYPES if d.startswith(("float", "bfloat"))
)  # what tiers 2 and 3 replace


@dataclass(frozen=True)
class SlimOptions:
    """What `slim` does: which call, how it is replayed, what stays exact, how far it goes."""

    replay: ReplayOptions = field(default_factory=ReplayOptions)
    call: int = 0
    keep: tuple[str, ...] = ()  # argument names or paths ('b', 'a[1]') no tier touches
    seed: int = 0  # base seed of the synthetic storages (each derives its own)
    max_tier: int = MAX_TIER


@dataclass(frozen=True)
class Replaced:
    """One storage a tier rewrote."""

    call: int
    storage: int
    tensors: tuple[str, ...]
    how: str  # sparse | synthetic
    held_bytes: int  # bytes the bundle still holds for it
    seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "call": self.call,
            "storage": self.storage,
            "tensors": list(self.tensors),
            "how": self.how,
            "held_bytes": self.held_bytes,
        }
        if self.seed is not None:
            out["seed"] = self.seed
        return out


@dataclass(frozen=True)
class TierResult:
    tier: int
    name: str
    nbytes: int  # size of the tier's bundle file (0: not written)
    held: bool | None  # None: nothing to replace, not replayed
    headline: str  # the tier's verdict headline, or why it was not tried
    replaced: tuple[Replaced, ...] = ()
    outputs_dropped: bool = False  # this tier dropped the recorded outputs

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "name": self.name,
            "nbytes": self.nbytes,
            "held": self.held,
            "headline": self.headline,
            "replaced": [r.to_json() for r in self.replaced],
            "outputs_dropped": self.outputs_dropped,
        }


@dataclass(frozen=True)
class SlimResult:
    source: Path
    output: Path
    call: int
    finding_kind: str
    finding_step: str
    headline: str  # the original's
    original_nbytes: int  # the bundle rewritten self-contained (tier 0)
    nbytes: int  # the output's
    tiers: tuple[TierResult, ...]
    stopped_at: int
    reason: str

    @property
    def ratio(self) -> float:
        return self.original_nbytes / max(self.nbytes, 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "output": str(self.output),
            "call": self.call,
            "finding": {"kind": self.finding_kind, "step": self.finding_step},
            "headline": self.headline,
            "original_nbytes": self.original_nbytes,
            "nbytes": self.nbytes,
            "ratio": round(self.ratio, 2),
            "tiers": [t.to_json() for t in self.tiers],
            "stopped_at": self.stopped_at,
            "reason": self.reason,
        }


# ---------------------------------------------------------------------------------------------
# Roles of a call's tensors


@dataclass(frozen=True)
class _Roles:
    """Per input tensor: its parameter, its role in slimming, and whether it is kept."""

    param: tuple[str, ...]
    kind: tuple[str, ...]  # activation | weight | routing | output | exact
    kept: tuple[bool, ...]


def _roles(spec: KernelSpec, call: Call, keep: Sequence[str]) -> _Roles:
    from kdump.report.routing import bind_encoded, tensor_refs

    bound = bind_encoded(spec, call)
    params = {p.name: p.role for p in getattr(spec, "params", ())}
    inputs = [n for n in bound if params.get(n) is Role.INPUT]
    declared = {n for n in bound if params.get(n) is Role.WEIGHT}
    # Weights as the spec declares them; else the GEMM convention: the first input is the
    # activation, the others are weights.
    weights = declared or set(inputs[1:])
    n = len(call.tensors)
    param = [""] * n
    kind = ["activation"] * n  # a spec without roles: everything is data
    for name, tree in bound.items():
        role = params.get(name)
        for i in tensor_refs(tree):
            if 0 <= i < n and not param[i]:
                param[i] = name
                if role is Role.OUTPUT:
                    kind[i] = "output"
                elif role is Role.ROUTING:
                    kind[i] = "routing"
                elif role in (Role.SCALAR, Role.HINT):
                    kind[i] = "exact"
                elif name in weights:
                    kind[i] = "weight"
    paths = call.tensor_names
    known = set(paths) | set(param)
    unknown = [k for k in keep if k not in known]
    if unknown:
        raise UsageError(
            f"--keep {unknown[0]!r} names no tensor argument of call {call.index} (it has "
            f"{', '.join(sorted(known - {''}))})"
        )
    kept = [param[i] in keep or paths[i] in keep for i in range(n)]
    return _Roles(tuple(param), tuple(kind), tuple(kept))


# ---------------------------------------------------------------------------------------------
# Tier 1: the bytes a call can touch


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and b <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((b, e))
    return out


def _touched(rec: TensorRecord, st: StorageRecord, mask: torch.Tensor) -> list[tuple[int, int]]:
    """Span-relative byte ranges of the elements of `rec` whose leading indices `mask` (bool
    over the leading dims) selects; the whole extent when they cannot be told apart cheaply."""
    from kdump.format.records import view_byte_extent

    lead = mask.dim()
    size = rec.itemsize
    lo, hi = rec.byte_extent()
    whole = [(lo - st.span_start, hi - st.span_start)]
    if tuple(rec.shape[:lead]) != tuple(mask.shape) or rec.numel == 0:
        return whole
    _, inner_hi = view_byte_extent(rec.shape[lead:], rec.stride[lead:], 0, size)
    idx = torch.nonzero(mask)  # [rows, lead]
    strides = torch.tensor(rec.stride[:lead], dtype=torch.long)
    base = (rec.storage_offset + (idx * strides).sum(1)) * size - st.span_start
    all_idx = torch.nonzero(torch.ones_like(mask))
    all_base, _ = torch.sort((all_idx * strides).sum(1) * size)
    if bool((all_base[1:] - all_base[:-1] >= inner_hi).all()):  # rows do not interleave
        return _merge([(b, b + inner_hi) for b in base.tolist()])
    n = st.span_nbytes // size
    if st.span_start % size or n > _MARKER_MAX:
        return whole
    marker = torch.zeros(n, dtype=torch.bool)
    view = marker.as_strided(rec.shape, rec.stride, rec.storage_offset - st.span_start // size)
    view[mask] = True
    edges = torch.diff(marker.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist() + ([n] if marker[-1] else [])
    return [(b * size, e * size) for b, e in zip(starts, ends)]


def _needed(
    bundle: Bundle, call: Call, spec: KernelSpec, roles: _Roles
) -> dict[int, list[tuple[int, int]]]:
    """Per storage that tier 1 can thin out: the byte ranges the call can touch."""
    from kdump.report.routing import rows_used

    routing = rows_used(bundle, call, spec)
    if routing is None:
        return {}
    per: dict[int, list[tuple[int, int]]] = {}
    whole: set[int] = set()
    for i, rec in enumerate(call.tensors):
        st = call.storages[rec.storage]
        kind = roles.kind[i]
        mask = None
        if not roles.kept[i] and st.source in (Source.BLOB, Source.PIECES):
            if kind == "activation":
                mask = routing.rows
            elif kind == "weight":
                mask = routing.groups
        if mask is None or rec.numel == 0:
            if rec.numel:
                whole.add(rec.storage)
            continue
        per.setdefault(rec.storage, []).extend(_touched(rec, st, mask))
    out = {}
    for j, ranges in per.items():
        merged = _merge(ranges)
        held = sum(e - b for b, e in merged)
        if j not in whole and held < call.storages[j].span_nbytes:
            out[j] = merged
    return out


# ---------------------------------------------------------------------------------------------
# Tiers 2 and 3: statistics and synthetic storages


def _span_raw(bundle: Bundle, st: StorageRecord) -> Any:
    """The span bytes of a blob or pieced storage, indexable by byte (not verified again)."""
    if st.source is Source.PIECES:
        return memoryview(bundle.pieces_bytes(st).numpy())
    return bundle.blob_bytes(st.blob)


_STATS_CHUNK = 16 << 20  # bytes converted to float64 at once (bounded memory for any weight)


def _stats(
    bundle: Bundle, st: StorageRecord, dtype: str, ranges: Sequence[tuple[int, int]] | None
) -> Stats | None:
    """min, max, mean and population std of a storage's finite recorded values (only its
    touched ranges, when known), in bounded chunks; None without a finite value."""
    from kdump.format.dtypes import dtype_from_name

    dt = dtype_from_name(dtype)
    size = dt.itemsize
    raw = bundle.read_blob(st.blob) if st.source is Source.BLOB else bundle.pieces_bytes(st)
    n, mean, m2 = 0, 0.0, 0.0
    lo, hi = math.inf, -math.inf
    step = _STATS_CHUNK - _STATS_CHUNK % size
    for b, e in ranges or [(0, raw.numel())]:
        e -= (e - b) % size
        for start in range(b, e, step):
            v = raw[start : min(start + step, e)].clone().view(dt).to(torch.float64)
            v = v[torch.isfinite(v)]
            k = v.numel()
            if not k:
                continue
            cmean = float(v.mean())
            cm2 = float(((v - cmean) ** 2).sum())
            delta = cmean - mean  # merge the chunk's mean and sum of squares into the total
            mean += delta * k / (n + k)
            m2 += cm2 + delta * delta * n * k / (n + k)
            n += k
            lo, hi = min(lo, float(v.min())), max(hi, float(v.max()))
    if not n:
        return None
    return Stats(dtype, lo, hi, mean, math.sqrt(m2 / n))


def _usable(stats: Stats | None, dtype: str) -> bool:
    if stats is None or stats.dtype != dtype:
        return False
    values = (stats.min, stats.max, stats.mean, stats.std)
    return all(math.isfinite(v) for v in values) and stats.min <= stats.max and stats.std >= 0


def _seed(base: int, storage: int) -> int:
    return int(splitmix64(base % SEED_LIMIT, storage, 1)[0])


# ---------------------------------------------------------------------------------------------
# The state of a slimmed call and its bundle


@dataclass
class _State:
    storages: list[list[StorageRecord]]  # per call
    data: dict[str, bytes | memoryview]  # blob sha -> bytes, for the storages holding bytes
    outputs: bool  # the recorded outputs are still in the bundle


@dataclass
class _Plan:
    """One call of the bundle: its spec, the roles of its tensors, tier 1's ranges."""

    call: Call
    spec: KernelSpec
    roles: _Roles
    needed: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def views_of(self, j: int) -> list[int]:
        return [i for i, t in enumerate(self.call.tensors) if t.storage == j]


class _Slimmer:
    """Every call of the bundle is slimmed alike (a graph replay may need the others, e.g. a
    salvaged replay's values); the call under test is the one replayed."""

    def __init__(self, path: Path, out: Path, opts: SlimOptions, progress: Progress | None) -> None:
        from kdump.kernels.registry import check_target
        from kdump.report.routing import call_spec

        self.path = path
        self.out = out
        self.opts = opts
        self.progress = progress or (lambda label, done, total: None)
        self.bundle = load_bundle(path)
        self.call = self.bundle.call(opts.call)
        for c in self.bundle.calls:
            check_target(c.target, opts.replay.allow_targets)  # refused like replay
        self.plans = []
        for c in self.bundle.calls:
            spec = call_spec(self.bundle, c)
            keep = opts.keep if c.index == self.call.index else ()
            roles = _roles(spec, c, keep)
            if c.index != self.call.index:  # a kept name protects it in every call
                paths = c.tensor_names
                kept = [
                    roles.param[i] in opts.keep or paths[i] in opts.keep for i in range(len(paths))
                ]
                roles = replace(roles, kept=tuple(kept))
            self.plans.append(_Plan(c, spec, roles))
        self.synthetic_of: dict[tuple[str, str], tuple[Stats, int]] = {}
        self.steps = 1 + opts.max_tier
        self.done = 0

    def tick(self, label: str) -> None:
        self.progress(label, self.done, self.steps)
        self.done += 1

    # -- writing and replaying
    def write(self, state: _State, path: Path, summary: dict[str, Any]) -> int:
        data: dict[str, bytes | memoryview] = dict(state.data)
        entries = []
        for plan, storages in zip(self.plans, state.storages):
            c = plan.call.entry
            if state.outputs and c.outputs is not None:
                for st in c.outputs.storages:
                    if st.source in (Source.BLOB, Source.PIECES):
                        for sha in st.blobs:
                            data[sha] = self.bundle.blob_bytes(sha)
            outputs = c.outputs if state.outputs else None
            entries.append(replace(c, storages=tuple(storages), outputs=outputs))
        info = {**self.bundle.info, "slim": summary}
        save_entries(path, entries, data, env=self.bundle.env, info=info)
        return path.stat().st_size

    def replay(self, path: Path) -> Verdict:
        from kdump.replay import replay

        [v] = replay([path], self.opts.replay, calls=[self.call.index])
        return v

    # -- the tiers
    def initial(self) -> _State:
        data: dict[str, bytes | memoryview] = {}
        for c in self.bundle.calls:
            for st in c.storages:
                if st.source not in (Source.BLOB, Source.PIECES):
                    continue
                for sha in st.blobs:
                    if sha not in data:
                        self.bundle.verify_blob(sha)  # a slimmed bundle launders no corruption
                        data[sha] = self.bundle.blob_bytes(sha)
        return _State([list(c.storages) for c in self.bundle.calls], data, True)

    def tier1(self, state: _State) -> tuple[_State, list[Replaced]]:
        storages = [list(x) for x in state.storages]
        data = dict(state.data)
        done = []
        for k, plan in enumerate(self.plans):
            plan.needed = _needed(self.bundle, plan.call, plan.spec, plan.roles)
            for j, ranges in sorted(plan.needed.items()):
                st = storages[k][j]
                raw = _span_raw(self.bundle, st)
                held = b"".join(bytes(raw[b:e]) for b, e in ranges)
                sha = sha256_hex(held)
                storages[k][j] = replace(
                    st, source=Source.SPARSE, blob=sha, ranges=tuple(ranges), pieces=()
                )
                data[sha] = held
                done.append(self.replaced(plan, j, "sparse", len(held)))
        return self.pruned(storages, data, state.outputs), done

    def synthetic(self, state: _State, kinds: set[str]) -> tuple[_State, list[Replaced]]:
        storages = [list(x) for x in state.storages]
        data = dict(state.data)
        done = []
        for k, plan in enumerate(self.plans):
            for j, st in enumerate(storages[k]):
                views = plan.views_of(j)
                if not views or st.source is Source.SYNTHETIC:
                    continue
                if any(plan.roles.kept[i] or plan.roles.kind[i] not in kinds for i in views):
                    continue
                dtypes = {plan.call.tensors[i].dtype for i in views}
                if len(dtypes) != 1 or not dtypes <= _FLOAT_DTYPES:
                    continue
                [dtype] = dtypes
                made = self.draw(plan, j, dtype)
                if made is None and all(plan.roles.kind[i] == "output" for i in views):
                    # An output's prior contents without a finite value (a NaN fill): zeros.
                    empty = sha256_hex(b"")
                    storages[k][j] = replace(
                        st, source=Source.SPARSE, blob=empty, ranges=(), stats=None, pieces=()
                    )
                    data[empty] = b""
                    done.append(self.replaced(plan, j, "zeros", 0))
                    continue
                if made is None:
                    continue
                stats, seed = made
                gen = GeneratorRecord(DEFAULT_GENERATOR, DEFAULT_VERSION, seed)
                storages[k][j] = replace(
                    st,
                    source=Source.SYNTHETIC,
                    blob="",
                    ranges=(),
                    stats=stats,
                    generator=gen,
                    pieces=(),
                )
                done.append(self.replaced(plan, j, "synthetic", 0, seed))
        return self.pruned(storages, data, False), done

    def draw(self, plan: _Plan, j: int, dtype: str) -> tuple[Stats, int] | None:
        """Statistics and seed of storage j's synthetic data. Storages of several calls that
        held one blob (a layer's weights) get the same ones, so they stay equal."""
        orig = plan.call.storages[j]
        key = (",".join(orig.blobs), dtype)  # a blob's name, or its pieces' names
        held = orig.source in (Source.BLOB, Source.PIECES)
        if held and key in self.synthetic_of:
            return self.synthetic_of[key]
        if held:
            stats = _stats(self.bundle, orig, dtype, plan.needed.get(j))
        elif _usable(orig.stats, dtype):
            stats = orig.stats  # a storage recorded by its statistics alone keeps them
        else:
            return None
        if stats is None:
            return None
        made = (stats, _seed(self.opts.seed, len(self.synthetic_of)))
        if held:
            self.synthetic_of[key] = made
        return made

    def pruned(
        self,
        storages: list[list[StorageRecord]],
        data: dict[str, bytes | memoryview],
        outputs: bool,
    ) -> _State:
        used = {sha for part in storages for st in part for sha in st.blobs}
        return _State(storages, {k: v for k, v in data.items() if k in used}, outputs)

    def replaced(
        self, plan: _Plan, j: int, how: str, held: int, seed: int | None = None
    ) -> Replaced:
        names = tuple(plan.call.tensor_names[i] for i in plan.views_of(j))
        return Replaced(plan.call.index, j, names, how, held, seed)

    def build(self, tier: int, state: _State) -> tuple[_State, list[Replaced]]:
        if tier == 1:
            return self.tier1(state)
        if tier == 2:
            return self.synthetic(state, {"activation", "output"})
        return self.synthetic(state, {"weight"})

    # -- the whole run
    def run(self) -> SlimResult:
        self.tick("replay the original")
        v0 = self.replay(self.path)
        want = _headline_finding(v0)
        independent = _independent(v0, want)
        state = self.initial()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tiers: list[TierResult] = []
        summary = self.summary(want, tiers, 0, "")
        with tempfile.TemporaryDirectory(prefix="kdump-slim-", dir=self.out.parent) as tmp:
            best = Path(tmp, "tier0.kdump")
            original = self.write(state, best, summary)
            size = original
            stopped, reason = 0, ""
            for tier in range(1, self.opts.max_tier + 1):
                name = TIERS[tier]
                if tier >= 2 and independent is None:
                    reason = (
                        f"tier {tier} drops the recorded outputs, and the failure is only seen "
                        "against them (no other oracle shows it)"
                    )
                    tiers.append(TierResult(tier, name, 0, None, reason))
                    break
                cand, replaced = self.build(tier, state)
                if not replaced and (tier < 2 or not state.outputs):
                    tiers.append(TierResult(tier, name, size, None, "nothing to replace"))
                    stopped = tier
                    self.done += 1
                    continue
                path = Path(tmp, f"tier{tier}.kdump")
                nbytes = self.write(cand, path, self.summary(want, tiers, tier, ""))
                self.tick(f"tier {tier}: {name}")
                v = self.replay(path)
                target = want if tier < 2 else independent
                assert target is not None
                held = _holds(v, target, independent=tier >= 2)
                dropped = state.outputs and not cand.outputs
                tiers.append(
                    TierResult(tier, name, nbytes, held, v.headline(), tuple(replaced), dropped)
                )
                if not held:
                    reason = f"tier {tier} ({name}) lost the failure: {v.headline()}"
                    break
                state, best, size, stopped = cand, path, nbytes, tier
            else:
                last = self.opts.max_tier
                reason = (
                    "every tier kept the failure"
                    if last == MAX_TIER
                    else f"tier {last} is the last one asked for (of {MAX_TIER})"
                )
            final = self.summary(want, tiers, stopped, reason)
            size = self.write(state, best, final)
            os.replace(best, self.out)
        self.progress("done", self.steps, self.steps)
        return SlimResult(
            self.path,
            self.out,
            self.call.index,
            want.kind,
            want.step,
            v0.headline(),
            original,
            size,
            tuple(tiers),
            stopped,
            reason,
        )

    def summary(
        self, want: Finding, tiers: Sequence[TierResult], upto: int, reason: str
    ) -> dict[str, Any]:
        return {
            "from": self.path.name,
            "call": self.call.index,
            "finding": {"kind": want.kind, "step": want.step},
            "seed": self.opts.seed,
            "keep": list(self.opts.keep),
            "tier": upto,
            "tiers": [t.to_json() for t in tiers],
            "reason": reason,
        }


def _headline_finding(v: Verdict) -> Finding:
    """The original's finding to reproduce; a clean original or one that did not run is an
    error of the kind its verdict says."""
    if not v.findings:
        raise UsageError(
            f"call {v.call} replays clean in {v.mode} mode ({v.headline()}): nothing to reproduce"
        )
    first = min(v.findings, key=lambda f: precedence_rank(f.exit_code))
    kind = first.kind
    if kind == FindingKind.CANNOT_RUN.value:
        raise CannotRunError(f"the original cannot be replayed here: {first.message}")
    if kind in (FindingKind.USAGE.value, FindingKind.BUNDLE.value):
        raise UsageError(f"the original cannot be replayed: {first.message}")
    if kind == FindingKind.INTERNAL.value:
        raise InternalError(f"the original's replay did not run: {first.message}")
    return first


def _independent(v: Verdict, want: Finding) -> Finding | None:
    """The original's finding that needs no recorded output (the headline's when it does not),
    or None when every finding is a difference from the recorded output."""
    if want.details.get("oracle") != "recorded":
        return want
    rest = [f for f in v.findings if f.details.get("oracle") != "recorded"]
    return min(rest, key=lambda f: precedence_rank(f.exit_code)) if rest else None


def _holds(v: Verdict, want: Finding, independent: bool) -> bool:
    return any(
        f.kind == want.kind
        and f.step == want.step
        and not (independent and f.details.get("oracle") == "recorded")
        for f in v.findings
    )


def slim(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: SlimOptions | None = None,
    progress: Progress | None = None,
) -> SlimResult:
    """Write `out`: the bundle `path`, as small as the tiers can make it while the replay of its
    call `options.call` still shows the original's failure. `progress(label, done, total)` is
    called before each replay and once at the end."""
    opts = options or SlimOptions()
    if not 0 <= opts.max_tier <= MAX_TIER:
        raise UsageError(f"max tier {opts.max_tier} is not in 0..{MAX_TIER}")
    if not 0 <= opts.seed < SEED_LIMIT:
        raise UsageError(f"seed {opts.seed} is not in [0, 2^64)")
    src, dst = Path(path), Path(out)
    if dst.exists() and dst.resolve() == src.resolve():
        raise UsageError(f"{dst}: the output would overwrite the bundle being slimmed")
    return _Slimmer(src, dst, opts, progress).run()


def describe(result: SlimResult) -> list[str]:
    """The lines `kdump slim` prints (bundle strings in them go through kdump.text)."""
    from kdump.text import visible

    lines = [
        f"original: call {result.call}, {result.original_nbytes} bytes: "
        f"{visible(result.headline, 300)}",
    ]
    for t in result.tiers:
        held = {True: "held", False: "LOST", None: "skipped"}[t.held]
        size = f"{t.nbytes} bytes" if t.nbytes else "-"
        lines.append(
            f"tier {t.tier} ({t.name}): {size}, verdict {held}: {visible(t.headline, 300)}"
        )
    lines.append(
        f"stopped at tier {result.stopped_at} because {visible(result.reason, 300)}; wrote "
        f"{visible(str(result.output), 300)} ({result.nbytes} bytes, "
        f"{size_change(result.original_nbytes, result.nbytes)})"
    )
    return lines


def size_change(before: int, after: int) -> str:
    """How `after` bytes compare with `before` (the original's, printed on the first line):
    never "1.0x smaller" for a file that grew or barely shrank."""
    if after == before:
        return "the same size as the original"
    if after > before:
        pct = 100 * (after - before) / max(before, 1)
        return f"grew by {after - before} bytes, {pct:.1f}%"
    ratio = before / max(after, 1)
    if ratio >= 1.1:
        return f"{ratio:.1f}x smaller"
    return f"{100 * (before - after) / before:.1f}% smaller"


def touched_ranges(
    bundle: Bundle, call: int = 0, keep: Sequence[str] = ()
) -> dict[int, list[tuple[int, int]]]:
    """Tier 1's plan: per input storage it thins out, the span-relative byte ranges the call
    can touch (storages absent from it are kept whole)."""
    from kdump.report.routing import call_spec

    c = bundle.call(call)
    spec = call_spec(bundle, c)
    return _needed(bundle, c, spec, _roles(spec, c, keep))
