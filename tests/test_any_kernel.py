"""Verdicts on kernels without a spec: a user's own torch functions and C kernels (ctypes), each
with one planted bug, recorded with the flight recorder (the default of `kdump record`) and in
sync mode, then replayed: the replay finds the outputs by running and judges each bug right."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.errors import ExitCode
from kdump.record.config import RingConfig
from kdump.replay import replay

TESTS = Path(__file__).parent
ROOT = TESTS.parent
MOD = "targets.any_kernel"
KDUMP = [sys.executable, "-m", "kdump"]


@pytest.fixture(autouse=True)
def _targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    (tmp_path / "kdump.toml").write_text(f'allow-targets = ["{MOD}:*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))
    monkeypatch.delenv("KDUMP_TEST_BUG", raising=False)


@pytest.fixture(scope="module")
def clib(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The C kernels, built with the machine's C compiler."""
    from targets.any_kernel import C_SOURCE

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("clib")
    (folder / "k.c").write_text(C_SOURCE)
    lib = folder / "libk.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(folder / "k.c")], check=True)
    return str(lib)


def _record(
    tmp_path: Path, recorder: str, fn: str, feed: Callable[[Callable[..., None]], None], **kw
) -> list[Path]:
    """Record `feed(the hooked function)` with `recorder` (ring: the flight recorder, as
    `kdump record` runs by default; sync); the bundles it wrote, oldest call first."""
    from targets import any_kernel

    out = tmp_path / f"out-{recorder}-{fn}"
    opts = dict(kw)
    if recorder == "ring":
        opts["ring"] = RingConfig(slots=8, slot_bytes=1 << 20, journal_dir=tmp_path / "shm")
    with kdump.recording(f"{MOD}:{fn}", out=out, mode=recorder, **opts) as rec:
        feed(getattr(any_kernel, fn))
        if recorder == "ring":
            rec.flush()
            written = list(rec.written)
    if recorder == "sync":
        written = list(out.rglob("*.kdump"))
    assert written, f"nothing recorded in {out}"
    return sorted(written, key=_call_index)


def _call_index(path: Path) -> int:
    meta = load_bundle(path).calls[0].meta
    journal = meta.get("journal") or {}
    return int(journal.get("call_index", meta.get("call_index", 0)) or 0)


def _one_call(x: torch.Tensor, out: torch.Tensor) -> Callable[[Callable[..., None]], None]:
    return lambda f: f(x, out)


def _shown(v) -> str:
    return "\n".join(
        [f"{s.name} {s.status} {s.message}" for s in v.steps]
        + [f"note: {n}" for n in v.notes]
        + [f"finding: {f.kind} {f.message}" for f in v.findings]
    )


RECORDERS = ["ring", "sync"]


@pytest.mark.parametrize("recorder", RECORDERS)
@pytest.mark.parametrize("fn", ["torch_scale", "c_scale"])
def test_a_clean_kernel_is_clean_with_its_outputs_found(
    tmp_path: Path, recorder: str, fn: str, clib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KDUMP_TEST_CLIB", clib)
    x, out = torch.randn(32, 16), torch.zeros(32, 16)
    [path] = _record(tmp_path, recorder, fn, _one_call(x, out))
    [v] = replay([path], device="cpu", repeat=3)
    shown = _shown(v)
    assert v.exit_code == ExitCode.CLEAN and v.outcome == "clean", shown
    assert "outputs found by running: x (untouched), out (written)" in v.notes, shown
    assert v.outputs["write_only"] == ["out"], shown
    assert any(s.name == "eager/run 1 vs recorded" and s.status == "ok" for s in v.steps), shown
    assert "poisoned out" in shown


@pytest.mark.parametrize("recorder", RECORDERS)
@pytest.mark.parametrize("bug", ["lastrow", "offset"])
def test_a_regression_differs_from_production(
    tmp_path: Path, recorder: str, bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded with the correct function, replayed after it became subtly wrong."""
    x, out = torch.randn(32, 16), torch.zeros(32, 16)
    [path] = _record(tmp_path, recorder, "torch_scale", _one_call(x, out))
    monkeypatch.setenv("KDUMP_TEST_BUG", bug)
    [v] = replay([path], device="cpu", repeat=2)
    shown = _shown(v)
    assert v.exit_code == ExitCode.MISMATCH, shown
    [f] = [f for f in v.findings if f.kind == "mismatch"][:1]
    assert f.message.startswith("out differs from the recorded output (production)"), shown
    if bug == "lastrow":
        # the last row stays poison: production wrote it
        assert "NaN" in f.message, shown


def test_rows_left_unwritten_as_in_production_are_not_a_finding(tmp_path: Path) -> None:
    """A kernel that writes only the rows it promises: the rows production left alone are
    reported, not failed; rows production wrote and the replay did not are a finding."""
    x, out = torch.randn(32, 16), torch.zeros(32, 16)

    def feed(f: Callable[..., None]) -> None:
        os.environ["KDUMP_TEST_BUG"] = "lastrow"  # production left the last row alone
        try:
            f(x, out)
        finally:
            del os.environ["KDUMP_TEST_BUG"]

    [path] = _record(tmp_path, "sync", "torch_scale", feed)
    os.environ["KDUMP_TEST_BUG"] = "lastrow"
    try:
        [v] = replay([path], device="cpu", repeat=2)
    finally:
        del os.environ["KDUMP_TEST_BUG"]
    shown = _shown(v)
    assert v.exit_code == ExitCode.CLEAN, shown
    assert "out: 16 elements left unwritten, as in production" in v.notes, shown


@pytest.mark.parametrize("recorder", RECORDERS)
@pytest.mark.parametrize("fn", ["torch_noisy", "c_drifting"])
def test_a_different_result_every_run_is_nondeterminism_first(
    tmp_path: Path, recorder: str, fn: str, clib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KDUMP_TEST_CLIB", clib)
    x, out = torch.randn(64), torch.zeros(1 if fn == "c_drifting" else 64)
    [path] = _record(tmp_path, recorder, fn, _one_call(x, out))
    [v] = replay([path], device="cpu", repeat=6)
    shown = _shown(v)
    assert v.exit_code == ExitCode.MISMATCH, shown
    assert v.headline().startswith("nondeterminism: out is nondeterministic: 6 distinct results"), (
        shown
    )


@pytest.mark.parametrize("recorder", RECORDERS)
def test_a_write_past_the_buffer_is_a_memory_finding(
    tmp_path: Path, recorder: str, clib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Production wrote past `out` into the rest of a larger buffer (harmless there); the replay
    places `out`'s recorded span between guards."""
    monkeypatch.setenv("KDUMP_TEST_CLIB", clib)
    x, buf = torch.randn(64), torch.zeros(128)
    [path] = _record(tmp_path, recorder, "c_overrun", _one_call(x, buf[:64]))
    [v] = replay([path], device="cpu", repeat=2)
    shown = _shown(v)
    assert v.exit_code == ExitCode.MEMORY_FINDING, shown
    assert "past the end of out" in v.headline() or "after out" in v.headline(), shown


@pytest.mark.parametrize("recorder", RECORDERS)
@pytest.mark.parametrize("fn", ["c_stale", "torch_workspace"])
def test_state_kept_across_calls_differs_from_production(
    tmp_path: Path, recorder: str, fn: str, clib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second call of a kernel that kept state from the first (a cached pointer, a
    workspace sized by the first routing) replays alone in a fresh process: its result is not
    the one production computed."""
    monkeypatch.setenv("KDUMP_TEST_CLIB", clib)
    g = torch.Generator().manual_seed(3)
    n = 64
    out = torch.zeros(n, 4) if fn == "torch_workspace" else torch.zeros(n)
    first = torch.randn(out.shape, generator=g)
    second = torch.randn(out.shape, generator=g)
    labels1 = torch.where(torch.arange(n) < 20, 0, -1).int()
    labels2 = torch.where(torch.arange(n) < 50, 1, -1).int()

    def feed(f: Callable[..., None]) -> None:
        if fn == "torch_workspace":
            f(first, labels1, out)
            f(second, labels2, out)
        else:
            f(first, out)
            f(second.clone(), out)

    paths = _record(tmp_path, recorder, fn, feed)
    assert len(paths) == 2
    [v] = replay([paths[-1]], device="cpu", repeat=2)
    shown = _shown(v)
    assert v.exit_code == ExitCode.MISMATCH, shown
    assert any(f.message.startswith("out differs from the recorded output") for f in v.findings)


@pytest.mark.parametrize("recorder", RECORDERS)
def test_an_argument_read_and_written_gets_its_input_back(tmp_path: Path, recorder: str) -> None:
    x, acc = torch.randn(16), torch.randn(16)
    [path] = _record(tmp_path, recorder, "torch_accumulate", _one_call(x, acc))
    [v] = replay([path], device="cpu", repeat=4)
    shown = _shown(v)
    assert v.exit_code == ExitCode.CLEAN and v.outcome == "clean", shown
    assert "outputs found by running: x (untouched), acc (read and written)" in v.notes, shown
    assert v.outputs["write_only"] == [], shown


def test_an_output_written_with_the_values_it_held_is_found(tmp_path: Path) -> None:
    """A serving loop's output buffer holds the previous step's result: the call writes the
    same bytes, which a plain before/after comparison cannot see."""
    x = torch.randn(8, 8)
    out = x * 2  # already the result
    [path] = _record(tmp_path, "sync", "torch_scale", _one_call(x, out))
    [v] = replay([path], device="cpu", repeat=2)
    shown = _shown(v)
    assert "out (written with the values it held)" in v.notes[0], shown
    assert v.exit_code == ExitCode.CLEAN, shown
    os.environ["KDUMP_TEST_BUG"] = "offset"
    try:
        [bad] = replay([path], device="cpu", repeat=2)
    finally:
        del os.environ["KDUMP_TEST_BUG"]
    assert bad.exit_code == ExitCode.MISMATCH, _shown(bad)


def _no_oracle_bundles(tmp_path: Path, n: int) -> list[Path]:
    """Flight-recorder bundles of a clean kernel recorded without outputs."""
    paths = []
    for k in range(n):
        x, out = torch.randn(8, 4), torch.zeros(8, 4)
        sub = tmp_path / f"r{k}"
        sub.mkdir()
        paths += _record(sub, "ring", "torch_scale", _one_call(x, out), outputs="none")
    return paths


def test_no_oracle_is_its_own_outcome_never_clean(tmp_path: Path) -> None:
    [path] = _no_oracle_bundles(tmp_path, 1)
    assert not load_bundle(path).calls[0].has_outputs
    [v] = replay([path], device="cpu", repeat=3)
    shown = _shown(v)
    assert v.outcome == "no_oracle" and v.exit_code == ExitCode.CLEAN, shown
    assert v.strict_exit_code() == 1
    assert v.headline() == "ran without error — no oracle to compare with"
    assert v.to_json()["outcome"] == "no_oracle"
    # the repeats were still compared with each other, and the halos checked
    assert any(s.name == "eager/run 2 vs run 1" for s in v.steps), shown
    assert any(s.name == "eager/halo differential" for s in v.steps), shown


def test_a_folder_without_oracles_says_so_and_strict_fails(tmp_path: Path) -> None:
    paths = _no_oracle_bundles(tmp_path, 3)
    folder = tmp_path / "all"
    folder.mkdir()
    for k, p in enumerate(paths):
        shutil.copy(p, folder / f"b{k}.kdump")
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [*KDUMP, "replay", str(folder), "--device", "cpu", "-q"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 replays: 0 clean, 3 ran without an oracle" in r.stdout, r.stdout
    r = subprocess.run([*cmd, "--strict"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, timeout=600)
    doc = json.loads(r.stdout)
    assert [v["outcome"] for v in doc["verdicts"]] == ["no_oracle"] * 3
    assert doc["summary"] == {"replays": 3, "clean": 0, "no_oracle": 3, "failed": 0}


def _crash_bundle(tmp_path: Path, here: bool) -> Path:
    """A clean call whose process died of an illegal address at it (as salvage marks it)."""
    from kdump.bundle import capture_call, save_calls
    from kdump.bundle.capture import attach_outputs

    x, out = torch.randn(8, 4), torch.zeros(8, 4)
    crash = {
        "signal": 6,
        "cuda_error": "CUDA error: an illegal memory access was encountered",
        "at_this_call": here,
    }
    call = capture_call(
        f"{MOD}:torch_scale", [x, out], {}, names=["x", "out"], meta={"crash": crash}
    )
    out.copy_(x * 2)
    attach_outputs(call, [x, out], [1])
    path = tmp_path / ("crash.kdump" if here else "before.kdump")
    save_calls(path, [call])
    return path


def test_a_crash_bundle_escalates_or_says_where_to_look(tmp_path: Path) -> None:
    """Production died at this call and the plain replay is clean: the default replay asks for
    memcheck; without a GPU it says so, prints the command, and exits 125."""
    path = _crash_bundle(tmp_path, here=True)
    cmd = [*KDUMP, "replay", str(path), "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == ExitCode.CANNOT_RUN, out
    assert "production crashed at this call (CUDA error: an illegal memory access" in out
    assert "--mode sanitizer --tool memcheck" in out
    # --mode given explicitly does exactly that mode
    r = subprocess.run([*cmd, "--mode", "eager"], capture_output=True, text=True, timeout=600)
    assert r.returncode == ExitCode.CLEAN, r.stdout + r.stderr
    # a call before the one production died at replays as any other
    other = _crash_bundle(tmp_path, here=False)
    r = subprocess.run(
        [*KDUMP, "replay", str(other), "--device", "cpu"], capture_output=True, text=True
    )
    assert r.returncode == ExitCode.CLEAN, r.stdout + r.stderr
