"""Capture folders: unique per recording, never replacing a bundle, an append-only index that
survives a torn last line; no CUDA initialisation for CPU calls; one reader of the environment."""

from __future__ import annotations

import os
import stat
import sys
import types
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import iter_bundles, load_bundle
from kdump.record import capture_dir
from kdump.record.capture_dir import INDEX_NAME, list_bundles, read_index

STANDINS = Path(__file__).parent / "standins"


@pytest.fixture(autouse=True)
def standins():
    sys.path.insert(0, str(STANDINS))
    sys.modules.pop("plainmod", None)
    yield
    sys.path.remove(str(STANDINS))
    sys.modules.pop("plainmod", None)


def _calls(n: int, seed: int) -> list[torch.Tensor]:
    import plainmod

    g = torch.Generator(device="cpu").manual_seed(seed)
    ys = []
    for _ in range(n):
        x = torch.randn(4, generator=g, device="cpu")
        y = torch.randn(4, generator=g, device="cpu")
        ys.append(y.clone())
        plainmod.axpy(0.5, x, y)
    return ys


def test_two_recordings_into_one_folder_keep_both(tmp_path):
    with kdump.recording("plainmod:axpy", out=tmp_path) as first:
        before_first = _calls(2, seed=1)
    with kdump.recording("plainmod:axpy", out=tmp_path) as second:
        before_second = _calls(1, seed=2)
    bundles = sorted(tmp_path.rglob("*.kdump"))
    assert len(bundles) == 3  # nothing replaced, though host, pid and names are the same
    assert first.written[0].parent != second.written[0].parent
    for path, y in zip([*first.written, *second.written], [*before_first, *before_second]):
        assert torch.equal(load_bundle(path).calls[0].args[2], y)
    name = first.written[0].parent.name
    host, pid, rand = name.rsplit(".", 2)
    assert pid == str(os.getpid()) and len(rand) == 6 and host
    # Each folder's index lists every bundle of its folder; the whole tree is found too.
    assert read_index(first.written[0].parent).paths == first.written
    assert read_index(second.written[0].parent).paths == second.written
    assert list_bundles(tmp_path) == sorted(bundles) == list(iter_bundles([tmp_path]))


def test_bundle_names_are_created_exclusively(tmp_path):
    dest = capture_dir.CaptureDir(
        tmp_path,
        capture_dir.Limits(),
        private_store=False,
        host="h",
        pid=1,
        rank=lambda: None,
        mode="sync",
    )
    first = dest.new_bundle_path("axpy-000000")
    first.write_bytes(b"earlier bundle")
    second = dest.new_bundle_path("axpy-000000")
    assert second != first and second.parent == first.parent and second.suffix == ".kdump"
    assert first.read_bytes() == b"earlier bundle"


class _CountingOs(types.SimpleNamespace):
    """`os` for capture_dir, counting the bytes each write hands to the index."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[int] = []

    def __getattr__(self, name: str):
        return getattr(os, name)

    def write(self, fd: int, data) -> int:
        n = os.write(fd, data)
        self.writes.append(n)
        return n


def test_index_bytes_per_call_do_not_grow(tmp_path, monkeypatch):
    counting = _CountingOs()
    monkeypatch.setattr(capture_dir, "os", counting)
    n = 3000
    with kdump.recording("plainmod:axpy", out=tmp_path, mode="sync") as rec:
        _calls(n, seed=3)
    assert len(rec.written) == n
    # One header, one line per bundle, one status line at close.
    assert len(counting.writes) == n + 2
    per_call = counting.writes[1 : n + 1]
    assert max(per_call[-100:]) - min(per_call[:100]) <= 4  # only the call index's digits grow
    assert max(per_call) < 300
    index_file = rec.written[0].parent / INDEX_NAME
    assert index_file.stat().st_size == sum(counting.writes)  # appended, never rewritten
    sizes = [p.stat().st_size for p in rec.written]  # the bundles' bytes do not grow either
    assert max(sizes[-100:]) - min(sizes[:100]) <= 16
    index = read_index(rec.written[0].parent)
    assert [e.call_index for e in index.bundles] == list(range(n))
    assert index.status["bundles"] == n and index.header["pid"] == os.getpid()


def test_torn_last_line_and_missing_bundles_found_by_scan(tmp_path):
    with kdump.recording("plainmod:axpy", out=tmp_path) as rec:
        ys = _calls(3, seed=4)
    folder = rec.written[0].parent
    index_file = folder / INDEX_NAME
    lines = index_file.read_bytes().splitlines(keepends=True)
    assert b'"kind":"status"' in lines[-1] and b"axpy-000002" in lines[-2]
    # Killed while writing the third bundle's line: that line half there, nothing after it.
    torn = b"".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2]
    index_file.write_bytes(torn)
    index = read_index(folder)
    assert index.paths == rec.written
    assert [e.indexed for e in index.bundles] == [True, True, False]
    assert [e.call_index for e in index.bundles[:2]] == [0, 1]
    assert index.bundles[2].nbytes == rec.written[2].stat().st_size
    assert torch.equal(load_bundle(index.paths[2]).calls[0].args[2], ys[2])
    # A bundle the index never heard of (no line at all) is found as well.
    (folder / INDEX_NAME).write_bytes(b"".join(lines[:1]))
    assert read_index(folder).paths == rec.written


def test_evicted_bundles_leave_the_index(tmp_path):
    with kdump.recording("plainmod:axpy", out=tmp_path, max_bundles=2, keep="newest") as rec:
        _calls(5, seed=5)
    index = read_index(rec.written[0].parent)
    assert [e.call_index for e in index.bundles] == [3, 4] and index.paths == rec.written
    text = (rec.written[0].parent / INDEX_NAME).read_text()
    assert text.count('"kind":"evicted"') == 3


CUDA_INIT = (
    "is_available",
    "device_count",
    "current_device",
    "get_device_properties",
    "init",
    "_lazy_init",
    "current_stream",
    "is_current_stream_capturing",
    "synchronize",
)


@pytest.fixture
def cuda_calls(monkeypatch):
    """Every torch.cuda function that initialises CUDA, replaced by one that notes and raises;
    torch.cuda.is_initialized says False (a fresh process)."""
    called: list[str] = []

    def make(name):
        def flagged(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"torch.cuda.{name} called")

        return flagged

    for name in CUDA_INIT:
        monkeypatch.setattr(torch.cuda, name, make(name))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return called


def test_cpu_dump_call_does_not_initialise_cuda(tmp_path, cuda_calls):
    import plainmod

    x = torch.randn(8, device="cpu")
    y = torch.randn(8, device="cpu")
    y0 = y.clone()
    kdump.dump_call(tmp_path / "one.kdump", plainmod.axpy, 2.0, x, y)
    assert cuda_calls == []
    bundle = load_bundle(tmp_path / "one.kdump")
    assert torch.equal(bundle.calls[0].args[2], y0)
    assert "gpu_name" not in bundle.env and bundle.env["torch"] == torch.__version__


def test_cpu_recording_does_not_initialise_cuda(tmp_path, cuda_calls):
    with kdump.recording("plainmod:axpy", out=tmp_path) as rec:
        _calls(2, seed=6)
    assert cuda_calls == [] and len(rec.written) == 2
    assert "gpu_name" not in load_bundle(rec.written[1]).env


def test_gpu_facts_are_collected_once_cuda_is_initialised(monkeypatch, cuda_calls):
    from kdump import envinfo

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    info = envinfo.gpu_info(cuda=False)
    assert cuda_calls == ["is_available"] and "is_available" in info["cuda_error"]


def test_tools_find_cuda_home_through_config(tmp_path, monkeypatch):
    from kdump import config
    from kdump.cuda import tools

    tool = tmp_path / "bin" / "cuobjdump"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert config.get("CUDA_HOME") == str(tmp_path)
    assert tools.find_tool("cuobjdump") == tool


def test_child_environment_is_a_copy(monkeypatch, tmp_path):
    from kdump import config
    from kdump.record.launcher import build_env

    monkeypatch.setenv("KDUMP_OUT", str(tmp_path / "o"))
    env = build_env(config.environ(), ("m:f",), {"calls": "1-2"})
    assert env["KDUMP_CALLS"] == "1-2" and env["KDUMP_OUT"] == str(tmp_path / "o")
    assert "KDUMP_CALLS" not in os.environ and os.environ.get("KDUMP_RECORD") != "1"


def _large_calls(n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`n` axpy calls over 12 MiB of arguments: the same x each time, y changing."""
    import plainmod

    g = torch.Generator(device="cpu").manual_seed(11)
    x = torch.randn(2 << 20, generator=g)
    ys = []
    for _ in range(n):
        y = torch.randn(1 << 20, generator=g)
        ys.append(y.clone())
        plainmod.axpy(0.5, x[: 1 << 20], y)
    return x, ys


def test_large_sync_calls_go_straight_into_the_store(tmp_path, monkeypatch):
    from kdump.bundle import store

    copied = []  # blobs written from a snapshot in memory (the path large calls avoid)
    real_put = store.BlobStore.put
    monkeypatch.setattr(
        store.BlobStore,
        "put",
        lambda self, sha, data: copied.append(sha) or real_put(self, sha, data),
    )
    with kdump.recording("plainmod:axpy", out=tmp_path, mode="sync") as rec:
        x, ys = _large_calls(3)
    assert copied == []
    blobs = sorted(p for p in (tmp_path / "blobs").rglob("*") if p.is_file())
    # x once; each y before and after; the returned x * 2 once (the same every call).
    assert len(blobs) == 1 + 2 * 3 + 1
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    index = read_index(rec.written[0].parent)
    for i, (entry, y0) in enumerate(zip(index.bundles, ys)):
        call = load_bundle(entry.path).calls[0]
        assert torch.equal(call.args[1], x[: 1 << 20]) and torch.equal(call.args[2], y0)
        assert call.args[1].storage_offset() == 0
        assert torch.equal(call.materialize_outputs("cpu")[1], y0 + 0.5 * x[: 1 << 20])
        new = 16 << 20 if i == 0 else 8 << 20  # blobs this bundle added to the store
        assert new <= entry.nbytes < new + (64 << 10)


def test_evicting_a_large_sync_bundle_frees_its_store_blobs(tmp_path):
    with kdump.recording(
        "plainmod:axpy", out=tmp_path, mode="sync", max_bundles=1, keep="newest"
    ) as rec:
        _large_calls(3)
    folder = rec.written[0].parent
    kept = sorted(p.name for p in (folder / "blobs").rglob("*") if p.is_file())
    call = load_bundle(rec.written[0]).calls[0]
    used = {sha for st in (*call.storages, *call.output_storages) for sha in st.blobs}
    assert set(kept) == used  # the evicted bundles' own blobs are gone, the shared x is kept
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
