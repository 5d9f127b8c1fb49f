"""Kill campaigns under `kdump record`: recorded processes SIGKILLed at random moments, then
salvaged by kdump at the program's end. Every salvaged bundle must load, verify and hold what
its call was fed; every killed process' device tier must have been written by the salvage
process. On CPU the device tier is a shared file (the stand-in importer of test_salvager); on a
GPU the MoE decode loop runs in ring mode and its own processes are killed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_salvager import FAKE_SALVAGER, KDUMP_ROOT, STANDINS, _fake_start

from kdump.bundle import load_bundle
from kdump.record import launcher
from kdump.record.flight.announce import DUMP_SUFFIX

TRIALS = 40

# The program: forks TRIALS recorded children one after another and SIGKILLs each at a random
# moment. Each child announces a shared file as its device tier, then records calls of
# plainmod:axpy whose values follow from the step, writing the step into its "device" memory.
CAMPAIGN = """
import os, random, signal, sys, time
from pathlib import Path
import torch
import plainmod
from kdump.record.flight.announce import announce

def fed(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, generator=g), torch.randn(16, generator=g)

def child(w, mem):
    y = torch.zeros(16)
    x, y0 = fed(0)
    plainmod.axpy(0.5, x, y0)  # the journal exists after the first call
    jdir = Path(os.environ["KDUMP_JOURNAL_DIR"])
    (journal,) = [p for p in jdir.glob(f"kdump-journal-{os.getpid()}-*") if "." not in p.name]
    mem.write_bytes(bytes(4096))
    reason = announce(journal, 0, {"path": str(mem), "nbytes": 4096})
    assert reason is None, reason
    os.write(w, b"r")
    with open(mem, "r+b") as f:
        for step in range(1, 10**6):
            x, y = fed(step)
            plainmod.axpy(0.5, x, y)
            f.seek(0)
            f.write(step.to_bytes(8, "little") * 512)

rnd = random.Random(int(sys.argv[2]))
for trial in range(int(sys.argv[1])):
    r, w = os.pipe()
    mem = Path(sys.argv[3]) / f"mem{trial}"
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(w, mem)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"r"
    os.close(r)
    time.sleep(rnd.uniform(0, 0.03))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print("campaign done", flush=True)
"""


def _fed(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, generator=g), torch.randn(16, generator=g)


def test_cpu_kill_campaign_under_kdump_record(tmp_path, monkeypatch, capfd):
    fake = tmp_path / "fake_salvager.py"
    fake.write_text(FAKE_SALVAGER)
    _fake_start(monkeypatch, tmp_path, [sys.executable, str(fake), "0"])
    device_tiers: dict[int, bytes] = {}
    real_salvage = launcher.salvage_run

    def salvage_run(journals, out, context, echo):  # what the salvage process left for kdump
        for j in journals.glob("kdump-journal-*.cuda0"):
            device_tiers[int(j.name.split("-")[2])] = j.read_bytes()
        return real_salvage(journals, out, context, echo)

    monkeypatch.setattr(launcher, "salvage_run", salvage_run)
    monkeypatch.setenv("KDUMP_JOURNAL_DIR", str(tmp_path / "shm"))
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDINS), KDUMP_ROOT, *old]))
    script = tmp_path / "campaign.py"
    script.write_text(textwrap.dedent(CAMPAIGN))
    mem = tmp_path / "mem"
    mem.mkdir()
    lines: list[str] = []
    opts = {"out": str(tmp_path / "out"), "mode": "ring", "ring_slots": 8, "slot_bytes": "64K"}
    cmd = [sys.executable, str(script), str(TRIALS), "7", str(mem)]
    rc = launcher.launch(cmd, ("plainmod:axpy",), opts, echo=lines.append)
    assert rc == 0 and "campaign done" in capfd.readouterr().out, lines
    assert not [line for line in lines if "cannot salvage" in line], lines
    reports = sorted((tmp_path / "out").rglob("journal-*-salvage.json"))
    assert len(reports) == TRIALS, lines
    assert len(device_tiers) == TRIALS  # every killed child's device tier was written
    newest = []
    for data in device_tiers.values():  # the memory as the kill left it: mid-write at worst
        steps = [int.from_bytes(data[i : i + 8], "little") for i in range(0, 4096, 8)]
        assert len(data) == 4096
        assert steps == sorted(steps, reverse=True) and steps[0] - steps[-1] <= 1, set(steps)
        newest.append(steps[0])
    assert sum(n > 0 for n in newest) > TRIALS // 2  # most kills came after writes
    total = 0
    for rep in reports:
        doc = json.loads(rep.read_text())
        # a slot the kill tore is reported with why, never written as a bundle
        assert all(t["reason"] for t in doc["torn"]), doc["torn"]
        assert doc["bundles"], doc
        for b in doc["bundles"]:
            with load_bundle(b) as bundle:
                bundle.verify()
                call = bundle.calls[0]
                x, y = _fed(call.meta["journal"]["call_index"])
                assert torch.equal(call.args[1], x) and torch.equal(call.args[2], y)
                assert call.meta["crash"]["exit_code"] == 0
                total += 1
    assert total >= TRIALS


# -- on a GPU ---------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "moe_decode.py"
GPU_TRIALS = int(os.environ.get("KDUMP_TEST_GPU_KILLS", "10"))  # fewer for a quick GPU check
PACKAGED = "kdump.kernels.sm120.api:m_grouped_fp8_gemm_nt_contiguous"


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


@pytest.mark.gpu
def test_gpu_kill_campaign_of_the_moe_decode_loop(tmp_path):
    """SIGKILL the MoE decode loop (ring mode, packaged kernel) at random moments of its decode
    steps: kdump salvages, and every salvaged bundle loads and verifies."""
    rnd = random.Random(11)
    total = 0
    for trial in range(GPU_TRIALS):
        out = tmp_path / f"out{trial}"
        cmd = [sys.executable, "-m", "kdump", "record", "-t", PACKAGED, "-o", str(out), "--"]
        cmd += [sys.executable, str(EXAMPLE), "--backend", "packaged", "--steps", "100000"]
        log = tmp_path / f"stderr{trial}.txt"
        with open(log, "w") as f:
            kd = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
        deadline = time.monotonic() + 300
        program = None
        while time.monotonic() < deadline and kd.poll() is None:
            kids = [c for c in _children(kd.pid) if "salvager" not in _cmdline(c)]
            if kids and _recorded_a_call(kids[0]):
                program = kids[0]
                break
            time.sleep(0.2)
        assert program is not None, log.read_text()[-4000:]
        # Into the decode steps, graphs replaying. (The journal exists from CUDA's start, long
        # before the first call on a loaded machine: a kill then has nothing to salvage.)
        time.sleep(rnd.uniform(0.2, 3.0))
        os.kill(program, signal.SIGKILL)
        kd.wait(timeout=300)
        err = log.read_text()[-4000:]
        assert kd.returncode == 128 + signal.SIGKILL, err
        bundles = sorted(out.rglob("journal-*.kdump"))
        assert bundles, err
        for b in bundles:
            with load_bundle(b) as bundle:
                bundle.verify()
                assert bundle.calls[-1].meta["crash"]["signal"] == signal.SIGKILL
            total += 1
        reports = [json.loads(r.read_text()) for r in out.rglob("journal-*-salvage.json")]
        assert reports and all(t["reason"] for r in reports for t in r["torn"]), err
    assert total >= GPU_TRIALS
    assert not list(Path("/dev/shm").glob(f"kdump-journal-*{DUMP_SUFFIX}*"))


def _recorded_a_call(pid: int) -> bool:
    """Whether the live process `pid`'s journal holds a complete call yet."""
    from kdump.format.journal import SlotState
    from kdump.record.flight.journal_reader import read_journal

    for j in Path("/dev/shm").glob(f"kdump-run-*/kdump-journal-{pid}-*"):
        if "." in j.name:  # its static region, device-tier files
            continue
        try:
            if read_journal(j).having(SlotState.COMPLETE):
                return True
        except Exception:  # being created, or torn mid-write: look again
            pass
    return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
