"""Hostile bundles, end to end: an allowed glob that would walk into modules the target's module
merely imported, a broadcast view over a huge logical size, re-created tensors of every dtype,
rich emoji codes in bundle strings, and symlinked bundles given to `kdump pack`."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdump.bundle import capture_call, save_calls
from kdump.cli import main
from kdump.errors import CannotRunError, ExitCode, UntrustedTargetError
from kdump.kernels import registry
from kdump.report.script import render_script

MOD = "kd_campaign_mod"
HELPERS = "kd_campaign_helpers"
# The target's module imports os, subprocess and torch, a helper's function and a partial of it.
MOD_SOURCE = f"""\
import functools
import os
import subprocess

import torch

from {HELPERS} import Wrapper, touch

part = functools.partial(touch)
holder = type("Holder", (), {{"os": os}})


def fn(path):
    open(path, "w").close()


wrapped = Wrapper(fn)
"""
HELPERS_SOURCE = """\
def touch(path):
    open(path, "w").close()


class Wrapper:
    def __init__(self, fn):
        self.__wrapped__ = fn

    def __call__(self, *args):
        return self.__wrapped__(*args)
"""
# Targets that reach a function through a module the target's module imported.
THROUGH_MODULES = (
    f"{MOD}:os.system",
    f"{MOD}:subprocess.run",
    f"{MOD}:torch.serialization.os.system",
    f"{MOD}:holder.os.system",
)


@pytest.fixture
def lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding the target's module, the current folder elsewhere, no user config."""
    folder = tmp_path / "lib"
    folder.mkdir()
    (folder / f"{MOD}.py").write_text(MOD_SOURCE)
    (folder / f"{HELPERS}.py").write_text(HELPERS_SOURCE)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "no-config.toml"))
    for name in (MOD, HELPERS):
        sys.modules.pop(name, None)
    return folder


def _args(target: str, canary: Path) -> list[object]:
    if target.endswith(".system"):
        return [f"touch {canary}"]
    if target.endswith(".run"):
        return [["touch", str(canary)]]
    return [str(canary)]


def _bundle(path: Path, target: str, canary: Path) -> Path:
    return save_calls(path, [capture_call(target, _args(target, canary), {}, names=["a"])])


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


REPLAY = ("--device", "cpu", "--backend", "library", "--repeat", "1")


def _flat(text: str) -> str:
    """Printed text with rich's line wrapping undone."""
    return " ".join(text.split())


@pytest.mark.parametrize(
    ("target", "pattern"),
    [(t, f"{MOD}:*") for t in THROUGH_MODULES]
    + [(THROUGH_MODULES[0], "*")]
    + [(THROUGH_MODULES[2], "exact")],
)
def test_a_walk_through_a_module_never_runs(
    lib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, pattern: str
) -> None:
    canary = tmp_path / "CANARY"
    bundle = _bundle(tmp_path / "b.kdump", target, canary)
    allow = target if pattern == "exact" else pattern
    code, out, err = _cli(
        capsys, "replay", str(bundle), *REPLAY, "--allow-target", allow, "--path", str(lib)
    )
    assert code == ExitCode.USAGE, out + err
    assert "through the module object" in _flat(out + err)
    assert not canary.exists()


@pytest.mark.parametrize("name", ["part", "touch"])
def test_a_glob_allows_only_what_the_module_defines(
    lib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    canary = tmp_path / "CANARY"
    bundle = _bundle(tmp_path / "b.kdump", f"{MOD}:{name}", canary)
    argv = ("replay", str(bundle), *REPLAY, "--path", str(lib), "--allow-target")
    code, out, err = _cli(capsys, *argv, f"{MOD}:*")
    assert code == ExitCode.USAGE, out + err
    assert "does not define" in _flat(out + err)
    assert f"--allow-target '{MOD}:{name}'" in _flat(out + err)
    assert not canary.exists()
    # Named exactly, the same attribute runs (a partial, a function imported from elsewhere).
    code, out, err = _cli(capsys, *argv, f"{MOD}:{name}")
    assert code == 0, out + err
    assert canary.exists()


@pytest.mark.parametrize("name", ["fn", "wrapped"])
def test_a_glob_runs_what_the_module_defines(
    lib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    canary = tmp_path / "CANARY"
    bundle = _bundle(tmp_path / "b.kdump", f"{MOD}:{name}", canary)
    code, out, err = _cli(
        capsys, "replay", str(bundle), *REPLAY, "--path", str(lib), "--allow-target", f"{MOD}:*"
    )
    assert code == 0, out + err
    assert canary.exists()


def test_resolve_allowed_rules(lib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(lib))
    for target in THROUGH_MODULES:
        for patterns in ((f"{MOD}:*",), (target,), ("*",)):
            assert registry.target_allowed(target, patterns)  # the name alone passes
            with pytest.raises(UntrustedTargetError, match="through the module object"):
                registry.resolve_allowed(target, patterns)
    assert registry.resolve_allowed(f"{MOD}:fn", (f"{MOD}:*",)).__name__ == "fn"
    part = registry.resolve_allowed(f"{MOD}:part", (f"{MOD}:part",))
    assert isinstance(part, functools.partial)
    with pytest.raises(UntrustedTargetError):
        registry.resolve_allowed(f"{MOD}:fn", ("other:*",))
    # A glob of another module's name does not reach os either.
    with pytest.raises(UntrustedTargetError, match="does not define"):
        registry.resolve_allowed("os:system", ("os:*",))
    assert registry.resolve_allowed("os:system", ("os:system",)) is __import__("os").system
    # check_target keeps the patterns for the replay child's resolution.
    registry.check_target(f"{MOD}:part", (f"{MOD}:p*",))
    with pytest.raises(UntrustedTargetError, match="does not define"):
        registry.resolve_allowed(f"{MOD}:part")
    registry.check_target(f"{MOD}:part", (f"{MOD}:part",))
    assert isinstance(registry.resolve_allowed(f"{MOD}:part"), functools.partial)


def test_an_import_failure_names_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "none.toml"))
    with pytest.raises(CannotRunError, match="--path DIR"):
        registry.resolve_allowed("kd_no_such_module_anywhere:fn", ("kd_no_such_module_anywhere:*",))


def test_torch_ops_targets_resolve_under_a_glob(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "none.toml"))
    op = registry.resolve_allowed("torch.ops.aten:add", ("torch.ops.aten:*",))
    assert op is torch.ops.aten.add


def _run_script(tmp_path: Path, bundle: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "repro.py"
    script.write_text(render_script(str(bundle)), encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-I", str(script), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_the_repro_script_applies_the_same_rule(lib: Path, tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    for target in THROUGH_MODULES[:2]:
        bundle = _bundle(tmp_path / "b.kdump", target, canary)
        for allow in (f"{MOD}:*", target):
            proc = _run_script(tmp_path, bundle, "--path", str(lib), "--allow-target", allow)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert "through the module object" in proc.stderr and "Traceback" not in proc.stderr
            assert not canary.exists()
    bundle = _bundle(tmp_path / "b.kdump", f"{MOD}:touch", canary)
    proc = _run_script(tmp_path, bundle, "--path", str(lib), "--allow-target", f"{MOD}:*")
    assert proc.returncode == 2 and "does not define" in proc.stderr, proc.stderr
    assert not canary.exists()
    proc = _run_script(tmp_path, bundle, "--path", str(lib), "--allow-target", f"{MOD}:touch")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # it ran (no outputs to match)
    assert canary.exists()
