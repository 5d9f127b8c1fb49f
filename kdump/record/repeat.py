"""The same call again: the one definition of a repeated call, used by both recorders.

A call repeats an earlier one when its repeat key (`repeat_key`) is equal: the same target, the
same argument structure and scalar values (`fingerprint`), and tensors with the same layout
facts (`facts_of`: address, shape, strides, dtype, offset, lazy bits, requires_grad). Calls with
equal keys encode equal argument trees and tensor layouts, so a recorder may write the second
one from what it kept of the first: the flight recorder's slot template
(kdump.record.flight.again), the sync recorder's bundle form (kdump.record.sync.repeat).

The flight recorder finds most repeats without building the key: `probe` (the arguments'
addresses and identities) leads to a `Lane`, which checks the call against the repeat it took
last and gives its tensors exactly when the key would be the repeat's own.

`Repeats` is the table both recorders keep their repeats in: least recently used first, and a
repeat is made only for a key sighted before (a call that never repeats pays nothing for one).

Nothing here imports torch at import time (the CLI stays light); torch's types are looked up at
the first key.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Generic, Protocol, TypeVar

TENSOR = object()  # `fingerprint`: a tensor follows (its index in the call's tensor list)
KWARGS = object()  # `fingerprint`: the keyword arguments follow
_LEAVES = frozenset({type(None), bool, int, str})  # exact types: equal values encode equally
_INLINE_LEAVES = frozenset({type(None), bool, int})  # `_walk`'s leaves without a length check
_LANE_LEAVES = _LEAVES  # a lane's leaves: compared with ==, encoded as their value
# A repeat key's bounds (argtree.encode cuts deeper or larger trees with placeholders, and the
# keys are kept): beyond them a call takes the full path.
KEY_DEPTH = 16
KEY_ITEMS = 2048  # entries of the flat key
KEY_STR = 4096  # characters of one string

Seen = tuple[Any, list[Any]]  # (repeat key, the call's tensors in argtree's order)


def _tensor_types() -> tuple[type, ...]:
    import torch

    return (torch.Tensor, torch.nn.Parameter)


_TENSOR_TYPES: tuple[type, ...] = ()


def fingerprint(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The call's arguments as a flat list that compares equal exactly when their argument trees
    encode equally given the same tensors (containers, scalar types and values, which positions
    hold the same tensor object), and the tensors in argtree's order. None: a value whose
    encoding may change while it compares equal (a mutable or unknown object, a tensor
    subclass): such calls always take the full path."""
    global _TENSOR_TYPES
    if not _TENSOR_TYPES:
        _TENSOR_TYPES = _tensor_types()
    out: list[Any] = []
    tensors: list[Any] = []
    at: dict[int, int] = {}  # id -> index: the tensors stay alive in `tensors` meanwhile
    for v in args:
        if not _walk(v, out, tensors, at):
            return None  # type: ignore[return-value]
    out.append(KWARGS)
    for k, v in kwargs.items():
        out.append(k)
        if not _walk(v, out, tensors, at):
            return None  # type: ignore[return-value]
    return out, tensors


def _walk(v: Any, out: list[Any], tensors: list[Any], at: dict[int, int], depth: int = 0) -> bool:
    if depth > KEY_DEPTH or len(out) > KEY_ITEMS:  # deep, large or self-referencing
        return False
    tp = type(v)
    if tp in _TENSOR_TYPES:
        i = at.get(id(v))
        if i is None:
            i = at[id(v)] = len(tensors)
            tensors.append(v)
        out += (TENSOR, i)
        return True
    if tp in _LEAVES:
        if tp is str and len(v) > KEY_STR:
            return False
        out += (tp, v)
        return True
    if tp is tuple or tp is list:
        out += (tp, len(v))
        inline = depth < KEY_DEPTH  # what `_walk(x, ..., depth + 1)` checks first
        for x in v:  # a loop, not all(): a generator per container costs a microsecond
            # Tensors and non-string leaves inline, as `_walk` would encode them: a call per
            # item was a third of the walk for DeepGEMM's (tensor, scales) pairs.
            tx = type(x)
            if inline and len(out) <= KEY_ITEMS:
                if tx in _TENSOR_TYPES:
                    i = at.get(id(x))
                    if i is None:
                        i = at[id(x)] = len(tensors)
                        tensors.append(x)
                    out += (TENSOR, i)
                    continue
                if tx in _INLINE_LEAVES:
                    out += (tx, x)
                    continue
            if not _walk(x, out, tensors, at, depth + 1):
                break
        else:
            return True
        return False
    if tp is dict:
        out += (tp, len(v))
        for k, x in v.items():
            if not (
                _walk(k, out, tensors, at, depth + 1) and _walk(x, out, tensors, at, depth + 1)
            ):
                break
        else:
            return True
        return False
    if tp is float:  # the encoding is the repr: -0.0 and 0.0 differ, nan equals nan
        out += (tp, repr(v))
        return True
    import enum

    import torch

    if tp is torch.dtype or tp is torch.device:
        out += (tp, v)
        return True
    if isinstance(v, enum.Enum) and type(v.value) in _LEAVES:
        # by value: flag values without a name (IntFlag(0), unnamed bits) share name None
        out += (tp, type(v.value), v.value)
        return True
    return False


def repeat_key(
    target: str, called_as: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Seen | None:
    """(key, tensors): calls with equal keys encode equal argument trees and tensor layouts
    (`fingerprint`, `facts_of`); None: the call cannot repeat exactly (`fingerprint`)."""
    seen = fingerprint(args, kwargs)
    if seen is None:
        return None
    structure, tensors = seen
    return (target, called_as, tuple(structure), facts_of(tensors)), tensors


def facts_of(tensors: list[Any]) -> tuple[tuple[Any, ...], ...]:
    """What the recorded layout of each tensor depends on besides its version: the layout
    facts of the tensor record (kdump.bundle.tensors.layout_facts), the lazy conj / neg bits and
    requires_grad (`.data =` and `requires_grad_` change them without bumping the version); the
    device where the address does not tell it. One loop for all of a call's tensors: a call per
    tensor costs the repeat path a microsecond."""
    out = []
    for t in tensors:
        p = t.data_ptr()
        out.append(
            (
                p,
                t.shape,
                t.stride(),
                t.dtype,
                t.storage_offset(),
                t.is_conj(),
                t.is_neg(),
                t.requires_grad,
                None if p else t.device,
            )
        )
    return tuple(out)


def probe(target: str, called_as: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where to look for a call's lane: the addresses of its tensor arguments and the
    identities of its other arguments, the same of the items of its list and tuple arguments
    one level down, and its keyword names (cheap, and distinct for the layers of a model, whose
    weights differ; a lane checks the rest). Addresses, not identities, for tensors: a serving
    loop's activations are new objects over the same memory at every step. None where a
    tensor has no address to give (no storage): no lane, the repeat key decides."""
    global _TENSOR_TYPES
    if not _TENSOR_TYPES:
        _TENSOR_TYPES = _tensor_types()
    kinds = _TENSOR_TYPES
    ids: list[Any] = [target, called_as, len(args), *kwargs]
    try:
        for v in (*args, *kwargs.values()) if kwargs else args:
            tp = type(v)
            if tp is tuple or tp is list:
                ids.append(len(v))
                ids += [x.data_ptr() if type(x) in kinds else id(x) for x in v]
            elif tp in kinds:
                ids.append(v.data_ptr())
            else:
                ids.append(id(v))
    except RuntimeError:
        return None
    return tuple(ids)


class Learned(Protocol):
    """What a lane and `stands_for` read of a learned call (the flight recorder's repeat)."""

    # weak references to its tensors, the ones that must be the same objects again (static
    # candidates: their versions say whether the static copy holds), each tensor's storage size
    refs: tuple[Any, ...]
    pinned: frozenset[int]
    storage_nbytes: tuple[int, ...]


def stands_for(rep: Learned, k: int, t: Any) -> bool:
    """Whether `t` may stand for tensor `k` of the call `rep` was made from, its facts being
    equal: that very object, or, unless the tensor is pinned (a static candidate: its version
    belongs to its object), a new object whose storage has the recorded size."""
    if rep.refs[k]() is t:
        return True
    if k in rep.pinned:
        return False
    try:
        return bool(t.untyped_storage().nbytes() == rep.storage_nbytes[k])
    except Exception:  # no storage to ask: the full path decides
        return False


class Lane:
    """A repeat recognised without its repeat key: the arguments' shape one level deep (list and
    tuple arguments of tensors and plain leaves), the tensors expected at each place (weak
    references: the same objects, or new objects over the same memory as `stands_for` takes
    them) and their `facts_of`. `tensors` gives the call's tensor list, as `repeat_key` would,
    exactly when the key would be the repeat's own; else None."""

    __slots__ = ("containers", "facts", "kwkeys", "leaves", "nargs", "places", "rep")

    def __init__(self, rep: Any, nargs: int, kwkeys: tuple[str, ...]) -> None:
        self.rep = rep
        self.nargs = nargs
        self.kwkeys = kwkeys
        self.containers: list[tuple[int, type, int]] = []  # (argument, type, length)
        self.leaves: list[tuple[int, int, type, Any]] = []  # (argument, item or -1, type, value)
        # (argument, item or -1, tensor index, its `facts_of` at its first place, else None)
        self.places: list[tuple[int, int, int, Any]] = []
        self.facts: tuple[Any, ...] = ()

    @classmethod
    def of(
        cls, rep: Learned, args: tuple[Any, ...], kwargs: dict[str, Any], seen: Seen
    ) -> Lane | None:
        """The lane of a call whose repeat key `seen` found `rep` (a `Learned`); None for
        arguments deeper than a lane checks (they keep the repeat key)."""
        key, tensors = seen
        lane = cls(rep, len(args), tuple(kwargs))
        at = {id(t): i for i, t in enumerate(tensors)}
        for i, v in enumerate((*args, *kwargs.values())):
            tp = type(v)
            if tp in _TENSOR_TYPES:
                lane.places.append((i, -1, at[id(v)], None))
            elif tp in _LANE_LEAVES and not (tp is str and len(v) > KEY_STR):
                lane.leaves.append((i, -1, tp, v))
            elif tp is tuple or tp is list:
                lane.containers.append((i, tp, len(v)))
                for j, x in enumerate(v):
                    tx = type(x)
                    if tx in _TENSOR_TYPES:
                        lane.places.append((i, j, at[id(x)], None))
                    elif tx in _LANE_LEAVES and not (tx is str and len(x) > KEY_STR):
                        lane.leaves.append((i, j, tx, x))
                    else:
                        return None
            else:
                return None
        if len(at) != len(rep.refs):
            return None
        lane.facts = facts = key[3]
        # Each tensor's facts are checked where it first appears (`tensors`): one pass.
        firsts: set[int] = set()
        for n, (i, j, k, _) in enumerate(lane.places):
            if k not in firsts:
                firsts.add(k)
                lane.places[n] = (i, j, k, facts[k])
        if len(firsts) != len(facts):  # every tensor has a place: `tensors` fills each
            return None
        return lane

    def tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
        if len(args) != self.nargs:
            return None
        if kwargs:
            if tuple(kwargs) != self.kwkeys:
                return None
            vals = (*args, *kwargs.values())
        elif self.kwkeys:
            return None
        else:  # the common case: no keywords, nothing to join
            vals = args
        for i, tp, n in self.containers:
            c = vals[i]
            if type(c) is not tp or len(c) != n:
                return None
        for i, j, tp, v in self.leaves:
            x = vals[i] if j < 0 else vals[i][j]
            if type(x) is not tp or x != v:
                return None
        rep: Any = self.rep
        refs = rep.refs
        out: list[Any] = [None] * len(refs)
        renewed = False  # a tensor is a new object (over the same memory, if its facts hold)
        for i, j, k, facts in self.places:
            x = vals[i] if j < 0 else vals[i][j]
            if facts is None:  # a later place of tensor k: the object of its first place
                if x is not out[k]:
                    return None
                continue
            # `facts_of([x])[0] != facts`, inline: a call per tensor costs the lane a
            # microsecond; the first fact (the address) tells most changes apart
            p = x.data_ptr()
            if (
                p,
                x.shape,
                x.stride(),
                x.dtype,
                x.storage_offset(),
                x.is_conj(),
                x.is_neg(),
                x.requires_grad,
                None if p else x.device,
            ) != facts:
                return None
            if x is not refs[k]():
                if not stands_for(rep, k, x):
                    return None
                renewed = True
            out[k] = x
        # As the repeat key: distinct objects where the template had them (one object at two
        # first places is another key).
        if renewed and len(set(map(id, out))) != len(out):
            return None
        return out


R = TypeVar("R")


class Repeats(OrderedDict[Any, R], Generic[R]):
    """Repeats by repeat key, least recently used first, at most `most` of them; and the hashes
    of the keys sighted once, at most `sightings`: a repeat is made for a key sighted before.
    Only hashes are kept of sightings: a collision costs one attempt to make a repeat, and a
    repeat is used only for its own exact key. Threads may share it (each step is one dict
    operation; what another thread took out meanwhile is simply not there)."""

    def __init__(self, most: int, sightings: int) -> None:
        super().__init__()
        self.most = most
        self.sightings = sightings
        self._sighted: dict[int, None] = {}

    def use(self, key: Any) -> R | None:
        """The repeat of `key`, now the most recently used; None if there is none."""
        rep = self.get(key)
        if rep is not None:
            try:
                self.move_to_end(key)
            except KeyError:  # another thread evicted it meanwhile
                pass
        return rep

    def sighted_before(self, key: Any) -> bool:
        """Whether a repeat may be made for `key`: it has one, or it was sighted before (the
        first sighting is noted, the oldest sighting forgotten when there are too many)."""
        if key in self:
            return True
        h = hash(key)
        if h in self._sighted:
            return True
        if len(self._sighted) >= self.sightings:
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                self._sighted.pop(next(iter(self._sighted)))
        self._sighted[h] = None
        return False

    def keep(self, key: Any, rep: R) -> None:
        """Keep `rep` as the most recently used repeat of `key`; the least recently used go
        beyond `most`."""
        self[key] = rep
        self.move_to_end(key)
        while len(self) > self.most:
            try:
                self.popitem(last=False)
            except KeyError:  # emptied by another thread meanwhile
                break
