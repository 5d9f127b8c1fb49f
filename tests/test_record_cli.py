"""`kdump record -- CMD`: end to end with subprocesses, spawned workers, signals, exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import kdump
from kdump.bundle import load_bundle
from kdump.cli.record import command as record_command
from kdump.record.capture_dir import INDEX_NAME, read_index
from kdump.record.launcher import STARTUP_DIR, build_env

STANDINS = Path(__file__).parent / "standins"
KDUMP = [sys.executable, "-m", "kdump"]
# The kdump under test, wherever it comes from (a checkout on PYTHONPATH or an installed wheel):
# every process below must import this one, whatever PYTHONPATH a test gives.
KDUMP_ROOT = str(Path(kdump.__file__).resolve().parent.parent)

SCRIPT = """
import multiprocessing as mp, os, signal, sys, torch
import plainmod

def child(seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, generator=g, device="cpu"), torch.randn(8, generator=g, device="cpu")
    plainmod.axpy(0.5, x, y)
    torch.save({"y": y}, os.path.join(sys.argv[1], f"child-{seed}.pt"))

if __name__ == "__main__":
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, generator=g, device="cpu"), torch.randn(4, generator=g, device="cpu")
    plainmod.axpy(2.0, x, y)
    torch.save({"y": y}, os.path.join(sys.argv[1], "parent.pt"))
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=child, args=(7,)); p.start(); p.join()
    mode = sys.argv[2]
    if mode == "flush":
        os.kill(os.getpid(), signal.SIGUSR1)  # flush: must not stop the process
        print("still alive")
    if mode == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(3)
"""


def _run(tmp_path: Path, mode: str, *opts: str, path: tuple[str, ...] = ()):
    """`kdump record` of SCRIPT; `path`: folders put on PYTHONPATH after the stand-ins."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDUMP_")}
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(STANDINS), *path, KDUMP_ROOT, *old])
    cmd = [*KDUMP, "record", "-t", "plainmod:axpy", "-o", str(tmp_path / "out"), *opts]
    if "--mode" not in opts:  # these tests cover sync mode; the flight recorder: test_ring
        cmd += ["--mode", "sync"]
    cmd += ["--", sys.executable, str(script), str(tmp_path), mode]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_record_end_to_end_with_spawned_worker(tmp_path):
    r = _run(tmp_path, "plain", "--outputs", "y")  # snapshot parameter y after the call
    assert r.returncode == 3, r.stderr  # CMD's exit code passes through
    bundles = sorted((tmp_path / "out").rglob("axpy-*.kdump"))
    assert len(bundles) == 2 and len({b.parent for b in bundles}) == 2  # parent + spawned child
    assert "wrote 2 bundle(s)" in r.stderr and "next: kdump replay " in r.stderr
    real = {
        "parent": torch.load(tmp_path / "parent.pt")["y"],
        "child": torch.load(tmp_path / "child-7.pt")["y"],
    }
    got = sorted((load_bundle(b).calls[0] for b in bundles), key=lambda c: c.args[2].numel())
    assert torch.equal(got[0].outputs["y"], real["parent"])
    assert torch.equal(got[1].outputs["y"], real["child"])
    for b in bundles:
        assert read_index(b.parent).paths == [b] and (b.parent / INDEX_NAME).is_file()


def test_sigterm_exit_code_and_flush_signal(tmp_path):
    r = _run(tmp_path, "term")
    assert r.returncode == 128 + 15, r.stderr
    assert len(list((tmp_path / "out").rglob(INDEX_NAME))) == 2
    r = _run(tmp_path, "flush", "--flush-signal", "USR1")
    assert r.returncode == 3 and "still alive" in r.stdout, r.stderr


def test_existing_sitecustomize_is_chained(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "marker"
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    r = _run(tmp_path, "plain", path=(str(site),))
    assert r.returncode == 3, r.stderr
    assert marker.read_text() == "ran"
    assert len(list((tmp_path / "out").rglob("axpy-*.kdump"))) == 2


def test_startup_folder_is_inert_without_kdump_record(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDUMP_")}
    env["PYTHONPATH"] = str(STARTUP_DIR)
    code = "import sys; print('kdump.record.session' in sys.modules, 'torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stderr


def test_build_env():
    env = build_env(
        {"PYTHONPATH": "/x"}, ("deep_gemm", "m:f"), {"calls": "0-3", "on_exception": True}
    )
    assert env["KDUMP_RECORD"] == "1" and env["KDUMP_TARGETS"] == "deep_gemm,m:f"
    assert env["KDUMP_CALLS"] == "0-3" and env["KDUMP_ON_EXCEPTION"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(STARTUP_DIR), "/x"]
    assert Path(env["KDUMP_OUT"]).is_absolute()
    budgets = build_env({}, ("deep_gemm",), {"device_bytes": "0", "static_bytes": "256M"})
    assert budgets["KDUMP_DEVICE_BYTES"] == "0" and budgets["KDUMP_STATIC_BYTES"] == "256M"
    from kdump.record.config import RingConfig

    ring = RingConfig.from_env(budgets)
    assert ring.device_bytes == 0 and ring.static_bytes == 256 << 20


def test_help_lists_every_variable():
    from kdump import config

    r = CliRunner().invoke(record_command, ["--help"])
    assert r.exit_code == 0
    for var in config.ENV_VARS:
        assert var.name in r.output


@pytest.mark.parametrize(
    "opts", [["--calls", "9-1"], ["--ring-slots", "1"], ["-t", "nocolon"], ["--keep", "all"]]
)
def test_bad_options_exit_2(tmp_path, opts):
    r = subprocess.run(
        [*KDUMP, "record", *opts, "--", sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") <= 3  # a short message, no traceback
