"""The sync recorder's exact-repeat path (kdump.record.sync.repeat) writes what the ordinary path
writes, and leaves it for every fact that changed: a scalar, a new shape or dtype at the same
address, a storage resized, the library state, a rank variable, a tensor modified in place, an
output the call changed or left, an exception, a return value. A new tensor object with the
same facts at the same address writes the same bundle by either path."""

from __future__ import annotations

import json
import struct
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kdump
from kdump import envinfo
from kdump.bundle import load_bundle
from kdump.format.records import MANIFEST_KEY
from kdump.record.capture_dir import INDEX_NAME
from kdump.record.sync.recorder import SyncRecorder
from tests.test_format_reader import read_call

Step = Callable[[Any], Any]


def _target(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)

    def scale(x: torch.Tensor, out: torch.Tensor, k: Any = 2.0, ret: Any = None) -> Any:
        if k == "raise":
            raise ValueError("asked to raise")
        if k != "keep":
            out.copy_(x.reshape(-1)[: out.numel()].float() * 2)
        return ret

    scale.__module__ = mod.__name__
    mod.scale = scale  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    return mod


def _run(tmp: Path, name: str, steps: list[Step], repeat: bool, monkeypatch) -> Any:
    monkeypatch.setattr(SyncRecorder, "repeat", repeat)
    mod = _target(name)
    with kdump.recording(f"{name}:scale", out=tmp) as rec:
        for step in steps:
            try:
                step(mod)
            except ValueError:
                pass
    assert len(rec.written) == len(steps)
    return rec


def _content(path: Path, addresses: bool = True) -> tuple[Any, bytes]:
    """The bundle's header and data, per-call facts (times, the session; the addresses unless
    `addresses`) left out."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    manifest = json.loads(header["__metadata__"][MANIFEST_KEY])
    manifest["created"] = None
    manifest["info"]["session"] = None
    for c in manifest["calls"]:
        c["meta"]["time_ns"] = None
        for part in (c, c.get("outputs") or {}):
            for rec in (*part.get("storages", ()), *part.get("tensors", ())):
                if not addresses:
                    rec.pop("base_ptr", None)
                    rec.pop("data_ptr", None)
    header["__metadata__"] = manifest
    return header, raw[8 + n :]


def _both(
    tmp_path: Path,
    monkeypatch,
    steps: list[Step],
    fresh: Callable[[], None],
    addresses: bool = True,
) -> Any:
    """Record `steps` by both paths (`fresh` resets the tensors between them); the bundles agree
    byte for byte but for per-call facts. The repeat path's recorder."""
    fresh()
    off = _run(tmp_path / "off", "kdump_rep_" + tmp_path.name[-8:], steps, False, monkeypatch)
    fresh()
    on = _run(tmp_path / "on", "kdump_rep_" + tmp_path.name[-8:], steps, True, monkeypatch)
    assert off.recorder.repeated == 0
    for i, (a, b) in enumerate(zip(off.written, on.written)):
        load_bundle(b).verify()
        assert _content(a, addresses) == _content(b, addresses), i
    return on


def _state() -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    t = {"x": torch.zeros(64), "out": torch.zeros(16)}

    def fresh() -> None:
        gen = torch.Generator().manual_seed(3)
        t["x"].copy_(torch.randn(64, generator=gen))
        t["out"].zero_()

    return t, fresh


def test_plain_repeats_take_the_repeat_path_and_write_the_same(tmp_path, monkeypatch) -> None:
    t, fresh = _state()
    steps = [lambda m: m.scale(t["x"], t["out"])] * 8
    rec = _both(tmp_path, monkeypatch, steps, fresh)
    assert rec.recorder.repeated >= 5  # made on the second sighting, used from the third


def test_in_place_changes_of_inputs_and_outputs_are_recorded(tmp_path, monkeypatch) -> None:
    t, fresh = _state()

    def bump(m: Any, at: int) -> None:
        t["x"][at] += 1  # a tensor modified in place between calls
        m.scale(t["x"], t["out"])

    def keep(m: Any) -> None:
        m.scale(t["x"], t["out"], k="keep")  # the output left as it was: shared with the input

    steps: list[Step] = [lambda m: m.scale(t["x"], t["out"])] * 4
    steps += [lambda m: bump(m, 0), lambda m: bump(m, 63), keep, keep]
    steps += [lambda m: m.scale(t["x"], t["out"])] * 3
    rec = _both(tmp_path, monkeypatch, steps, fresh)
    assert rec.recorder.repeated >= 3
    fresh()
    want = t["x"].clone()
    for i, p in enumerate(rec.written):
        if i in (4, 5):
            want[0 if i == 4 else 63] += 1
        _, _, tensors = read_call(p, 0)  # the independent reader sees the values at the call
        assert torch.equal(tensors[0], want), i


def test_a_changed_scalar_leaves_the_repeat(tmp_path, monkeypatch) -> None:
    t, fresh = _state()
    ks: list[Any] = [2.0, 2.0, 2.0, 2.0, 2, True, 1, 1.0, -0.0, 0.0, 0.0, 0.0, 2.0, 2.0]
    steps = [lambda m, k=k: m.scale(t["x"], t["out"], k=k) for k in ks]
    rec = _both(tmp_path, monkeypatch, steps, fresh)
    for k, p in zip(ks, rec.written):
        _, kwargs, _ = read_call(p, 0)
        assert json.dumps(kwargs["k"]) == json.dumps(k) and type(kwargs["k"]) is type(k)


def test_a_new_view_or_object_at_the_same_address_leaves_the_repeat(tmp_path, monkeypatch) -> None:
    base = torch.arange(64, dtype=torch.float32)
    out = torch.zeros(16)
    same = base.view(64)  # another object: same address, same layout
    views = [base, base.view(torch.int32), base.reshape(8, 8), base, same, base[8:].view(7, 8)]
    steps = [lambda m, v=v: m.scale(v, out) for v in views for _ in range(3)]
    rec = _both(tmp_path, monkeypatch, steps, lambda: out.zero_())
    for i, p in enumerate(rec.written):
        want = views[i // 3]
        (tensor,) = load_bundle(p).manifest.calls[0].tensors[:1]
        assert (tensor.shape, tensor.storage_offset) == (tuple(want.shape), want.storage_offset())
        assert tensor.dtype == str(want.dtype).replace("torch.", "")


def test_new_tensor_objects_at_the_same_address_write_the_same(tmp_path, monkeypatch) -> None:
    base = torch.arange(64, dtype=torch.float32)
    out = torch.zeros(16)
    # A new view object each call (as `out[:m]` in a caller's loop), the same facts every time.
    steps = [lambda m: m.scale(base.view(64), out[:16])] * 6
    rec = _both(tmp_path, monkeypatch, steps, lambda: out.zero_())
    assert rec.recorder.repeated >= 3


def test_a_tensor_on_another_device_or_storage_size_is_not_taken() -> None:
    """What the key cannot tell apart from the recorded tensor at the same address: a tensor on
    another device, a storage of another size (allocators hand addresses out again)."""
    from kdump.record.sync.repeat import SyncRepeat

    class Elsewhere:
        is_cpu = False

    rep = SyncRepeat.__new__(SyncRepeat)
    rep.names, rep.checks = ("x",), ((0, 4),)
    assert rep.matches(("x",), [torch.zeros(1)])
    assert not rep.matches(("x",), [Elsewhere()])
    assert not rep.matches(("y",), [torch.zeros(1)])
    assert not rep.matches(("x",), [torch.zeros(2)])  # 8 bytes where 4 were recorded


def test_a_resized_storage_leaves_the_repeat(tmp_path, monkeypatch) -> None:
    t: dict[str, torch.Tensor] = {}

    def fresh() -> None:
        t["view"] = torch.arange(64, dtype=torch.float32)[:32]
        t["out"] = torch.zeros(16)

    def grow(m: Any) -> None:
        t["view"].untyped_storage().resize_(512)  # the view's facts stay; its storage grew
        m.scale(t["view"], t["out"])

    steps: list[Step] = [lambda m: m.scale(t["view"], t["out"])] * 4 + [grow] * 2
    rec = _both(tmp_path, monkeypatch, steps, fresh, addresses=False)  # new tensors: new places
    sizes = [load_bundle(p).manifest.calls[0].storages[0].storage_nbytes for p in rec.written]
    assert sizes == [256] * 4 + [512] * 2


def test_a_changed_library_state_leaves_the_repeat(tmp_path, monkeypatch) -> None:
    value: dict[str, Any] = {"v": 1}
    monkeypatch.setitem(envinfo._PROVIDERS, "kdump_rep_lib", lambda: dict(value))
    t, fresh = _state()
    states: list[Any] = [1, 1, 1, 1, True, 1.0, 1, 1, 2, 2, 2]

    def call(k: Any) -> Step:
        def run(m: Any) -> None:
            value["v"] = k
            m.scale(t["x"], t["out"])

        return run

    rec = _both(tmp_path, monkeypatch, [call(k) for k in states], fresh)
    for k, p in zip(states, rec.written):
        bundle = load_bundle(p)
        assert json.dumps(bundle.manifest.env["libraries"]["kdump_rep_lib"]) == json.dumps({"v": k})
        assert json.dumps(bundle.calls[0].meta["library_state"]["kdump_rep_lib"]) == json.dumps(
            {"v": k}
        )


def test_a_rank_variable_set_during_the_repeats_is_recorded(tmp_path, monkeypatch) -> None:
    for var in envinfo.RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(SyncRecorder, "repeat", True)
    mod = _target("kdump_rep_rank")
    x, out = torch.randn(64), torch.zeros(16)
    with kdump.recording("kdump_rep_rank:scale", out=tmp_path) as rec:
        for _ in range(5):
            mod.scale(x, out)
        monkeypatch.setenv("RANK", "3")
        for _ in range(2):
            mod.scale(x, out)
        assert rec.recorder.repeated >= 3
    ranks = [load_bundle(p).calls[0].meta["rank"] for p in rec.written]
    assert ranks == [None] * 5 + [3, 3]


@pytest.mark.parametrize("odd", ["raise", "return"])
def test_an_exception_or_a_return_value_takes_the_ordinary_path(tmp_path, monkeypatch, odd) -> None:
    t, fresh = _state()

    def strange(m: Any) -> Any:
        if odd == "raise":
            return m.scale(t["x"], t["out"], k="raise")
        return m.scale(t["x"], t["out"], ret=t["out"])

    plain: Step = lambda m: m.scale(t["x"], t["out"])  # noqa: E731
    steps = [plain] * 4 + [strange] + [plain] * 3
    rec = _both(tmp_path, monkeypatch, steps, fresh)
    meta = load_bundle(rec.written[4]).calls[0].meta
    assert ("exception" in meta) == (odd == "raise")
    assert rec.recorder.repeated >= 3


def test_index_lines_name_the_repeat_bundles_with_their_sizes(tmp_path, monkeypatch) -> None:
    t, fresh = _state()
    fresh()
    rec = _run(
        tmp_path, "kdump_rep_index", [lambda m: m.scale(t["x"], t["out"])] * 6, True, monkeypatch
    )
    assert rec.recorder.repeated >= 3
    folder = rec.written[0].parent
    lines = [json.loads(s) for s in (folder / INDEX_NAME).read_text().splitlines()]
    sizes = {x["path"]: x["bytes"] for x in lines if x.get("kind") == "bundle"}
    assert sizes == {p.name: p.stat().st_size for p in rec.written}


def test_containers_with_braces_and_quotes_repeat_as_written(tmp_path, monkeypatch) -> None:
    t, fresh = _state()
    k = {"a": [1, {"b": '{"}\\'}], "{0}": None}  # text str.format and JSON both treat specially
    steps = [lambda m: m.scale(t["x"], t["out"], k=k)] * 6
    rec = _both(tmp_path, monkeypatch, steps, fresh)
    assert rec.recorder.repeated >= 3
    for p in rec.written:
        _, kwargs, _ = read_call(p, 0)
        assert kwargs["k"] == k


def test_alternating_keys_each_repeat_and_the_table_stays_bounded(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(SyncRecorder, "REPEATS_MAX", 2)
    t, fresh = _state()
    ks = [1.0, 2.0, 3.0] * 5  # three keys, a table of two: the least recently used goes
    steps = [lambda m, k=k: m.scale(t["x"], t["out"], k=k) for k in ks]
    rec = _both(tmp_path, monkeypatch, steps, fresh)
    assert len(rec.recorder._repeats) <= 2
    for k, p in zip(ks, rec.written):
        assert read_call(p, 0)[1]["k"] == k


def test_keys_seen_twice_in_turn_repeat(tmp_path, monkeypatch) -> None:
    t, fresh = _state()
    ks = [1.0, 2.0] * 6
    steps = [lambda m, k=k: m.scale(t["x"], t["out"], k=k) for k in ks]
    rec = _both(tmp_path, monkeypatch, steps, fresh)
    assert rec.recorder.repeated >= 6  # each key's repeat made on its second call


@pytest.mark.gpu
def test_calls_with_cuda_tensors_take_the_ordinary_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(SyncRecorder, "repeat", True)
    mod = _target("kdump_rep_cuda")
    x, out = torch.randn(64, device="cuda"), torch.zeros(16, device="cuda")
    with kdump.recording("kdump_rep_cuda:scale", out=tmp_path) as rec:
        for _ in range(6):
            mod.scale(x, out)
        assert rec.recorder.repeated == 0 and not rec.recorder._repeats
        assert "kdump_rep_cuda:scale" in rec.recorder._on_device  # no key made for its calls
        cpu, cpu_out = torch.randn(64), torch.zeros(16)
        for _ in range(5):  # the same target on the CPU repeats again
            mod.scale(cpu, cpu_out)
        assert rec.recorder.repeated >= 1
    for p in rec.written[:6]:
        bundle = load_bundle(p)
        bundle.verify()
        assert bundle.manifest.calls[0].storages[0].device.startswith("cuda")
        _, _, tensors = read_call(p, 0)
        assert torch.equal(tensors[0], x.cpu())


def test_threads_calling_one_target_each_get_whole_bundles(tmp_path, monkeypatch) -> None:
    import threading

    monkeypatch.setattr(SyncRecorder, "repeat", True)
    mod = _target("kdump_rep_threads")
    pairs = [(torch.full((64,), float(i)), torch.zeros(16)) for i in range(2)]

    def work(i: int) -> None:
        x, out = pairs[i % 2]
        for _ in range(25):
            mod.scale(x, out)

    with kdump.recording("kdump_rep_threads:scale", out=tmp_path) as rec:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(rec.written) == 100 and rec.recorder.repeated >= 1
    for p in rec.written:
        load_bundle(p).verify()
        _, _, tensors = read_call(p, 0)
        x = tensors[0]
        assert torch.equal(x, torch.full((64,), x[0].item()))  # one call's input, whole
        before = tensors[1]  # `out` before the call: as a call of its pair left it, or new
        assert torch.equal(before, x[:16] * 2) or not before.any()


def _module_of(name: str, fn: Callable[..., Any]) -> types.ModuleType:
    mod = types.ModuleType(name)
    fn.__module__ = name
    mod.f = fn  # type: ignore[attr-defined]
    sys.modules[name] = mod
    return mod


def _record_outputs(tmp: Path, name: str, fn, steps, repeat: bool, monkeypatch) -> list[Any]:
    """Record `steps` (each gets the target's module) by one path; the recorded last output of
    each call as (shape, values)."""
    monkeypatch.setattr(SyncRecorder, "repeat", repeat)
    mod = _module_of(name, fn)
    with kdump.recording(f"{name}:f", out=tmp / str(repeat)) as rec:
        for step in steps:
            step(mod)
    out = []
    for p in rec.written:
        with load_bundle(p) as b:
            t = b.calls[0].materialize_outputs()[1]  # the second argument's value after the call
            out.append((tuple(t.shape), t.tolist()))
    return out


def test_an_output_whose_shape_depends_on_the_values_is_recorded_as_the_call_left_it(
    tmp_path, monkeypatch
):
    # torch.nonzero(x, out=o): same objects, same addresses before every call; the output's
    # shape after the call follows x's values
    x, out = torch.zeros(16), torch.empty(64, dtype=torch.long)
    seen: list[Any] = []

    def step(m: Any) -> None:
        n = [3, 3, 3, 3, 5, 5, 3, 3][len(seen) % 8]
        x.zero_()
        x[:n] = 1
        m.f(x, out)
        seen.append((tuple(out.shape), out.tolist()))

    def nz(x: torch.Tensor, out: torch.Tensor) -> None:
        torch.nonzero(x, out=out)

    name = f"kdump_rep_nz_{tmp_path.name[-6:]}"
    for repeat in (False, True):
        seen.clear()
        got = _record_outputs(tmp_path, name, nz, [step] * 8, repeat, monkeypatch)
        assert got == seen, f"repeat={repeat}"


def test_an_output_resized_into_new_memory_by_the_call_is_read_where_it_is_now(
    tmp_path, monkeypatch
):
    # `out=` semantics: an empty tensor passed each call gets memory inside the call
    x = torch.arange(64, dtype=torch.float32)
    keep: list[torch.Tensor] = []

    def f(x: torch.Tensor, out: torch.Tensor) -> None:
        out.resize_(16)
        out.copy_(x[:16] * 2)

    def step(m: Any) -> None:
        o = torch.empty(0)
        keep.append(o)
        x.add_(1)
        m.f(x, o)

    name = f"kdump_rep_resize_{tmp_path.name[-6:]}"
    for repeat in (False, True):
        keep.clear()
        x.copy_(torch.arange(64, dtype=torch.float32))
        got = _record_outputs(tmp_path, name, f, [step] * 6, repeat, monkeypatch)
        assert got == [((16,), o.tolist()) for o in keep], f"repeat={repeat}"


def test_the_env_is_the_one_after_the_call(tmp_path, monkeypatch):
    # the kernel's first CUDA use happens inside the fifth call: the ordinary path takes the
    # env when it writes, so both paths must give calls 5-7 the new env
    state = {"n": 0, "init": False}

    def f(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x[:16] * 2)
        state["n"] += 1
        state["init"] = state["n"] >= 5

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["init"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name = f"kdump_rep_env_{tmp_path.name[-6:]}"
    x, out = torch.arange(64, dtype=torch.float32), torch.zeros(16)
    for repeat in (False, True):
        state.update(n=0, init=False)
        monkeypatch.setattr(SyncRecorder, "repeat", repeat)
        mod = _module_of(name, f)
        with kdump.recording(f"{name}:f", out=tmp_path / str(repeat)) as rec:
            for _ in range(7):
                mod.f(x, out)
        envs = ["cuda_available" in load_bundle(p).manifest.env for p in rec.written]
        assert envs == [False] * 4 + [True] * 3, f"repeat={repeat}: {envs}"


def test_a_process_forked_inside_the_call_writes_its_own_env(tmp_path, monkeypatch):
    import os

    state = {"fork": False, "child": False}

    def f(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x[:16] * 2)
        if state["fork"]:
            state["child"] = os.fork() == 0

    name = f"kdump_rep_fork_{tmp_path.name[-6:]}"
    x, out = torch.arange(64, dtype=torch.float32), torch.zeros(16)
    for repeat in (False, True):
        monkeypatch.setattr(SyncRecorder, "repeat", repeat)
        mod = _module_of(name, f)
        where = tmp_path / str(repeat)
        with kdump.recording(f"{name}:f", out=where):
            for _ in range(5):
                mod.f(x, out)
            state.update(fork=True, child=False)
            mod.f(x, out)  # the child returns from here too, and records the call
            state["fork"] = False
            if state["child"]:
                os._exit(0)
            os.wait()
        folders = [p for p in where.iterdir() if p.is_dir() and p.name != "blobs"]
        (child,) = [p for p in folders if len(list(p.glob("*.kdump"))) == 1]
        (bundle,) = child.glob("*.kdump")
        env_pid = load_bundle(bundle).manifest.env["pid"]
        assert env_pid != os.getpid() and str(env_pid) in child.name, f"repeat={repeat}"
