"""What the flight recorder keeps per call signature: the call's layout (`Layout`: storages and
tensor records, their JSON, the copy choice, the outputs kept after the call) and the span views
of one call's storages (`SpanViews`).

The copy choice, in priority order while the slot has room: arguments whose spec role is
routing, scalar or hint, inputs no bigger than `SMALL_BYTES`, then the other inputs, smallest
first; then the outputs after the call, smallest first, then the outputs' bytes before the call
(`outputs_fit`). What does not fit keeps its layout only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kdump.format.records import storage_layout_json, tensor_json
from kdump.log import log_once
from kdump.record.flight.statics import Candidates, first_views, storage_meta, version_of

if TYPE_CHECKING:
    from kdump.record.config import Outputs
    from kdump.record.hooks import HookState

SMALL_BYTES = 64 << 10  # inputs up to this size are copied whatever their role
SLOT_SHARE = 0.9  # of a slot, what payloads may take (the rest: header and argument JSON)
COPIED_ROLES = ("routing", "scalar", "hint")
NO_OUTPUTS: list[Any] = []  # shared, never changed


def signature(target: str, tensors: list[Any], args_tree: Any, kwargs_tree: Any) -> Any:
    """What a call's recorded layout depends on: its target, what the tensor records are made
    of (`layout_facts`: also requires_grad, the device and the storage's size, which change
    without moving an address) and the encoded argument trees (scalars, flags)."""
    from kdump.bundle.tensors import layout_facts

    return (
        target,
        tuple(layout_facts(t) for t in tensors),
        repr((args_tree, kwargs_tree)),
    )


class Layout:
    """What stays the same between calls of one signature: storages and tensor records, the
    copy choice and their JSON (no tensor references: the cache must not keep memory alive)."""

    def __init__(
        self,
        storages: list[Any],
        records: list[Any],
        want: tuple[bool, ...],
        storage_dicts: list[dict[str, Any]],
        tensor_dicts: list[dict[str, Any]],
        trees: tuple[list[Any], dict[str, Any]],
        names: list[str] | None,
        roles: list[str | None],
        firsts: tuple[int, ...],
        outs: list[dict[str, Any]] = NO_OUTPUTS,
        not_kept: dict[str, Any] | None = None,
    ) -> None:
        self.storages = storages
        self.records = records
        self.want = want
        self.storage_dicts = storage_dicts
        self.tensor_dicts = tensor_dicts
        self.trees = trees
        self.names = names
        self.roles = roles  # the spec role of each tensor (static operands are found by it)
        self.firsts = firsts  # per storage: the index of the first tensor viewing it
        self.outs = outs  # the outputs copied after the call ({"storage", "tensors"} each)
        self.not_kept = not_kept  # the outputs that did not fit (the slot's extra says so)
        self.candidates = Candidates.of(records, storages, roles)  # which may be static
        # The last call's storage dicts with versions and static references, reused while they
        # repeat (the journal then reuses their JSON); the plan's JSON, per plan object.
        self._meta: tuple[Any, list[dict[str, Any]]] | None = None
        self._plan_json: tuple[Any, dict[str, Any]] | None = None

    @classmethod
    def of_call(
        cls,
        st: HookState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[Any],
        trees: tuple[list[Any], dict[str, Any]],
        outputs: Outputs,
        slot_bytes: int,
    ) -> Layout:
        """The layout of a call (its tensors and encoded argument trees) for slots of
        `slot_bytes`, keeping the outputs `--outputs` asks for where they fit."""
        from kdump.bundle.tensors import group_storages

        args_tree, kwargs_tree = trees
        storages, records = group_storages(tensors)
        roles = tensor_roles(st, args, kwargs, tensors)
        names = st.names()
        outs = output_storages(outputs, st, args, kwargs, tensors, records, storages)
        want, kept, not_kept = wanted(records, storages, roles, outs, slot_bytes)
        if not_kept is not None:
            not_kept["tensors"] = _paths(names, args_tree, kwargs_tree, not_kept)
        return cls(
            storages,
            records,
            tuple(want),
            [storage_layout_json(s) for s in storages],
            [tensor_json(r, nbytes=True) for r in records],
            trees,
            list(names[: len(args)]) if names and len(names) >= len(args) else None,
            roles,
            first_views(records, len(storages)),
            kept,
            not_kept,
        )

    def storage_meta(
        self,
        tensors: list[Any],
        records: list[Any],
        refs: list[dict | None],
        lazy: list[dict | None],
    ) -> list[dict[str, Any]]:
        """This call's storage dicts (kdump.record.flight.statics.storage_meta): the previous
        call's list object when every value is the same."""
        versions = tuple(version_of(tensors[f]) for f in self.firsts)
        key = (versions, refs, lazy)
        if self._meta is not None and self._meta[0] == key:
            return self._meta[1]
        dicts = storage_meta([dict(d) for d in self.storage_dicts], tensors, records, refs, lazy)
        self._meta = (key, dicts)
        return dicts

    def plan_json(self, plan: Any) -> dict[str, Any]:
        """The plan's JSON, made once per plan object (plans are frozen and cached per
        signature); shared between calls: only encoded, never changed."""
        if self._plan_json is None or self._plan_json[0] is not plan:
            self._plan_json = (plan, plan.to_json())
        return self._plan_json[1]


def output_storages(
    outputs: Outputs,
    st: HookState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tensors: list[Any],
    records: list[Any],
    storages: list[Any],
) -> list[dict[str, Any]]:
    """The storages to copy again after the call, each {"storage", "tensors"} (the output
    tensors in it): `--outputs` as the sync recorder reads it, except that "default" keeps
    none for a target whose spec has a reference (it judges a replay without them)."""
    if outputs == "none":
        return []
    if outputs == "default":
        try:
            from kdump.kernels import registry

            if registry.spec_for(st.id, st.names()).has_reference():
                return []
        except Exception as exc:  # no spec to ask: a generic target
            log_once(f"ringspec:{st.id}", f"flight recorder: no spec for {st.id}: {exc}")
    from kdump.record.sync.recorder import output_indices

    idx = output_indices(outputs, st.spec, st.names(), tensors, args, kwargs)
    by_storage: dict[int, list[int]] = {}
    for i in idx:
        j = records[i].storage
        if storages[j].span_nbytes:  # nothing to copy back from an empty tensor
            by_storage.setdefault(j, []).append(i)
    return [{"storage": j, "tensors": ts} for j, ts in sorted(by_storage.items())]


def wanted(
    records: list[Any],
    storages: list[Any],
    roles: list[str | None],
    outputs: list[dict[str, Any]],
    slot_bytes: int,
) -> tuple[list[bool], list[dict[str, Any]], dict[str, Any] | None]:
    """(per storage: copy its bytes before the call?, the `outputs` whose copy after the
    call fits, what did not fit or None). In priority order while the slot has room:
    routing / scalar / hint parameters and small inputs, then the other inputs, smallest
    first, then the outputs after the call, smallest first, then the outputs' bytes before
    the call (`outputs_fit`). Storages only written are copied before the call only as
    outputs; static operands are taken out per call."""
    rank = [2] * len(storages)  # 0: first, 1: small, 2: other inputs, 3: never
    for i, s in enumerate(storages):
        if s.span_nbytes <= SMALL_BYTES:
            rank[i] = 1
    read = [False] * len(storages)  # does the call read any tensor of the storage?
    for r, role in zip(records, roles):
        if role in COPIED_ROLES:
            rank[r.storage] = min(rank[r.storage], 0)
        if role != "output":
            read[r.storage] = True
    for i in range(len(storages)):
        if not read[i]:  # outputs only: an input in the same buffer keeps its bytes
            rank[i] = 3
    sizes = [int(s.span_nbytes) for s in storages]
    want, kept = outputs_fit(sizes, rank, outputs, int(slot_bytes * SLOT_SHARE))
    if len(kept) == len(outputs):
        return want, kept, None
    # The smallest slot (a power of two) whose room keeps every output the same way.
    size = slot_bytes
    while len(outputs_fit(sizes, rank, outputs, int(size * SLOT_SHARE))[1]) < len(outputs):
        size *= 2
    lost = [o for o in outputs if o not in kept]
    not_kept = {
        "tensors": [i for o in lost for i in o["tensors"]],  # argument paths: the caller's
        "bytes": sum(sizes[o["storage"]] for o in lost),
        "slot_bytes": size,
    }
    return want, kept, not_kept


def outputs_fit(
    sizes: list[int], rank: list[int], outputs: list[dict[str, Any]], room: int
) -> tuple[list[bool], list[dict[str, Any]]]:
    """`wanted`'s choice for a slot whose payloads may take `room` bytes: (per storage: copied
    before the call, the outputs copied after it). Inputs first (`rank` 0-2, smallest first
    within a rank), then the outputs after the call, smallest first, then the bytes before the
    call of storages only written (rank 3) that are outputs."""
    want = [False] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (rank[i], sizes[i])):
        if sizes[i] == 0:
            # Nothing to copy or to miss: empty tensors share one storage (null pointer), so
            # an empty output must not make an empty input missing.
            want[i] = True
            continue
        n = sizes[i] + 64  # payloads are 64-byte aligned
        if rank[i] < 3 and n <= room:
            want[i] = True
            room -= n
    kept = []
    for o in sorted(outputs, key=lambda o: sizes[o["storage"]]):
        n = sizes[o["storage"]] + 64
        if n <= room:
            kept.append(o)
            room -= n
    for o in sorted(outputs, key=lambda o: sizes[o["storage"]]):
        j = o["storage"]
        if not want[j] and o in kept and sizes[j] + 64 <= room:
            want[j] = True  # what the call overwrote: a replay tells written from unwritten
            room -= sizes[j] + 64
    return want, [o for o in outputs if o in kept]


def _paths(
    names: Any, args_tree: list[Any], kwargs_tree: dict[str, Any], not_kept: dict[str, Any]
) -> list[str]:
    """The argument paths of `not_kept`'s tensor indices."""
    from kdump.format import argtree

    try:
        paths = argtree.tensor_paths(names, args_tree, kwargs_tree)
    except Exception:  # a tree the paths cannot walk: the indices still say which
        paths = []
    return [paths[i] if i < len(paths) else f"tensor{i}" for i in not_kept["tensors"]]


def tensor_roles(
    st: HookState, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[Any]
) -> list[str | None]:
    """The spec role of each tensor's parameter (None: unknown)."""
    try:
        from kdump.kernels import registry

        spec = registry.spec_for(st.id, st.names())
        roles = {p.name: p.role.value for p in getattr(spec, "params", ())}
    except Exception:
        return [None] * len(tensors)
    names = st.names() or ()
    by_id: dict[int, str | None] = {}
    for name, value in list(zip(names, args)) + list(kwargs.items()):
        from kdump.format import argtree

        for t in argtree.tensors_in(value):
            by_id.setdefault(id(t), roles.get(name))
    return [by_id.get(id(t)) for t in tensors]


class SpanViews:
    """Per storage: a uint8 view of its span (the bytes the kernel reads), made when first
    asked for, and its address and size without one: a call's copies need the bytes of a few
    storages, device copies only their addresses."""

    __slots__ = ("_firsts", "_storages", "_tensors", "_views")

    def __init__(self, tensors: list[Any], firsts: tuple[int, ...], storages: list[Any]) -> None:
        self._tensors = tensors
        self._firsts = firsts
        self._storages = storages
        self._views: list[Any] = [None] * len(storages)

    def __len__(self) -> int:
        return len(self._storages)

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> Any:
        v = self._views[i]
        if v is None:
            from kdump.bundle.tensors import _byte_view

            s = self._storages[i]
            v = self._views[i] = _byte_view(
                self._tensors[self._firsts[i]], s.span_start, s.span_nbytes
            )
        return v

    def ptr(self, i: int) -> int:
        """The address of storage i's span (what its view's data_ptr() says)."""
        s = self._storages[i]
        return int(s.base_ptr) + int(s.span_start)

    def nbytes(self, i: int) -> int:
        return int(self._storages[i].span_nbytes)


def span_views(tensors: list[Any], records: list[Any], storages: list[Any]) -> SpanViews:
    """Per storage: its span view (`SpanViews`)."""
    return SpanViews(tensors, first_views(records, len(storages)), storages)
