"""Generic targets record their outputs by default: `recording()`, `dump_call` and `kdump record`
agree, `kdump info` says what was recorded, and a replay against a changed function mismatches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.bundle.inspect import recorded_outputs

KDUMP = [sys.executable, "-m", "kdump"]
KDUMP_ROOT = str(Path(kdump.__file__).resolve().parent.parent)

GOOD = """
import torch

def affine(x, out, scale=3.0):
    out.copy_(x * scale + 1)
    return out.sum()


def scale_(x):
    x.mul_(2)
"""
# The same function with a changed constant: what a wrong version of the user's code looks like.
WRONG = """
import torch

def affine(x, out, scale=3.0):
    out.copy_(x * scale + 1.0625)  # changed
    return out.sum()
"""

SCRIPT = """
import torch, usermod
g = torch.Generator().manual_seed(5)
x = torch.randn(32, 16, generator=g, device="cpu")
out = torch.randn(32, 16, generator=g, device="cpu")
usermod.affine(x, out)
"""


@pytest.fixture
def usermod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "usermod.py").write_text(textwrap.dedent(GOOD))
    monkeypatch.syspath_prepend(str(mod))
    sys.modules.pop("usermod", None)
    yield mod
    sys.modules.pop("usermod", None)


def _env(mod: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDUMP_")}
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(mod), KDUMP_ROOT, *old])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the module is rewritten below: never a stale .pyc
    return env


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(32, 16, generator=g, device="cpu"), torch.randn(
        32, 16, generator=g, device="cpu"
    )


def test_recording_and_dump_call_agree_and_dedup_unchanged(usermod: Path, tmp_path: Path) -> None:
    import usermod as um

    x, out = _inputs()
    with kdump.recording("usermod:affine", out=tmp_path / "rec") as rec:
        um.affine(x, out)
    x2, out2 = _inputs()
    kdump.dump_call(tmp_path / "one.kdump", um.affine, x2, out2)
    calls = [load_bundle(rec.written[0]).calls[0], load_bundle(tmp_path / "one.kdump").calls[0]]
    for call in calls:
        assert recorded_outputs(call) == ["x", "out", "return value"]
        assert torch.equal(call.outputs["out"], out) and torch.equal(call.outputs["x"], x)
        assert not torch.equal(call.kwargs.get("out", call.args[1]), out)  # the pre-call value
    one = load_bundle(tmp_path / "one.kdump")
    n = x.numel() * x.element_size()
    # x before = x after: stored once; out before and after differ: both stored; + the returned
    # 0-d float32 sum.
    assert one.nbytes == 3 * n + 4 and sum(c.nbytes for c in one.calls) == 4 * n + 4


def test_outputs_none_is_inputs_only(usermod: Path, tmp_path: Path, capsys) -> None:
    import usermod as um

    from kdump.cli import main

    x, _ = _inputs()
    with kdump.recording("usermod:scale_", out=tmp_path / "rec", outputs="none") as rec:
        um.scale_(x)
    call = load_bundle(rec.written[0]).calls[0]
    assert recorded_outputs(call) == [] and not call.has_outputs
    with pytest.raises(SystemExit) as exc:
        main(["info", str(rec.written[0])])
    text = capsys.readouterr().out
    assert exc.value.code in (0, None) and "outputs recorded: none (inputs only)" in text


def test_kdump_record_then_wrong_function_mismatches(usermod: Path, tmp_path: Path) -> None:
    env = _env(usermod)
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out_dir = tmp_path / "out"
    # sync mode: the flight recorder (ring, the default) keeps outputs only within its slots
    cmd = [*KDUMP, "record", "--mode", "sync", "-t", "usermod:affine", "-o", str(out_dir), "--"]
    r = subprocess.run(
        [*cmd, sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    (bundle,) = sorted(out_dir.rglob("*.kdump"))
    info = subprocess.run(
        [*KDUMP, "info", "--json", str(bundle)], env=env, capture_output=True, text=True
    )
    [rep] = json.loads(info.stdout)
    assert rep["calls"][0]["outputs"] == ["x", "out", "return value"]
    text = subprocess.run([*KDUMP, "info", str(bundle)], env=env, capture_output=True, text=True)
    assert "outputs recorded: x, out, return value" in text.stdout

    replay = [
        *KDUMP,
        "replay",
        "--device",
        "cpu",
        "--json",
        "--allow-target",
        "usermod:affine",
        str(bundle),
    ]
    same = subprocess.run(replay, env=env, capture_output=True, text=True, timeout=300)
    assert same.returncode == 0, same.stdout + same.stderr
    (usermod / "usermod.py").write_text(textwrap.dedent(WRONG))
    wrong = subprocess.run(replay, env=env, capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert "out differs from the recorded output" in wrong.stdout


def test_outputs_to_compare_are_named_before_the_call(
    usermod: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tensors a call may write in place are named to the capture before the call (their
    device spans get a device copy to compare with after it): a dumped call and dump_call name
    them; a call snapshot only in case it raises names none (its outputs are never taken)."""
    import usermod as um

    from kdump.bundle import capture as tensors_mod

    watched: list[list[int]] = []
    real = tensors_mod._device_copies

    def spy(*a: object) -> dict:
        watched.append(sorted(a[-1]))  # type: ignore[call-overload]
        return real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(tensors_mod, "_device_copies", spy)
    x, out = _inputs()
    with kdump.recording("usermod:affine", out=tmp_path / "rec", calls=[0], on_exception=True):
        um.affine(x, out)  # call 0: dumped, both tensors may be written
        um.affine(x, out)  # call 1: snapshot in case it raises
    assert watched == [[0, 1]]
    kdump.dump_call(tmp_path / "one.kdump", um.scale_, x)
    assert watched == [[0, 1], [0]]
