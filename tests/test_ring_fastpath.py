"""The flight recorder's exact-repeat path (CPU): a call that repeats an earlier one (same
layouts, same static operands, same scalars; activations and outputs may be new tensor objects
over the same memory) writes the slot the full path writes, byte for byte but for the time;
whatever differs (a scalar, a tensor resized in place or swapped through `.data`, a new object
over the same memory whose storage has another size, a static operand's new version or a new
object for it) takes the full path. Each scenario is recorded twice on the same buffers, with
the repeat path and without it."""

from __future__ import annotations

import ctypes
import enum
import json
import struct
import sys
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.format.journal import SlotState
from kdump.record import repeat
from kdump.record.config import RingConfig
from kdump.record.flight import recorder as ring_module
from kdump.record.flight.journal_reader import read_journal

T = __name__


def gemm_like(a: torch.Tensor, w: torch.Tensor, layout: torch.Tensor, out: torch.Tensor, scale=1.0):
    with torch.no_grad():
        x = a.reshape(-1)[: out.numel()].view_as(out)
        out.copy_(x * float(scale) + layout[: out.shape[0], None])


def _buffers() -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(3)
    return {
        "a": torch.randn(16, 8, generator=g),
        "w": torch.randn(128, 256, generator=g),  # over statics.MIN_BYTES
        "layout": torch.zeros(16),
        "out": torch.zeros(16, 8),
        "g": g,
    }


# Each step changes the buffers (or not) and makes one call; `expect` says whether the repeat
# path may take it (None: either way, e.g. the second sighting of a key).
Step = Callable[[dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def _same(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    b["a"].copy_(torch.randn(16, 8, generator=b["g"]))  # contents (and the version) change
    b["layout"].copy_(torch.randint(-1, 4, (16,), generator=b["g"]).float())
    return (b["a"], b["w"], b["layout"], b["out"]), {"scale": 1.0}


def _scalar(value: Any) -> Step:
    def step(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, _ = _same(b)
        return args, {"scale": value}

    return step


def _resized(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    b["out"].resize_(8, 8)  # same address, new shape (and version)
    return _same(b)


def _restored(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    b["out"].resize_(16, 8)
    return _same(b)


def _new_object(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    b["a"] = b["a"].view(16, 8)  # another tensor object at the same address, same layout
    return _same(b)


def _other_storage_size(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # a new object at the output's address with its layout, over a storage of another size
    # (recorded in the slot): the memory stays owned by the first tensor, nothing reads past it
    out = b["keep"] = b["out"]
    raw = (ctypes.c_char * (out.numel() * out.element_size() + 64)).from_address(out.data_ptr())
    b["out"] = torch.frombuffer(raw, dtype=out.dtype)[: out.numel()].view(out.shape)
    assert b["out"].data_ptr() == out.data_ptr()
    return _same(b)


def _storage_back(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    b["out"] = b.pop("keep")
    return _same(b)


def _new_weight_object(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    b["w"] = b["w"].view(128, 256)  # the static operand's version belongs to its object
    return _same(b)


def _data_swap(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    a = b["a"]
    a.data = a.detach().view(8, 16)  # same object and address, new shape, version unchanged
    args, kw = _same_no_copy(b)
    return args, kw


def _data_back(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    a = b["a"]
    a.data = a.detach().view(16, 8)
    return _same_no_copy(b)


def _same_no_copy(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    b["layout"].copy_(torch.randint(-1, 4, (16,), generator=b["g"]).float())
    return (b["a"], b["w"], b["layout"], b["out"]), {"scale": 1.0}


def _grad(on: bool) -> Step:
    def step(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        b["a"].requires_grad_(on)  # recorded in the tensor's record; its version stays
        return _same_no_copy(b)

    return step


def _static_moved(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    b["w"].mul_(1.0)  # a new version of the static operand: copied again
    return _same(b)


STEPS: list[tuple[Step, bool | None]] = [
    (_same, False),  # first sighting
    (_same, None),  # second: the template is made (without a spec: the static copied now)
    (_same, None),
    (_same, True),
    (_scalar(0.5), False),
    (_scalar(0.5), None),
    (_scalar(0.5), True),
    (_scalar(1), False),  # an int where a float was: encoded differently
    (_scalar(-0.0), False),
    (_scalar(0.0), False),  # equal to -0.0, encoded differently
    (_same, True),
    (_resized, False),
    (_same, None),
    (_restored, None),  # back to the first layout: its template again
    (_same, True),
    (_new_object, True),  # an activation (not a static candidate) as a new object
    (_same, True),
    (_other_storage_size, False),
    (_storage_back, None),
    (_same, None),
    (_same, True),
    (_new_weight_object, False),
    (_same, None),
    (_same, None),
    (_same, True),
    (_data_swap, False),
    (_data_back, None),
    (_same, True),
    (_grad(True), False),
    (_grad(False), None),
    (_same, True),
    (_static_moved, False),
    (_same, None),
    (_same, None),
    (_same, True),
]


def _raw_docs(path: Path) -> dict[int, bytes]:
    """Per call index: the slot JSON exactly as written."""
    raw = path.read_bytes()
    got = read_journal(path)
    out = {}
    for rec in got.having(SlotState.COMPLETE):
        base = got.header.header_bytes + rec.index * got.header.slot_bytes
        (k,) = struct.unpack_from("<I", raw, base + 28)
        (jlen,) = struct.unpack_from("<I", raw, base + 64)
        start = base + 72 + 16 * k
        assert rec.meta is not None
        out[rec.meta.call_index] = raw[start : start + jlen]
    return out


def _record(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, fast: bool, target: str, call: Any
) -> tuple[dict[int, Any], list[bool], list[Path]]:
    bufs = _buffers()
    with pytest.MonkeyPatch.context() as mp:
        if not fast:
            mp.setattr(ring_module, "repeat_key", lambda *a: None)
        return _run(tmp_path, name, target, call, bufs)


def _run(
    tmp_path: Path, name: str, target: str, call: Any, bufs: dict[str, Any]
) -> tuple[dict[int, Any], list[bool], list[Path]]:
    ring = RingConfig(slots=64, slot_bytes=256 << 10, journal_dir=tmp_path / name / "shm")
    taken = []
    with kdump.recording(target, out=tmp_path / name / "out", mode="ring", ring=ring) as rec:
        r = rec.recorder
        for step, _ in STEPS:
            args, kwargs = step(bufs)
            before = r.fast_calls
            call()(*args, **kwargs)
            taken.append(r.fast_calls > before)
        assert r.errors == 0
        path = r.journal.path
        docs = _raw_docs(path)
        slots = {}
        names: dict[int, int] = {}  # each run has its own buffers: addresses by first use
        complete = read_journal(path).having(SlotState.COMPLETE)
        for s in sorted(complete, key=lambda s: s.meta.call_index):
            doc = json.loads(docs[s.meta.call_index])
            del doc["extra"]["time_ns"]
            for d in doc["storages"]:
                d["base_ptr"] = names.setdefault(d["base_ptr"], len(names))
            for d in doc["tensors"]:
                d["data_ptr"] = names.setdefault(d["data_ptr"], len(names))
            slots[s.meta.call_index] = (doc, s.payloads, s.finished, s.spans, s.meta.stream)
        rec.flush()
        written = list(rec.written)
    return slots, taken, written


def _bundles(paths: list[Path]) -> dict[int, Any]:
    out = {}
    for p in paths:
        with load_bundle(p) as b:
            for c in b.calls:
                meta = {k: v for k, v in c.meta.items() if k not in ("time_ns", "recorded_at")}
                meta["journal"] = {k: v for k, v in meta.get("journal", {}).items() if k != "path"}
                out[c.meta["call_index"]] = (meta, _clone(list(c.args)), _clone(dict(c.kwargs)))
    return out


def _clone(x: Any) -> Any:
    """The values, kept after the bundle is closed."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _compare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, call: Any, min_fast: int = 8
) -> None:
    fast, taken, fast_b = _record(tmp_path, "fast", monkeypatch, True, target, call)
    full, none, full_b = _record(tmp_path, "full", monkeypatch, False, target, call)
    assert not any(none)
    for i, ((_, expect), got) in enumerate(zip(STEPS, taken)):
        if expect is not None:
            assert got == expect, f"step {i}: repeat path {'not ' if expect else ''}taken"
    assert sum(taken) >= min_fast
    assert sorted(fast) == sorted(full) == list(range(len(STEPS)))
    for i in fast:
        assert fast[i] == full[i], f"call {i}"
    fb, ub = _bundles(fast_b), _bundles(full_b)
    assert sorted(fb) == sorted(ub) == list(range(len(STEPS)))
    for i in fb:
        (m1, a1, k1), (m2, a2, k2) = fb[i], ub[i]
        assert m1 == m2, f"call {i}"
        assert _equal(a1, a2) and _equal(k1, k2), f"call {i}"


def _equal(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return (
            isinstance(y, torch.Tensor)
            and (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride())
            and torch.equal(x, y)
        )
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_equal, x, y))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def test_repeat_path_writes_what_the_full_path_writes(tmp_path, monkeypatch):
    # No spec: statics by "seen unchanged at an earlier call" (the tensor object counts).
    _compare(tmp_path, monkeypatch, f"{T}:gemm_like", lambda: sys.modules[T].gemm_like)


def test_repeat_path_with_a_spec(tmp_path, monkeypatch):
    """A spec'd target (the DeepGEMM entry point, a stand-in that does nothing): roles pick the
    copied and static operands."""

    def m_grouped_fp8_gemm_nt_contiguous(*args: Any, **kwargs: Any) -> None:
        return None

    mod = types.ModuleType("deep_gemm")
    mod.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)

    def call() -> Any:
        return sys.modules["deep_gemm"].m_grouped_fp8_gemm_nt_contiguous

    def spec_args(b: dict[str, Any], scale: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # A scale tensor shared with the routing labels, and the output named twice: one
        # tensor table entry each.
        return ((b["a"], b["layout"]), (b["w"], b["out"]), b["out"], b["layout"]), {
            "disable_ue8m0_cast": True,
            "recipe": (1, 128, 128),
            "alpha": scale,
        }

    global STEPS
    steps = STEPS
    STEPS = [(_wrap(step, spec_args), expect) for step, expect in steps]
    try:
        _compare(tmp_path, monkeypatch, "deep_gemm:m_grouped_fp8_gemm_nt_contiguous", call)
    finally:
        STEPS = steps


def _wrap(step: Step, make: Any) -> Step:
    def wrapped(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        _, kw = step(b)
        return make(b, kw["scale"])

    return wrapped


def test_unknown_argument_types_take_the_full_path():
    class Opaque:
        pass

    assert repeat.fingerprint((Opaque(),), {}) is None
    assert repeat.fingerprint(([1, 2], {"k": 1.5}), {"x": None}) is not None
    t = torch.zeros(2)
    fp, tensors = repeat.fingerprint((t, (t, 1)), {"b": True})
    assert tensors == [t] and fp.count(fp[0]) == 2  # one tensor, named twice
    assert repeat.fingerprint((1,), {}) != repeat.fingerprint((True,), {})
    assert repeat.fingerprint((0.0,), {}) != repeat.fingerprint((-0.0,), {})


def test_fingerprint_inlines_container_items_as_the_walk_encodes_them():
    t, u = torch.zeros(2), torch.ones(3)
    fp, tensors = repeat.fingerprint(((t, 1, None, True), [u, t, "s"]), {"k": (2.5,)})
    T, K = repeat.TENSOR, repeat.KWARGS
    assert tensors == [t, u]
    assert fp == [
        tuple, 4, T, 0, int, 1, type(None), None, bool, True,
        list, 3, T, 1, T, 0, str, "s",
        K, "k", tuple, 1, float, "2.5",
    ]  # fmt: skip
    # the depth bound holds for inlined items too: a tensor one level too deep, no key
    deep: Any = t
    for _ in range(repeat.KEY_DEPTH + 1):
        deep = (deep,)
    assert repeat.fingerprint((deep,), {}) is None
    assert repeat.fingerprint((deep[0],), {}) is not None
    # and the item bound: a long flat tuple of ints
    assert repeat.fingerprint((tuple(range(repeat.KEY_ITEMS)),), {}) is None


def test_repeat_key_facts_are_the_facts_of_each_tensor():
    t = torch.zeros(4, 3)[1:].t()
    c = torch.zeros(2, dtype=torch.complex64).conj()
    key, tensors = repeat.repeat_key("x", "x", (t, (c, 1)), {})
    assert key[3][1][5]  # the conj bit
    assert key[3] == tuple(repeat.facts_of([x])[0] for x in tensors)


def _steps(steps: list[tuple[Step, bool | None]]) -> Any:
    """Run a test with STEPS replaced."""

    class _Swap:
        def __enter__(self) -> None:
            global STEPS
            self.saved, STEPS = STEPS, steps

        def __exit__(self, *exc: object) -> None:
            global STEPS
            STEPS = self.saved

    return _Swap()


def test_inference_mode_activations_with_a_normal_weight(tmp_path, monkeypatch):
    # Serving code runs under torch.inference_mode: its activations have no version counter,
    # the weights (loaded outside it) have one. Both paths record every call the same.
    plain = _buffers

    def buffers() -> dict[str, Any]:
        b = plain()
        with torch.inference_mode():
            for k in ("a", "layout", "out"):
                b[k] = b[k].clone()
        assert b["a"].is_inference() and not b["w"].is_inference()
        return b

    def inference(step: Step) -> Step:
        def wrapped(b: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            with torch.inference_mode():
                return step(b)

        return wrapped

    def call() -> Any:
        hooked = sys.modules[T].gemm_like

        def run(*a: Any, **k: Any) -> Any:
            with torch.inference_mode():
                return hooked(*a, **k)

        return run

    monkeypatch.setattr(sys.modules[T], "_buffers", buffers)
    same = inference(_same)
    steps = [(same, False), (same, None), (same, None), (inference(_scalar(0.5)), False)]
    steps += [(same, None)] * 2 + [(same, True)] * 8
    with _steps(steps):
        _compare(tmp_path, monkeypatch, f"{T}:gemm_like", call)


class Flags(enum.IntFlag):
    A = 1
    B = 2


def test_flag_values_without_a_name_are_told_apart(tmp_path, monkeypatch):
    # Flags(0), Flags(8) and Flags(16) all have no name: the key holds the value.
    steps = [(_scalar(Flags(0)), False), (_scalar(Flags(0)), None), (_scalar(Flags(0)), None)]
    steps += [(_scalar(Flags(0)), True)] * 6
    steps += [(_scalar(Flags(8)), False), (_scalar(Flags(16)), False), (_scalar(Flags.A), False)]
    with _steps(steps):
        _compare(tmp_path, monkeypatch, f"{T}:gemm_like", lambda: sys.modules[T].gemm_like, 6)


def sink(*args: Any, **kwargs: Any) -> None:
    return None


def test_self_referencing_and_huge_arguments_take_the_full_path(tmp_path):
    loop: list[Any] = [1]
    loop.append(loop)
    deep: Any = 0
    for _ in range(40):
        deep = [deep]
    x = torch.zeros(4)
    ring = RingConfig(slots=16, slot_bytes=64 << 10, journal_dir=tmp_path / "shm")
    with kdump.recording(f"{T}:sink", out=tmp_path / "out", mode="ring", ring=ring) as rec:
        for arg in (loop, loop, loop, deep, deep, deep, "s" * 10_000, "s" * 10_000, "s" * 10_000):
            sys.modules[T].sink(x, arg)
        r = rec.recorder
        assert r.errors == 0 and r.fast_calls == 0
        assert len(read_journal(r.journal.path).having(SlotState.COMPLETE)) == 9


def test_a_recently_used_template_outlives_newer_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(ring_module, "REPEATS_MAX", 4)
    x = torch.zeros(4)
    ring = RingConfig(slots=64, slot_bytes=64 << 10, journal_dir=tmp_path / "shm")
    with kdump.recording(f"{T}:sink", out=tmp_path / "out", mode="ring", ring=ring) as rec:
        r = rec.recorder

        def fast(v: int) -> bool:
            before = r.fast_calls
            sys.modules[T].sink(x, v)
            return r.fast_calls > before

        for v in (1, 2, 3, 4):  # two sightings each: four templates, the cache full
            fast(v)
            fast(v)
        assert fast(1)  # used: now the most recent
        fast(5)
        fast(5)  # a fifth template: the least recently used (2) goes
        assert fast(1) and fast(3) and fast(4) and fast(5)
        assert not fast(2)
        assert r.errors == 0


def _rep(tensors: list[Any], pinned: frozenset[int] = frozenset()) -> Any:
    """What a lane reads of its repeat (`repeat.Learned`): weak references to the tensors, the ones
    that must be the same objects again, and each tensor's storage size."""
    return types.SimpleNamespace(
        refs=tuple(weakref.ref(t) for t in tensors),
        pinned=pinned,
        storage_nbytes=tuple(t.untyped_storage().nbytes() for t in tensors),
    )


def _renew(t: torch.Tensor) -> torch.Tensor:
    return t.as_strided(t.shape, t.stride(), t.storage_offset())


def test_a_lane_takes_new_objects_over_the_same_memory_where_the_key_would():
    """New tensor objects with the learned facts (a serving step's activations in the caching
    allocator's blocks of the step before) pass a lane and find it by their addresses, unless
    the tensor's repeat pins its object (a static candidate), its storage has another size, or
    the objects are not as distinct as the learned ones."""
    a, s, w = torch.zeros(4, 8), torch.ones(4), torch.zeros(2, 8)
    twin = a.view(4, 8)  # another object with a's facts

    def call(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs

    base = call((a, s), w, twin, k=s)
    seen = repeat.repeat_key("t", "t", *base)
    assert len(seen[1]) == 4
    lane = repeat.Lane.of(_rep(seen[1], frozenset({2})), *base, seen)  # w pinned
    assert lane is not None
    ra, rs, rt = _renew(a), _renew(s), _renew(a)
    new = call((ra, rs), w, rt, k=rs)
    assert repeat.probe("t", "t", *new) == repeat.probe("t", "t", *base)
    assert repeat.repeat_key("t", "t", *new)[0] == seen[0]
    got = lane.tensors(*new)
    assert got is not None and [x is y for x, y in zip(got, [ra, rs, w, rt])] == [True] * 4
    # the weight as a new object: its version belongs to the pinned one
    assert lane.tensors(*call((ra, rs), _renew(w), rt, k=rs)) is None
    # one object at both of a's places where the learned call had two: another key
    assert lane.tensors(*call((ra, rs), w, ra, k=rs)) is None
    assert repeat.repeat_key("t", "t", *call((ra, rs), w, ra, k=rs))[0] != seen[0]
    # a later place of s holding another object with its facts
    assert lane.tensors(*call((ra, rs), w, rt, k=_renew(s))) is None
    # a's address and layout over a storage of another size
    raw = (ctypes.c_char * (a.numel() * 4 + 64)).from_address(a.data_ptr())
    wider = torch.frombuffer(raw, dtype=a.dtype)[: a.numel()].view(4, 8)
    assert wider.data_ptr() == a.data_ptr()
    assert lane.tensors(*call((wider, rs), w, rt, k=rs)) is None
    # the learned objects themselves still pass
    assert lane.tensors(*base) == seen[1]


def test_a_tensor_without_an_address_gives_no_probe():
    # a sparse tensor has no storage to give an address: no lane (the repeat key decides)
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True)
    assert repeat.probe("t", "t", (sparse, torch.zeros(2)), {}) is None
    assert repeat.probe("t", "t", ((torch.zeros(2), sparse),), {}) is None
    assert repeat.probe("t", "t", ((torch.zeros(2), 3),), {"k": 1}) is not None


def test_a_lane_takes_exactly_the_calls_whose_repeat_key_is_the_same():
    """A lane (the repeat path's check without the repeat key) gives the call's tensors where
    the key would be equal, else None: containers rebuilt per call are fine, other scalar types,
    container types or lengths, other tensor objects and changed facts are not."""
    a, s, w, out = torch.zeros(4, 8), torch.ones(4), torch.zeros(2, 8), torch.zeros(4, 2)

    def call(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs

    base = call((a, s), w, out, 1, "nt", flag=True)
    seen = repeat.repeat_key("t", "t", *base)
    rep = _rep(seen[1])
    lane = repeat.Lane.of(rep, *base, seen)  # type: ignore[arg-type]
    assert lane is not None
    same = call((a, s), w, out, 1, "nt", flag=True)  # a new tuple holding the same tensors
    assert lane.tensors(*same) == seen[1]
    assert repeat.repeat_key("t", "t", *same)[0] == seen[0]
    differ = [
        call((a, s), w, out, True, "nt", flag=True),  # bool for int
        call([a, s], w, out, 1, "nt", flag=True),  # list for tuple
        call((a, s, s), w, out, 1, "nt", flag=True),
        call((a, s.clone()), w, out, 1, "nt", flag=True),
        call((a, s), w, out, 1, "tn", flag=True),
        call((a, s), w, out, 1, "nt", flag=1),
        call((a, s), w, out, 1, "nt"),
        call((a, s), w, out, 1, flag=True),
    ]
    for args, kwargs in differ:
        assert lane.tensors(args, kwargs) is None
        assert repeat.repeat_key("t", "t", args, kwargs)[0] != seen[0]
    w.requires_grad_(True)  # a fact of the record, with no version bump
    assert lane.tensors(*same) is None
    w.requires_grad_(False)
    a.data = a.detach().view(8, 4)  # same object and address, other shape
    assert lane.tensors(*same) is None
    # deeper arguments keep the repeat key
    deep = call(((a, s),), w)
    assert repeat.Lane.of(rep, *deep, repeat.repeat_key("t", "t", *deep)) is None


def test_a_lane_checks_each_tensor_once_and_sees_in_place_metadata_changes():
    """A tensor named at two places is checked at each (the same object) and its facts once;
    resize_, as_strided_ and set_ on the same object change its facts: no lane, as no key."""
    a, s, out = torch.zeros(4, 8), torch.ones(4), torch.zeros(4, 2)

    def call(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs

    base = call((a, s), out, s, k=out)
    seen = repeat.repeat_key("t", "t", *base)
    rep = _rep(seen[1])
    lane = repeat.Lane.of(rep, *base, seen)  # type: ignore[arg-type]
    assert lane is not None and len(seen[1]) == 3
    assert [f is not None for *_, f in lane.places] == [True, True, True, False, False]
    assert lane.tensors(*call((a, s), out, s, k=out)) == seen[1]
    assert lane.tensors(*call((a, s), out, s.clone(), k=out)) is None  # another address
    assert lane.tensors(*call((a, s), out, s, k=a)) is None
    for change, undo in (
        (lambda: out.resize_(2, 4), lambda: out.resize_(4, 2)),
        (lambda: out.as_strided_((4, 2), (1, 4)), lambda: out.as_strided_((4, 2), (2, 1))),
        (lambda: out.as_strided_((3, 2), (2, 1), 1), lambda: out.as_strided_((4, 2), (2, 1), 0)),
    ):
        change()
        args, kwargs = call((a, s), out, s, k=out)
        assert lane.tensors(args, kwargs) is None
        assert repeat.repeat_key("t", "t", args, kwargs)[0] != seen[0]
        undo()
        assert lane.tensors(*call((a, s), out, s, k=out)) == seen[1]
    keep = out.detach()  # the old storage stays alive: set_ moves `out` to another address
    out.set_(torch.zeros(4, 2).untyped_storage())
    assert lane.tensors(*call((a, s), out, s, k=out)) is None
    out.set_(keep)
    assert lane.tensors(*call((a, s), out, s, k=out)) == seen[1]
