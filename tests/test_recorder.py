"""Recording: triggers, limits, failure isolation, exception dumps, dump_call, fork, state."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.config import parse_bytes
from kdump.errors import UsageError
from kdump.record.capture_dir import INDEX_NAME, read_index
from kdump.record.triggers import Limits, Trigger, TriggerConfig, Written, parse_ranges

STANDINS = Path(__file__).parent / "standins"


@pytest.fixture(autouse=True)
def standins():
    sys.path.insert(0, str(STANDINS))
    for m in ("plainmod", "deep_gemm", "deep_gemm._C", "dg_inputs"):
        sys.modules.pop(m, None)
    from kdump.log import _logged

    _logged.clear()  # "logged once" is per process: start each test clean
    yield
    sys.path.remove(str(STANDINS))
    for m in ("plainmod", "deep_gemm", "deep_gemm._C", "dg_inputs"):
        sys.modules.pop(m, None)


# Targets defined here: their ids are f"{__name__}:<name>".
ERR = RuntimeError("boom from the kernel")
SENTINEL = object()


def raiser(x: torch.Tensor) -> None:
    x.add_(1)  # changed before raising: the bundle must hold the pre-call value
    raise ERR


def identity(x: torch.Tensor, flag: int = 0) -> object:
    return SENTINEL


def densify(x: torch.Tensor) -> torch.Tensor:
    return x.to_dense() * 2


def big_pred(x: torch.Tensor, flag: int = 0) -> bool:
    return x.numel() > 4


def broken_pred(x: torch.Tensor, flag: int = 0) -> bool:
    raise KeyError("predicate bug")


T = __name__


def _kdump_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kdump:")]


# ---------------------------------------------------------------------------------------------
# triggers.py (pure logic)


def test_parse_ranges():
    r = parse_ranges("0-9,100, 200-")
    assert [i for i in range(300) if i in r] == [*range(10), 100, *range(200, 300)]
    assert 10**9 in r and -1 not in r and "3" not in r
    assert str(parse_ranges("5,3-4,1")) == "1,3-5"
    assert parse_ranges("0-3").exhausted_after == 3 and parse_ranges("4-").exhausted_after is None
    for bad in ("x", "3-1", "1-2-3", "-4"):
        with pytest.raises(UsageError):
            parse_ranges(bad)


def test_parse_bytes():
    assert parse_bytes("512") == 512 and parse_bytes("10K") == 10240
    assert parse_bytes("1.5G") == 3 << 29 and parse_bytes("2GiB") == 2 << 30
    with pytest.raises(UsageError):
        parse_bytes("lots")


def test_trigger_selection_combines_with_and():
    t = Trigger(TriggerConfig.build(calls="0-20", every=5))
    picked = [i for i in range(40) if t.consider(i) and t.select(i, (), {})]
    assert picked == [0, 5, 10, 15, 20]
    assert t.is_exhausted(20) and not t.is_exhausted(19)


def test_trigger_default_and_exception_only():
    assert Trigger(TriggerConfig()).select(7, (), {})
    t = Trigger(TriggerConfig(on_exception=True))
    assert t.consider(123) and not t.select(123, (), {})  # snapshot, dump only if it raises


def test_first_per_signature_counts_shape_dtype_stride():
    t = Trigger(TriggerConfig.build(first_per_signature=2))
    a = torch.randn(4, 6, device="cpu")
    b = torch.randn(4, 6, device="cpu")
    seq = [a, b, a, a.t(), a.t(), a.t(), a.half(), torch.randn(5, 6, device="cpu")]
    picked = [i for i, x in enumerate(seq) if t.select(i, (x,), {"k": 1})]
    assert picked == [0, 1, 3, 4, 6, 7]


def test_predicate_and_broken_predicate_logged_once():
    warnings = []
    t = Trigger(
        TriggerConfig.build(predicate=f"{T}:big_pred"), warn=lambda k, m: warnings.append(m)
    )
    assert [t.select(i, (torch.randn(n, device="cpu"),), {}) for i, n in enumerate((2, 8))] == [
        False,
        True,
    ]
    t = Trigger(
        TriggerConfig.build(predicate=f"{T}:broken_pred"), warn=lambda k, m: warnings.append(m)
    )
    assert not any(t.select(i, (torch.randn(8, device="cpu"),), {}) for i in range(5))
    assert len(warnings) == 1 and "KeyError" in warnings[0]


def test_config_rejects_bad_values():
    for kwargs in ({"every": 0}, {"keep": "middle"}, {"max_bundles": -1}, {"max_bytes": "x"}):
        with pytest.raises(UsageError):
            TriggerConfig.build(**kwargs)


def test_limits_oldest_stops_and_newest_evicts():
    old = Limits(max_bundles=2, keep="oldest")
    for i in range(2):
        assert old.admit()
        old.add(Written(f"b{i}", "t", i, 10))
        assert old.victim() is None
    assert not old.admit()
    new = Limits(max_bytes=25, keep="newest")
    evicted = []
    for i in range(5):
        new.add(Written(f"b{i}", "t", i, 10))
        while (v := new.victim()) is not None:
            evicted.append(v.path)
            new.freed(v.nbytes)
    assert evicted == ["b0", "b1", "b2"] and [w.path for w in new.bundles] == ["b3", "b4"]
    big = Limits(max_bytes=15, keep="oldest")
    big.add(Written("b0", "t", 0, 10))
    assert big.victim() is None and big.admit()
    big.add(Written("b1", "t", 1, 10))
    assert big.victim().path == "b1" and not big.admit()


# ---------------------------------------------------------------------------------------------
# Recording


def test_triggers_pick_the_calls_written(tmp_path):
    with kdump.recording(f"{T}:identity", out=tmp_path, calls="1,3-", every=2) as rec:
        for _ in range(8):
            assert (
                identity(torch.randn(3, device="cpu")) is SENTINEL
            )  # result passes through as the object
    assert [load_bundle(p).calls[0].meta["call_index"] for p in rec.written] == [4, 6]
    assert [p.name for p in rec.written] == ["identity-000004.kdump", "identity-000006.kdump"]


def test_exception_trigger_dumps_pre_call_snapshot_and_reraises(tmp_path):
    x = torch.randn(5, device="cpu")
    before = x.clone()
    rec = kdump.recording(f"{T}:raiser", out=tmp_path, on_exception=True)
    with rec, pytest.raises(RuntimeError) as info:
        raiser(x)
    assert info.value is ERR  # the very same exception object
    assert torch.equal(x, before + 1)
    call = load_bundle(rec.written[0]).calls[0]
    assert call.meta["exception"] == "RuntimeError: boom from the kernel"
    assert torch.equal(call.args[0], before) and not call.has_outputs


def test_without_exception_trigger_unselected_raising_calls_are_not_dumped(tmp_path):
    rec = kdump.recording(f"{T}:raiser", out=tmp_path, calls="5")
    with rec, pytest.raises(RuntimeError):
        raiser(torch.randn(2, device="cpu"))
    assert rec.written == []


def test_metadata_only_under_graph_capture(tmp_path, monkeypatch):
    import kdump.record.sync.recorder as recorder

    monkeypatch.setattr(recorder, "cuda_state", lambda tensors: (True, 1234))
    x = torch.randn(6, 4, device="cpu")[:, 1:]
    with kdump.recording(f"{T}:identity", out=tmp_path) as rec:
        identity(x, 3)
    call = load_bundle(rec.written[0]).calls[0]
    meta = call.meta
    assert meta["capturing"] is True and meta["data"] == "metadata-only"
    assert "flight recorder" in meta["note"] and meta["stream"] == 1234
    (t,) = meta["tensors_metadata"]["tensors"]
    assert t["shape"] == [6, 3] and t["stride"] == [4, 1] and t["storage_offset"] == 1
    assert t["data_ptr"] == x.data_ptr() and not call.has_outputs and call.storages == []
    assert "tensor#0 float32 [6, 3] stride [4, 1]" in call.args[0].repr and call.args[1] == 3


def _cheap_target_results(n: int) -> list[torch.Tensor]:
    import plainmod

    g = torch.Generator().manual_seed(11)
    outs = []
    for _ in range(n):
        x, y = (
            torch.randn(16, generator=g, device="cpu"),
            torch.randn(16, generator=g, device="cpu"),
        )
        outs.append(torch.cat([plainmod.axpy(0.5, x, y), y]))
    return outs


@pytest.mark.parametrize("failure", ["enospc", "readonly", "sparse"])
def test_failures_never_change_results_and_log_once(tmp_path, monkeypatch, capfd, failure):
    import kdump.bundle.writer as bundle

    expected = _cheap_target_results(4)
    capfd.readouterr()
    out = tmp_path / "out"
    if failure == "enospc":

        def disk_full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(bundle, "atomic_write", disk_full)  # every bundle write
    elif failure == "readonly":
        out.mkdir()
        out.chmod(0o500)
        if os.access(out, os.W_OK):  # root ignores permissions: use a path under a file
            out = tmp_path / "a-file"
            out.write_text("x")
    if failure == "sparse":
        s = torch.randn(4, 4, device="cpu").to_sparse()
        with kdump.recording(f"{T}:densify", out=out) as rec:
            got = [densify(s) for _ in range(3)]
        assert all(torch.equal(g, s.to_dense() * 2) for g in got)
    else:
        with kdump.recording("plainmod:axpy", out=out) as rec:
            got = _cheap_target_results(4)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))  # bit-identical
    err = capfd.readouterr().err
    lines = _kdump_lines(err)
    assert len(lines) == 1, err
    assert "recording of this target is off" in lines[0]
    if failure == "enospc":
        assert "disk full" in lines[0]
    assert rec.written == []
    out.chmod(0o700) if out.is_dir() else None


def test_log_goes_to_kdump_log_file(tmp_path, monkeypatch, capfd):
    log = tmp_path / "kdump.log"
    monkeypatch.setenv("KDUMP_LOG", str(log))
    s = torch.randn(3, 3, device="cpu").to_sparse()
    with kdump.recording(f"{T}:densify", out=tmp_path):
        densify(s)
        densify(s)
    assert _kdump_lines(capfd.readouterr().err) == []
    assert len(_kdump_lines(log.read_text())) == 1


@pytest.mark.parametrize("keep", ["oldest", "newest"])
def test_max_bundles(tmp_path, keep):
    with kdump.recording("plainmod:axpy", out=tmp_path, max_bundles=2, keep=keep) as rec:
        _cheap_target_results(5)
    idx = [load_bundle(p).calls[0].meta["call_index"] for p in rec.written]
    assert idx == ([0, 1] if keep == "oldest" else [3, 4])
    on_disk = sorted(p.name for p in tmp_path.rglob("*.kdump"))
    assert on_disk == sorted(p.name for p in rec.written)
    index = read_index(rec.written[0].parent)
    assert [b.call_index for b in index.bundles] == idx and all(b.indexed for b in index.bundles)
    assert [b.path for b in index.bundles] == rec.written


def _bytes_on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != INDEX_NAME)


def test_max_bytes_newest_frees_blobs(tmp_path):
    # The budget is a few calls' worth, measured here: a bundle's size depends on the machine
    # (a process that uses CUDA records GPU facts in every bundle).
    with kdump.recording("plainmod:axpy", out=tmp_path / "one") as rec:
        _cheap_target_results(1)
    budget = int(3.5 * _bytes_on_disk(rec.written[0].parent))
    with kdump.recording(
        "plainmod:axpy", out=tmp_path / "many", max_bytes=budget, keep="newest"
    ) as rec:
        _cheap_target_results(12)
    assert 0 < len(rec.written) < 12
    assert _bytes_on_disk(rec.written[0].parent) <= budget
    for p in rec.written:  # survivors still load, their blobs intact
        assert load_bundle(p).calls[0].args[1].numel() == 16


def test_ranks_filter(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with kdump.recording("plainmod:axpy", out=tmp_path, ranks="0") as rec:
        _cheap_target_results(2)
    assert rec.written == []
    with kdump.recording("plainmod:axpy", out=tmp_path, ranks="1-3") as rec:
        _cheap_target_results(1)
    assert ".rank1." in rec.written[0].parent.name
    assert load_bundle(rec.written[0]).calls[0].meta["rank"] == 1


def test_unknown_mode_is_refused_ring_is_accepted(tmp_path):
    with pytest.raises(UsageError, match="use ring or sync"):
        kdump.recording("plainmod:axpy", out=tmp_path, mode="tape")
    from kdump.record.config import RingConfig

    ring = RingConfig(journal_dir=tmp_path / "shm")
    with kdump.recording("plainmod:axpy", out=tmp_path, mode="ring", ring=ring) as rec:
        assert rec.recorder.mode == "ring"


def test_blobs_shared_across_calls(tmp_path):
    w = torch.randn(256, 256, device="cpu")  # a "weight" passed to every call: stored once
    with kdump.recording(f"{T}:identity", out=tmp_path) as rec:
        for _ in range(3):
            identity(w)
    blobs = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    assert len(rec.written) == 3 and len(blobs) == 1
    assert all(torch.equal(load_bundle(p).calls[0].args[0], w) for p in rec.written)


def _fork_child(out: str, q) -> None:
    import plainmod

    x, y = torch.randn(4, device="cpu"), torch.randn(4, device="cpu")
    plainmod.axpy(1.0, x, y)
    from kdump.record.session import active_sessions

    q.put([str(p) for p in active_sessions()[0].written])


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_forked_child_gets_its_own_folder_and_counters(tmp_path):
    with kdump.recording("plainmod:axpy", out=tmp_path) as rec:
        _cheap_target_results(3)
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_fork_child, args=(str(tmp_path), q))
        p.start()
        child_written = q.get(timeout=60)
        p.join(60)
    assert p.exitcode == 0
    (child,) = map(Path, child_written)
    assert child.parent != rec.written[0].parent and str(p.pid) in child.parent.name
    assert child.name == "axpy-000000.kdump"  # counters restarted in the child
    assert len(rec.written) == 3


# ---------------------------------------------------------------------------------------------
# dump_call and the DeepGEMM state provider


def test_dump_call_writes_inputs_outputs_and_returns(tmp_path):
    import plainmod

    x, y = torch.randn(8, device="cpu"), torch.randn(8, device="cpu")
    y0 = y.clone()
    ret = kdump.dump_call(tmp_path / "one.kdump", plainmod.axpy, 2.0, x, y=y)
    assert torch.equal(ret, x * 2) and torch.equal(y, y0 + 2 * x)
    call = load_bundle(tmp_path / "one.kdump").calls[0]
    assert call.target == "plainmod:axpy" and call.names == ["alpha", "x"]
    assert torch.equal(call.kwargs["y"], y0) and torch.equal(call.outputs["y"], y)
    assert torch.equal(call.outputs["x"], x)  # generic target: every tensor argument


def test_dump_call_exception(tmp_path):
    x = torch.randn(3, device="cpu")
    before = x.clone()
    with pytest.raises(RuntimeError) as info:
        kdump.dump_call(tmp_path / "e.kdump", raiser, x)
    assert info.value is ERR
    call = load_bundle(tmp_path / "e.kdump").calls[0]
    assert call.meta["exception"].startswith("RuntimeError") and torch.equal(call.args[0], before)


def test_deep_gemm_state_provider(tmp_path):
    from kdump import envinfo
    from kdump.kernels.deepgemm import state as deepgemm_state

    deepgemm_state.reset()
    assert "deep_gemm" not in sys.modules
    assert deepgemm_state.state() is None
    assert "deep_gemm" not in sys.modules  # never imports it
    import deep_gemm
    from dg_inputs import make_contiguous

    with kdump.recording("deep_gemm", out=tmp_path) as rec:
        deep_gemm.set_num_sms(77)
        deep_gemm.set_ignore_compile_dims(True)  # a setter without a getter
        a, b, d, layout = make_contiguous(5)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout)
    state = envinfo.library_state()["deep_gemm"]
    assert state["num_sms"] == 77 and state["tc_util"] == 100
    assert state["version"] == deep_gemm.__version__ and state["file"] == deep_gemm.__file__
    assert state["setters"] == {"set_num_sms": 77, "set_ignore_compile_dims": True}
    bundle = load_bundle(rec.written[0])
    assert bundle.env["libraries"]["deep_gemm"]["setters"]["set_ignore_compile_dims"] is True
    assert bundle.calls[0].meta["library_state"]["deep_gemm"]["num_sms"] == 77
    deepgemm_state.reset()
