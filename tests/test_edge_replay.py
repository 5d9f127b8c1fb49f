"""Odd but real bundles after they exist: replay verdicts, exit codes and comparisons of
generic targets whose code drifted, NaN/Inf outputs, return values and odd indices."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kdump
from kdump.errors import ExitCode
from kdump.kernels.plugin import Tolerance
from kdump.replay import replay
from kdump.replay.compare import agree, compare_to_reference

KDUMP = [sys.executable, "-m", "kdump"]
NAN = float("nan")
INF = float("inf")

USER = """
import torch

def affine(x, out):
    out.copy_(x * 3 + 1)

def doubled(x):
    return x * 2

def pair(x):
    return (x + 1, int(x.numel()))
"""


@pytest.fixture
def usermod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user module `edgeuser` importable here and in replay children; rewrite it to drift."""
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "edgeuser.py").write_text(textwrap.dedent(USER))
    monkeypatch.syspath_prepend(str(mod))
    old = [p for p in __import__("os").environ.get("PYTHONPATH", "").split(":") if p]
    monkeypatch.setenv("PYTHONPATH", ":".join([str(mod), *old]))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    sys.modules.pop("edgeuser", None)
    yield mod
    sys.modules.pop("edgeuser", None)


def _dump(usermod: Path, tmp_path: Path, fn: str, *args: object) -> Path:
    import edgeuser

    path = tmp_path / f"{fn}.kdump"
    kdump.dump_call(path, getattr(edgeuser, fn), *args)
    return path


def _rewrite(usermod: Path, text: str) -> None:
    (usermod / "edgeuser.py").write_text(textwrap.dedent(text))
    sys.modules.pop("edgeuser", None)


def _replay(path: Path, **kw: object):
    [v] = replay([path], device="cpu", repeat=1, allow_targets=("edgeuser:*",), **kw)
    return v


# --- comparisons with NaN / Inf ------------------------------------------------------------


def test_same_nan_and_inf_as_the_oracle_agree_within_tolerance() -> None:
    a = torch.tensor([NAN, INF, -INF, 1.0])
    b = torch.tensor([NAN, INF, -INF, 1.0 + 1e-7])  # one last-bit difference elsewhere
    ag = agree(a, b)
    assert ag.ok and not ag.exact, ag.message
    tol = Tolerance(calc_diff=1e-3, atol=1e-3, rtol=1e-3)
    cmp = compare_to_reference(a, b, None, tol)
    assert cmp.ok, cmp.message


def test_a_new_or_lost_nan_is_a_failure_with_its_coordinate() -> None:
    new = agree(torch.tensor([1.0, NAN]), torch.tensor([1.0, 2.0]))
    assert not new.ok and "[1]" in new.message and "got nan" in new.message
    lost = agree(torch.tensor([1.0, 2.0]), torch.tensor([1.0, NAN]))
    assert not lost.ok and "[1]" in lost.message and "expected nan" in lost.message
    flipped = agree(torch.tensor([-INF, 1.0]), torch.tensor([INF, 1.0]))
    assert not flipped.ok and "[0]" in flipped.message


def test_poison_left_where_the_oracle_is_nan_is_still_unwritten() -> None:
    from kdump.replay.compare import poison

    out = torch.empty(4)
    poison(out)
    out[:2] = 1.0
    tol = Tolerance(calc_diff=1e-3, atol=1e-3, rtol=1e-3)
    cmp = compare_to_reference(out, torch.tensor([1.0, 1.0, NAN, NAN]), None, tol)
    assert not cmp.ok and cmp.metrics["unwritten"] == 2 and "never written" in cmp.message


# --- generic targets whose code drifted ----------------------------------------------------


def test_changed_return_value_is_a_mismatch(usermod: Path, tmp_path: Path) -> None:
    path = _dump(usermod, tmp_path, "doubled", torch.randn(8, 4))
    assert _replay(path).headline() == "clean"
    _rewrite(usermod, USER.replace("x * 2", "x * 3"))
    v = _replay(path)
    assert v.exit_code == ExitCode.MISMATCH, v.headline()
    assert "return value" in v.headline()


def test_changed_non_tensor_part_of_the_return_value_is_a_mismatch(
    usermod: Path, tmp_path: Path
) -> None:
    path = _dump(usermod, tmp_path, "pair", torch.randn(8, 4))
    assert _replay(path).exit_code == 0
    _rewrite(usermod, USER.replace("int(x.numel())", "int(x.numel()) + 1"))
    v = _replay(path)
    assert v.exit_code == ExitCode.MISMATCH and "return value" in v.headline(), v.headline()


def test_changed_signature_cannot_run_the_recording(usermod: Path, tmp_path: Path) -> None:
    path = _dump(usermod, tmp_path, "affine", torch.randn(8, 4), torch.empty(8, 4))
    _rewrite(usermod, USER.replace("def affine(x, out):", "def affine(x, out, scale):"))
    v = _replay(path)
    assert v.exit_code == ExitCode.CANNOT_RUN, v.headline()
    assert "does not accept the recorded arguments" in v.headline()


def test_vanished_module_and_function_cannot_run(usermod: Path, tmp_path: Path) -> None:
    path = _dump(usermod, tmp_path, "affine", torch.randn(8, 4), torch.empty(8, 4))
    _rewrite(usermod, "def other():\n    pass\n")
    v = _replay(path)
    assert v.exit_code == ExitCode.CANNOT_RUN and "'affine' not found" in v.headline()
    (usermod / "edgeuser.py").unlink()
    sys.modules.pop("edgeuser", None)
    v = _replay(path)
    assert v.exit_code == ExitCode.CANNOT_RUN and "cannot import edgeuser" in v.headline()


def test_now_raising_target_is_a_kernel_error_with_escaped_text(
    usermod: Path, tmp_path: Path
) -> None:
    path = _dump(usermod, tmp_path, "affine", torch.randn(8, 4), torch.empty(8, 4))
    _rewrite(usermod, USER.replace("out.copy_(x * 3 + 1)", "raise ValueError('bad\\x1b[2J')"))
    r = subprocess.run(
        [*KDUMP, "replay", str(path), "--device", "cpu", "--allow-target", "edgeuser:*"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == ExitCode.KERNEL_ERROR, r.stdout + r.stderr
    assert "\x1b" not in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr


def test_repeats_alone_are_no_oracle(usermod: Path, tmp_path: Path) -> None:
    from kdump.bundle import capture_call, save_calls

    # Inputs only (no recorded outputs), run twice: agreeing with itself is not "clean".
    x, out = torch.randn(8, 4), torch.empty(8, 4)
    call = capture_call("edgeuser:affine", [x, out], {}, names=["x", "out"])
    call.outputs = None
    save_calls(tmp_path / "i.kdump", [call])
    [v] = replay([tmp_path / "i.kdump"], device="cpu", repeat=2, allow_targets=("edgeuser:*",))
    assert v.exit_code == 0
    assert v.headline() == "ran without error — no oracle to compare with", v.headline()


def test_reference_backend_against_itself_is_no_oracle(tmp_path: Path) -> None:
    from kdump.bundle import capture_call, save_calls
    from kdump.kernels.registry import spec_for

    name = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
    args, kwargs = spec_for(name).generate(seed=1, num_groups=2, n=128, k=256, expected_m=8)
    call = capture_call(name, args, kwargs, names=spec_for(name).param_names())
    save_calls(tmp_path / "r.kdump", [call])
    # The reference agreeing with a second run of itself says nothing about the kernel.
    [v] = replay([tmp_path / "r.kdump"], device="cpu", backend="reference", repeat=2)
    assert v.exit_code == 0
    assert v.headline() == "ran without error — no oracle to compare with", v.headline()


def test_a_call_that_raised_in_production_says_whether_it_raises_again(
    usermod: Path, tmp_path: Path
) -> None:
    _rewrite(usermod, USER.replace("out.copy_(x * 3 + 1)", "raise ValueError('no rows')"))
    import edgeuser

    path = tmp_path / "raised.kdump"
    with pytest.raises(ValueError):
        kdump.dump_call(path, edgeuser.affine, torch.randn(8, 4), torch.empty(8, 4))
    v = _replay(path)
    assert v.exit_code == ExitCode.KERNEL_ERROR and "no rows" in v.headline()
    assert any(n.startswith("production raised too: ValueError: no rows") for n in v.notes)
    _rewrite(usermod, USER)
    v = _replay(path)
    assert v.exit_code == 0, v.headline()
    assert any("does not reproduce here" in n for n in v.notes), v.notes
