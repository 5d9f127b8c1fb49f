"""The caches of the sync recorder's small-call path see every fact that changes: a scalar, a
tensor with a new shape or dtype at the same address, the library state, a rank variable; and
what they write is what the ordinary path writes."""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kdump
from kdump import config, envinfo
from kdump.bundle import attach_outputs, capture_call, load_bundle, save_calls, writer
from kdump.bundle.capture import capture
from kdump.bundle.header_cache import HeaderCache
from kdump.record import capture_dir
from kdump.record.capture_dir import INDEX_NAME, _bundle_line, _encode
from tests.test_format_reader import read_call


def _target(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)

    def scale(x: torch.Tensor, out: torch.Tensor, k: Any = 2.0) -> None:
        out.copy_(x.reshape(-1)[: out.numel()] * 0 + out)  # reads x; leaves out as it was

    scale.__module__ = mod.__name__
    mod.scale = scale  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    return mod


def _record(tmp_path, name: str, calls: list[Callable[[Any], None]]) -> list[Any]:
    mod = _target(name)
    with kdump.recording(f"{name}:scale", out=tmp_path) as rec:
        for call in calls:
            call(mod)
    assert len(rec.written) == len(calls)
    return rec.written


# ---------------------------------------------------------------------------------------------
# Tensors with a new shape or dtype at the same address


def test_a_new_shape_or_dtype_at_the_same_address_is_recorded(tmp_path) -> None:
    base = torch.arange(64, dtype=torch.float32)
    out = torch.zeros(4)
    views = [base, base.view(torch.int32), base.reshape(8, 8), base, base[8:].view(7, 8)]
    calls = [lambda m, v=v: m.scale(v, out) for v in views for _ in range(3)]
    paths = _record(tmp_path, "kdump_cache_shapes", calls)
    for i, p in enumerate(paths):
        want = views[i // 3]
        bundle = load_bundle(p)
        bundle.verify()
        rec = bundle.manifest.calls[0].tensors[0]
        assert rec.shape == tuple(want.shape), i
        assert rec.dtype == str(want.dtype).replace("torch.", ""), i
        assert rec.storage_offset == want.storage_offset(), i
        _, _, tensors = read_call(p, 0)  # the independent reader agrees
        assert tensors[0].dtype == want.dtype and torch.equal(tensors[0], want), i


def test_capture_records_follow_the_view_at_one_address() -> None:
    base = torch.arange(16, dtype=torch.float32)
    for view in (base, base.view(torch.int32), base.reshape(4, 4), base[2:], base):
        cap = capture([view])
        (rec,) = cap.tensors
        assert (rec.dtype, rec.shape, rec.storage_offset) == (
            str(view.dtype).replace("torch.", ""),
            tuple(view.shape),
            view.storage_offset(),
        )
        assert bytes(cap.data[0].numpy()) == bytes(base[view.storage_offset() :].numpy())


def test_an_output_that_changed_is_copied_and_one_that_did_not_is_shared() -> None:
    x, out = torch.randn(8), torch.randn(8)
    before = capture([x, out])
    same = capture([out], unchanged_from=before)
    assert same.data[0] is before.data[1]
    out.add_(1)
    changed = capture([out], unchanged_from=before)
    assert changed.data[0] is not before.data[1]
    assert torch.equal(changed.data[0], out.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# Scalars


def test_changed_scalars_are_recorded_with_their_type(tmp_path) -> None:
    x, out = torch.randn(16), torch.zeros(4)
    ks: list[Any] = [1, True, 1.0, 1, "1", None, -0.0, 0.0, [1], {"a": 1}, 2**70]
    paths = _record(
        tmp_path, "kdump_cache_scalars", [lambda m, k=k: m.scale(x, out, k=k) for k in ks]
    )
    for k, p in zip(ks, paths):
        _, kwargs, _ = read_call(p, 0)
        assert json.dumps(kwargs["k"]) == json.dumps(k)
        assert type(kwargs["k"]) is type(k)


# ---------------------------------------------------------------------------------------------
# Library state


def test_a_changed_library_state_is_seen_in_env_and_meta(tmp_path, monkeypatch) -> None:
    value: dict[str, Any] = {"v": 1}
    monkeypatch.setitem(envinfo._PROVIDERS, "kdump_test_lib", lambda: dict(value))
    x, out = torch.randn(16), torch.zeros(4)
    states: list[Any] = [1, 1, True, 1.0, 1, 2, 2]  # equal in Python, not in the bundle

    def call(k: Any) -> Callable[[Any], None]:
        def run(m: Any) -> None:
            value["v"] = k
            m.scale(x, out)

        return run

    paths = _record(tmp_path, "kdump_cache_libs", [call(k) for k in states])
    for k, p in zip(states, paths):
        bundle = load_bundle(p)
        lib = bundle.manifest.env["libraries"]["kdump_test_lib"]
        assert json.dumps(lib) == json.dumps({"v": k})
        assert json.dumps(bundle.calls[0].meta["library_state"]["kdump_test_lib"]) == json.dumps(
            {"v": k}
        )


# ---------------------------------------------------------------------------------------------
# Rank variables


def test_peek_reads_the_live_environment(monkeypatch) -> None:
    monkeypatch.delenv("KDUMP_PEEK_TEST", raising=False)
    assert config.peek("KDUMP_PEEK_TEST") is None
    monkeypatch.setenv("KDUMP_PEEK_TEST", "a")
    assert config.peek("KDUMP_PEEK_TEST") == "a"
    monkeypatch.setenv("KDUMP_PEEK_TEST", "é b")
    assert config.peek("KDUMP_PEEK_TEST") == "é b"
    monkeypatch.delenv("KDUMP_PEEK_TEST")
    assert config.peek("KDUMP_PEEK_TEST") is None
    monkeypatch.setattr(os, "environ", {"KDUMP_PEEK_TEST": "plain", "RANK": "6"})  # replaced
    assert config.peek("KDUMP_PEEK_TEST") == "plain"
    assert config.peek_set(("RANK", "TP_RANK")) == {"RANK": "6"}
    assert envinfo.current_rank() == 6


def test_rank_follows_the_variables(monkeypatch) -> None:
    for var in envinfo.RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    assert envinfo.current_rank() is None and envinfo.rank_info() == {}
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert envinfo.current_rank() == 3
    monkeypatch.setenv("TP_RANK", "1")
    assert envinfo.current_rank() == 1
    monkeypatch.setenv("RANK", "7")
    assert envinfo.current_rank() == 7
    monkeypatch.setenv("RANK", "seven")
    assert envinfo.rank_info()["rank"] == "seven" and envinfo.current_rank() == 1
    assert envinfo.rank_info({"RANK": "2"}) == {"rank": 2}  # an explicit mapping


def test_a_rank_variable_set_during_the_recording_is_recorded(tmp_path, monkeypatch) -> None:
    for var in envinfo.RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    x, out = torch.randn(16), torch.zeros(4)

    def call(rank: str | None) -> Callable[[Any], None]:
        def run(m: Any) -> None:
            if rank is not None:
                monkeypatch.setenv("RANK", rank)
            m.scale(x, out)

        return run

    paths = _record(tmp_path, "kdump_cache_rank", [call(None), call(None), call("4"), call(None)])
    ranks = [load_bundle(p).calls[0].meta["rank"] for p in paths]
    assert ranks == [None, None, 4, 4]


# ---------------------------------------------------------------------------------------------
# Header fills and signatures


def test_env_and_info_fills_follow_new_objects(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(writer, "_utc_now", lambda: "2026-01-01T00:00:00Z")
    cache = HeaderCache()
    x, out = torch.randn(8), torch.randn(8)
    env: dict[str, Any] = {"libraries": {"lib": {"v": 1}}}
    info: dict[str, Any] = {"recorder": "sync"}
    envs = [env, env, {"libraries": {"lib": {"v": True}}}, env, {"libraries": {}}]
    for i, e in enumerate(envs):
        call = capture_call("m:f", [x, out], meta={"i": i})
        attach_outputs(call, [x, out], [1])
        fast = save_calls(tmp_path / f"t{i}.kdump", [call], env=e, info=info, headers=cache)
        plain = save_calls(tmp_path / f"p{i}.kdump", [call], env=e, info=info)
        assert fast.read_bytes() == plain.read_bytes(), i
        assert load_bundle(fast).manifest.env == e
    assert cache.hits >= 3


@pytest.mark.parametrize("entries", [64, 1])  # one entry: evictions too
def test_signatures_by_record_identity_keep_what_differs(tmp_path, monkeypatch, entries) -> None:
    monkeypatch.setattr(writer, "_utc_now", lambda: "2026-01-01T00:00:00Z")
    cache = HeaderCache(max_entries=entries)
    a = torch.arange(32, dtype=torch.float32)
    views = [a, a, a.view(torch.int32), a.reshape(4, 8), a, a[4:], a]
    for i, v in enumerate(views):
        for k, target in enumerate(("m:f", "m:f", "m:g", "m:g")):
            call = capture_call(target, [v], names=["x"], meta={"i": i})
            fast = save_calls(tmp_path / f"t{i}.{k}.kdump", [call], headers=cache)
            plain = save_calls(tmp_path / f"p{i}.{k}.kdump", [call])
            assert fast.read_bytes() == plain.read_bytes(), (i, target)
    assert cache.hits >= 2 * len(views)


# ---------------------------------------------------------------------------------------------
# The index line


@pytest.mark.parametrize(
    "name,target,index,nbytes,exception",
    [
        ("scale-000001.kdump", "m:scale", 1, 4096, None),
        ("f-é.kdump", 'mod:"quoted"\\fn', 0, 0, 'ValueError: line\n"two" é \x00'),
        ("a.kdump", "m:f", True, 10, None),  # an int subclass: as the encoder writes it
        ("a.kdump", "m:f", 2, 10, 3),  # not a string: as the encoder writes it
    ],
)
def test_the_index_line_is_what_the_encoder_writes(name, target, index, nbytes, exception) -> None:
    want = _encode(
        {
            "kind": "bundle",
            "path": name,
            "target": target,
            "call_index": index,
            "bytes": nbytes,
            "exception": exception,
        }
    )
    assert _bundle_line(name, target, index, nbytes, exception) == want


def test_index_sizes_are_the_bundle_files_sizes(tmp_path) -> None:
    x, out = torch.randn(16), torch.zeros(4)
    paths = _record(tmp_path, "kdump_cache_sizes", [lambda m: m.scale(x, out)] * 5)
    folder = paths[0].parent
    lines = [json.loads(line) for line in (folder / INDEX_NAME).read_text().splitlines()]
    sizes = {ln["path"]: ln["bytes"] for ln in lines if ln["kind"] == "bundle"}
    assert sizes == {p.name: p.stat().st_size for p in paths}
    assert capture_dir.read_index(folder).paths == paths
