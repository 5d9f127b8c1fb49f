"""Edge inputs through the flight recorder (and the sync recorder where it shares the path):
recording -> journal -> salvage -> bundle -> reference replay, on CPU tensors."""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.kernels.registry import spec_for
from kdump.record.config import RingConfig
from kdump.replay import replay

T = __name__


class Color(enum.Enum):
    RED = 1


def target(*args: Any, **kwargs: Any) -> None:
    return None


def _ring(tmp_path: Path, slots: int = 4, slot_bytes: int = 1 << 20) -> RingConfig:
    return RingConfig(slots=slots, slot_bytes=slot_bytes, journal_dir=tmp_path / "shm")


def _record(tmp_path: Path, mode: str, call: Any, name: str = f"{T}:target", **kw: Any) -> list:
    """Run `call()` under a recording of `name`; the bundles written, newest first (ring)."""
    opts: dict[str, Any] = {"out": tmp_path / "out", "mode": mode}
    if mode == "ring":
        opts["ring"] = _ring(tmp_path, **kw)
    with kdump.recording(name, **opts) as rec:
        call()
        if mode == "ring":
            rec.flush()
        written = list(rec.written)
    assert written, f"no bundle ({mode})"
    return written


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor):
        if not isinstance(y, torch.Tensor):
            return False
        if (x.dtype, x.shape, x.stride(), x.requires_grad) != (y.dtype, y.shape, y.stride(),
                                                               y.requires_grad):  # fmt: skip
            return False
        a = x.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        b = y.detach().contiguous().reshape(-1)
        return a.numel() == 0 or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same, x, y))
    if isinstance(x, dict):
        return isinstance(y, dict) and list(x) == list(y) and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, float) and x != x:
        return isinstance(y, float) and y != y
    return type(x) is type(y) and x == y


EDGE_TENSORS = {
    "zero_rows": lambda: torch.empty(0, 8),
    "zero_middle_dim": lambda: torch.empty(3, 0, 8),
    "zero_dim": lambda: torch.tensor(3.5),
    "expanded": lambda: torch.randn(1, 8).expand(5, 8),
    "expanded_scalar": lambda: torch.tensor(2.0).expand(4, 4),
    "transposed": lambda: torch.randn(4, 6).t(),
    "odd_strides": lambda: torch.randn(10, 10)[1::3, 2::4],
    "storage_offset": lambda: torch.randn(100)[37:50],
    "empty_at_the_end": lambda: torch.randn(10)[10:],
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "bool": lambda: torch.tensor([True, False, True]),
    "complex64": lambda: torch.randn(3, dtype=torch.complex64),
    "uint16": lambda: torch.arange(5).to(torch.uint16),
    "uint32": lambda: torch.arange(5).to(torch.uint32),
    "uint64": lambda: torch.arange(5).to(torch.uint64),
    "bfloat16": lambda: torch.randn(5).to(torch.bfloat16),
    "float8_e4m3fn": lambda: torch.randn(5).to(torch.float8_e4m3fn),
    "float8_e5m2": lambda: torch.randn(5).to(torch.float8_e5m2),
    "float8_e4m3fnuz": lambda: torch.randn(5).to(torch.float8_e4m3fnuz),
    "float8_e5m2fnuz": lambda: torch.randn(5).to(torch.float8_e5m2fnuz),
    "float8_e8m0fnu": lambda: torch.randn(5).abs().to(torch.float8_e8m0fnu),
    "requires_grad": lambda: torch.randn(5, requires_grad=True),
    "non_leaf": lambda: torch.randn(5, requires_grad=True) * 2,
}


@pytest.mark.parametrize("mode", ["ring", "sync"])
@pytest.mark.parametrize("name", sorted(EDGE_TENSORS))
def test_edge_tensor_round_trips_exactly(tmp_path, mode, name):
    torch.manual_seed(0)
    t = EDGE_TENSORS[name]()
    base = torch.arange(10.0)
    args = (t, base[:6], base[2:8])  # and two overlapping views of one storage
    written = _record(tmp_path, mode, lambda: target(*args))
    with load_bundle(written[0]) as b:
        b.verify()
        call = b.calls[0]
        assert not call.synthesized
        assert all(_same(x, y) for x, y in zip(args, call.args)), name


@pytest.mark.parametrize("mode", ["ring", "sync"])
def test_odd_argument_trees_and_kwargs_only(tmp_path, mode):
    odd = "x\x00y\u202e\n\x1b[31m"
    kwargs = {
        "tree": (1, [2.5, None, {"a": torch.ones(2), "b": (True, -(2**70))}], odd),
        "k\u00e9": odd,
        "nan": float("nan"),
        "inf": float("-inf"),
        "enum": Color.RED,
    }
    written = _record(tmp_path, mode, lambda: target(**kwargs))
    with load_bundle(written[0]) as b:
        call = b.calls[0]
        assert call.args == [] or call.args == ()
        got = dict(call.kwargs)
        assert _same(got["tree"], kwargs["tree"]) and got["k\u00e9"] == odd
        assert got["nan"] != got["nan"] and got["inf"] == float("-inf")
        assert got["enum"].name == "RED"  # an enum of another module is kept by name


# ---------------------------------------------------------------------------------------------
# DeepGEMM-shaped calls with edge routing, replayed on the torch reference


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    """A `deep_gemm` whose entry points compute the spec's reference (the DeepGEMM specs)."""
    mod = types.ModuleType("deep_gemm")

    def entry(fname: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            spec = spec_for(f"deep_gemm:{fname}")
            bound = spec.bind(list(args), kwargs)
            for out, value in spec.reference(bound).items():
                bound[out].copy_(value)

        call.__name__ = fname
        return call

    for fname in (
        "m_grouped_fp8_gemm_nt_contiguous",
        "m_grouped_fp8_gemm_nt_masked",
        "m_grouped_bf16_gemm_nt_masked",
    ):
        setattr(mod, fname, entry(fname))
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    return mod


CONTIG = "m_grouped_fp8_gemm_nt_contiguous"
MASKED = "m_grouped_fp8_gemm_nt_masked"
SMALL = {"num_groups": 4, "n": 128, "k": 256}
ROUTINGS = {
    "masked_every_masked_m_0": (MASKED, {"group_sizes": [0] * 4, "max_m": 64}, None),
    "masked_bf16_every_masked_m_0": (
        "m_grouped_bf16_gemm_nt_masked",
        {"group_sizes": [0] * 4, "max_m": 64},
        None,
    ),
    "masked_max_m_0": (MASKED, {"group_sizes": [0] * 4, "max_m": 0}, None),
    "labels_all_minus_1": (CONTIG, {"expected_m": 30}, "all -1"),
    "psum_all_ends_0": (CONTIG, {"group_sizes": [0] * 4, "use_psum_layout": True}, None),
    "psum_all_ends_equal": (CONTIG, {"group_sizes": [128, 0, 0, 0], "use_psum_layout": True}, None),
    "contiguous_no_rows": (CONTIG, {"group_sizes": [0] * 4}, None),
}


@pytest.mark.parametrize("case", sorted(ROUTINGS))
def test_edge_routing_is_recorded_whole_and_replays_clean(tmp_path, fake_deep_gemm, case):
    fname, shape, tweak = ROUTINGS[case]
    spec = spec_for(f"deep_gemm:{fname}")
    args, kwargs = spec.generate(seed=3, **SMALL, **shape)
    if tweak == "all -1":
        args[3].fill_(-1)

    def calls() -> None:
        for _ in range(3):  # the full path, then the repeat path
            getattr(fake_deep_gemm, fname)(*args, **kwargs)

    written = _record(tmp_path, "ring", calls, name=f"deep_gemm:{fname}", slot_bytes=4 << 20)
    assert len(written) == 3
    for path in written:
        with load_bundle(path) as b:
            b.verify()
            call = b.calls[0]
            # Only the output is made up at replay: every input, empty or not, is held.
            assert set(call.synthesized) <= {"d"}, (path.name, call.synthesized)
            assert "missing_tensors" not in call.meta["journal"] or call.synthesized == ["d"]
    [v] = replay([written[-1]], backend="reference", device="cpu")
    assert v.exit_code == 0, v.headline()


# ---------------------------------------------------------------------------------------------
# Calls that raise, recurse, or run on two threads


class KernelRefused(Exception):
    pass


def raiser(x: torch.Tensor) -> None:
    x.add_(1)  # changed before raising: the bundle holds the value the call was given
    raise KernelRefused("bad layout \x1b[31m")


def recursive(x: torch.Tensor, n: int) -> torch.Tensor:
    return recursive(x + 1, n - 1) if n > 0 else x


@pytest.mark.parametrize("mode", ["ring", "sync"])
def test_a_call_that_raises_propagates_and_its_bundle_says_it_raised(tmp_path, mode):
    x = torch.zeros(3)
    seen: list[BaseException] = []

    def call() -> None:
        for _ in range(2):  # the full path, then the repeat path
            try:
                raiser(x)
            except KernelRefused as exc:  # the program catches it and goes on
                seen.append(exc)
        target(x)  # a later call that returns

    opts: dict[str, Any] = {"out": tmp_path / "out", "mode": mode, "on_exception": mode == "sync"}
    if mode == "ring":
        opts["ring"] = _ring(tmp_path)
    with kdump.recording([f"{T}:raiser", f"{T}:target"], **opts) as rec:
        call()
        if mode == "ring":
            rec.flush()
        written = list(rec.written)
    assert [type(e) for e in seen] == [KernelRefused] * 2 and str(seen[0]) == "bad layout \x1b[31m"
    raised = []
    for path in written:
        with load_bundle(path) as b:
            c = b.calls[0]
            if c.target.endswith(":raiser"):
                raised.append(float(c.args[0][0]))
                assert c.meta["exception"] == "KernelRefused: bad layout \x1b[31m"
                if mode == "ring":
                    facts = c.meta["journal"]
                    assert facts["raised"] and not facts["in_flight"] and not facts["finished"]
            else:
                assert "exception" not in c.meta
                assert mode != "ring" or not c.meta["journal"].get("raised")
    assert sorted(raised) == [0.0, 1.0]
    if mode == "ring":
        assert not list((tmp_path / "shm").iterdir())  # the journal and its notes are gone


def test_recursion_records_the_outer_call(tmp_path):
    x = torch.zeros(2)
    written = _record(tmp_path, "ring", lambda: recursive(x, 3), name=f"{T}:recursive")
    assert len(written) == 1  # the inner calls pass through unrecorded
    with load_bundle(written[0]) as b:
        assert b.calls[0].args[1] == 3 and torch.equal(b.calls[0].args[0], x)


# ---------------------------------------------------------------------------------------------
# Salvage of journals in odd states: never raises, never loses a complete slot

STORAGE = {
    "device": "cpu",
    "base_ptr": 4096,
    "storage_nbytes": 8,
    "span_start": 0,
    "span_nbytes": 8,
}
TENSOR = {"storage": 0, "dtype": "float32", "shape": [2], "stride": [1], "storage_offset": 0}


ODD_SLOTS = {
    # checksums hold, the metadata does not (a writer bug or stray bytes under a valid CRC)
    "tensor_names_a_storage_not_there": ({"tensors": [{**TENSOR, "storage": 3}]}, "complete"),
    "graph_site_not_a_mapping": ({"capture_id": 3, "extra": {"site": "x"}}, "complete"),
    "eager_seq_unhashable": ({"capture_id": 3, "extra": {"site": {"eager_seq": [1]}}}, "complete"),
    "device_index_unhashable": ({"extra": {"device": {"device_index": [0]}}}, "in flight"),
}


@pytest.mark.parametrize("case", sorted(ODD_SLOTS))
def test_salvage_keeps_the_good_slots_beside_an_unusable_one(tmp_path, case):
    from kdump.format.journal import SlotMeta
    from kdump.record.flight.journal import Journal
    from kdump.record.flight.salvage import salvage_journal

    change, state = ODD_SLOTS[case]
    j = Journal.create(tmp_path / "shm", slots=4, slot_bytes=64 << 10)
    good = {"target": f"{T}:target", "storages": [STORAGE], "tensors": [TENSOR]}
    j.record(SlotMeta(call_index=0, **good), [bytes(range(8))])
    odd = SlotMeta(call_index=1, **{**good, **change})
    if state == "complete":
        j.record(odd, [bytes(8)])
    else:  # reserved, its device copies never ran
        j.reserve(odd).commit(device=True)
    j.record(SlotMeta(call_index=2, **good), [bytes(range(8, 16))])
    j.close()
    res = salvage_journal(j.path, tmp_path / "out")
    kept = {}
    for path in res.bundles:
        with load_bundle(path) as b:
            b.verify()
            kept[b.calls[0].meta["journal"]["call_index"]] = b.calls[0].args
    assert {0, 2} <= set(kept)
    assert kept.get(1) is not None or len(res.torn) + len(res.in_flight) == 1
    assert res.report.exists() and not j.path.exists()


def test_a_call_too_big_for_a_slot_leaves_recording_on_for_the_next_calls(tmp_path):
    from kdump.log import _logged

    _logged.clear()
    x = torch.arange(4.0)

    def calls() -> None:
        target(x, "y" * (64 << 10))  # its metadata alone exceeds the slot
        for i in range(3):
            target(x, i)

    opts: dict[str, Any] = {"out": tmp_path / "out", "mode": "ring"}
    with kdump.recording(f"{T}:target", ring=_ring(tmp_path, 4, 32 << 10), **opts) as rec:
        calls()
        rec.flush()
        written = list(rec.written)
        assert rec.recorder.too_big == 1
    got = []
    for path in written:
        with load_bundle(path) as b:
            got.append(b.calls[0].args[1])
    assert sorted(got) == [0, 1, 2]  # the calls after it are still recorded


def test_salvage_of_device_rows_where_only_the_last_row_was_touched(tmp_path):
    from test_gather import _fake_call

    from kdump.record.flight.salvage import salvage_journal

    path, (a, sfa, labels) = _fake_call(tmp_path, last_row_only=True)
    res = salvage_journal(path, tmp_path / "out")
    assert not res.torn and not res.in_flight
    (bundle,) = res.bundles
    with load_bundle(bundle) as b:
        b.verify()
        call = b.calls[0]
        (a2, s2), lab = call.args[0], call.args[1]
        assert torch.equal(lab, labels)
        assert torch.equal(a2.view(torch.uint8)[-1], a.view(torch.uint8)[-1])
        assert not a2.view(torch.uint8)[:-1].any() and torch.equal(s2[-1], sfa[-1])
        assert call.meta["journal"]["device"]["rows_kept"] == 1
        assert call.storages[0].held_nbytes == a.shape[1]


@pytest.mark.parametrize("mode", ["ring", "sync"])
def test_requires_grad_changed_between_calls_on_one_tensor(tmp_path, mode):
    """`requires_grad_` changes no address, shape or version: each bundle says what its call
    saw."""
    x = torch.arange(4.0)
    y = torch.ones(2)

    def calls() -> None:
        target(x, y)
        x.requires_grad_(True)
        target(x, y)
        x.requires_grad_(False)
        target(x, y)

    written = _record(tmp_path, mode, calls)
    seen = {}
    for path in written:
        with load_bundle(path) as b:
            call = b.calls[0]
            index = call.meta.get("journal", {}).get("call_index", call.meta.get("call_index"))
            seen[index] = call.args[0].requires_grad
    assert seen == {0: False, 1: True, 2: False}


def test_input_sharing_the_outputs_buffer_is_held(tmp_path, fake_deep_gemm):
    """A and D carved from one workspace: the output's storage is also an input's, so its bytes
    are copied (only a storage of outputs alone is left to the kernel)."""
    spec = spec_for(f"deep_gemm:{CONTIG}")
    args, kwargs = spec.generate(seed=3, **SMALL, expected_m=30)
    (a, sfa), (b, sfb), d, labels = args
    work = torch.zeros(a.numel() + d.numel() * d.element_size(), dtype=torch.uint8)
    a2 = work[: a.numel()].view(a.dtype).view(a.shape)
    a2.copy_(a)
    d2 = work[a.numel() :].view(d.dtype).view(d.shape)

    def call() -> None:
        getattr(fake_deep_gemm, CONTIG)((a2, sfa), (b, sfb), d2, labels, **kwargs)

    [path] = _record(tmp_path, "ring", call, name=f"deep_gemm:{CONTIG}", slot_bytes=4 << 20)
    with load_bundle(path) as bundle:
        call_ = bundle.calls[0]
        assert call_.synthesized == []
        assert torch.equal(call_.args[0][0].view(torch.uint8), a.view(torch.uint8))
    [v] = replay([path], backend="reference", device="cpu")
    assert v.exit_code == 0, v.headline()


def test_a_storage_of_outputs_alone_is_not_copied(tmp_path, fake_deep_gemm):
    spec = spec_for(f"deep_gemm:{CONTIG}")
    args, kwargs = spec.generate(seed=3, **SMALL, expected_m=30)

    def call() -> None:
        getattr(fake_deep_gemm, CONTIG)(*args, **kwargs)

    [path] = _record(tmp_path, "ring", call, name=f"deep_gemm:{CONTIG}", slot_bytes=4 << 20)
    with load_bundle(path) as bundle:
        assert bundle.calls[0].synthesized == ["d"]


def test_an_empty_storage_is_placed_even_in_a_full_slot(tmp_path):
    """An empty tensor's payload has no bytes: it is never "missing", however full the slot."""
    from kdump.format.journal import SlotMeta, SlotState
    from kdump.record.flight.journal import Journal
    from kdump.record.flight.journal_reader import read_journal

    j = Journal.create(tmp_path / "shm", slots=2, slot_bytes=8192)
    for n in range(8192, 0, -1):  # the largest first payload that fits: the slot is then full
        empty = {**STORAGE, "storage_nbytes": 0, "span_nbytes": 0, "base_ptr": 0}
        big = {**STORAGE, "storage_nbytes": n, "span_nbytes": n}
        meta = SlotMeta(call_index=n, target=f"{T}:target", storages=[big, empty])
        slot = j.reserve(meta)
        if slot.has_payload(0):
            break
        slot.commit()
    assert slot.has_payload(1)
    slot.payload(0)[:] = bytes(n)
    slot.commit()
    got = read_journal(j.path).having(SlotState.COMPLETE)
    newest = max(got, key=lambda s: s.seq)
    assert newest.payloads[1] == b""
    j.close()


def test_a_long_call_ending_after_the_ring_reused_its_slot_leaves_the_new_call_alone(tmp_path):
    """Two threads: one call runs long while the other's calls wrap the ring over its slot. Its
    end must not mark the slot's new call (still running) finished."""
    from kdump.format.journal import SlotState
    from kdump.record.flight.journal_reader import read_journal

    x = torch.arange(4.0)
    opts: dict[str, Any] = {"out": tmp_path / "out", "mode": "ring", "ring": _ring(tmp_path, 4)}
    with kdump.recording(f"{T}:target", **opts) as rec:
        ring = rec.recorder
        st = next(s for s in rec.patches.states if s.id.endswith(":target"))
        long_done = ring._before(st, 0, "target", (x, "long"), {})  # the long call starts
        for i in range(3):
            target(x, i)  # the other thread's calls, each finished
        new_done = ring._before(st, 4, "target", (x, "new"), {})  # reuses the long call's slot
        long_done()  # the long call returns
        slots = read_journal(ring.journal.path).having(SlotState.COMPLETE)
        new = next(s for s in slots if s.meta.call_index == 4)
        assert not new.finished  # still running
        new_done()
        slots = read_journal(ring.journal.path).having(SlotState.COMPLETE)
        assert next(s for s in slots if s.meta.call_index == 4).finished


def test_notes_of_raised_calls_stay_bounded_by_the_ring(tmp_path):
    from kdump.record.flight.salvage import raised_path, read_raised

    x = torch.zeros(3)
    opts: dict[str, Any] = {"out": tmp_path / "out", "mode": "ring", "ring": _ring(tmp_path, 4)}
    with kdump.recording(f"{T}:raiser", **opts) as rec:
        for _ in range(50):
            with pytest.raises(KernelRefused):
                raiser(x)
        journal = rec.recorder.journal.path
        notes = read_raised(journal)
        assert len(notes) == 4 and len(raised_path(journal).read_text().splitlines()) == 4
        rec.flush()
        assert len(rec.written) == 4
    for path in rec.written:
        with load_bundle(path) as b:
            assert b.calls[0].meta["journal"]["raised"]


class ListValued(enum.Enum):
    PAIR = [1, 2]  # noqa: RUF012 (an enum member whose value is a list: the point)


@pytest.mark.parametrize("mode", ["ring", "sync"])
def test_enum_with_a_list_value_as_a_dict_key(tmp_path, mode):
    written = _record(tmp_path, mode, lambda: target({ListValued.PAIR: 1}, torch.ones(1)))
    with load_bundle(written[0]) as b:
        [(key, value)] = b.calls[0].args[0].items()
        assert (key.name, key.value, value) == ("PAIR", [1, 2], 1)


# ---------------------------------------------------------------------------------------------
# `kdump record`: a process of the run that outlives the one launched

LINGERING_PARENT = """
import subprocess, sys
subprocess.Popen([sys.executable, {child!r}, {fed!r}])  # a worker left running, as servers do
"""
LINGERING_CHILD = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from test_edge_inputs import target
time.sleep(1.0)  # still running when the launched process has exited
for i in range(3):
    target(torch.full((4,), float(i)), i)
open(sys.argv[1], "w").write("done")
"""


def test_launcher_salvages_a_worker_that_outlives_the_launched_process(tmp_path):
    import os
    import subprocess

    child = tmp_path / "worker.py"
    child.write_text(LINGERING_CHILD.format(tests=str(Path(__file__).parent)))
    parent = tmp_path / "main.py"
    fed = tmp_path / "worker-done"
    parent.write_text(LINGERING_PARENT.format(child=str(child), fed=str(fed)))
    cmd = [
        sys.executable,
        "-m",
        "kdump",
        "record",
        "-t",
        f"{T}:target",
        "-o",
        str(tmp_path / "out"),
    ]
    cmd += ["--", sys.executable, str(parent)]
    env = dict(os.environ, KDUMP_JOURNAL_DIR=str(tmp_path / "shm"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert fed.exists(), r.stderr  # the worker finished before the launcher salvaged
    got = []
    for path in sorted((tmp_path / "out").rglob("*.kdump")):
        with load_bundle(path) as b:
            got.append(b.calls[0].args[1])
    assert sorted(got) == [0, 1, 2], r.stderr
