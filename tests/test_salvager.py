"""The salvage process of `kdump record`: its socket protocol, owner-death watching, the
launcher's waiting and bounds, devshare's validation; on a GPU, the device tier surviving an
illegal address and a SIGKILL of its owner.

On CPU the importer is a stand-in that maps a shared file (torch.from_file): live memory of the
announcing process, as a CUDA IPC import is, so what is written is what the memory holds when
its owner dies, not when it was announced."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import kdump
from kdump import config
from kdump.record import launcher
from kdump.record.flight import announce as protocol
from kdump.record.flight import devshare, salvager
from kdump.record.flight.announce import ENV, announce, dump_path, pid_alive, request
from kdump.record.flight.salvager import Salvager

KDUMP_ROOT = str(Path(kdump.__file__).resolve().parent.parent)
STANDINS = Path(__file__).parent / "standins"
NBYTES = 4096


def shm_importer(doc: dict) -> torch.Tensor:
    """The CPU stand-in for devshare.import_cuda: the announced file, mapped shared."""
    if set(doc) != {"path", "nbytes"} or not isinstance(doc["nbytes"], int):
        raise ValueError("not a shared-file description")
    return torch.from_file(doc["path"], shared=True, size=doc["nbytes"], dtype=torch.uint8)


FAKE_SALVAGER = f"""
import sys, time
sys.path.insert(0, {KDUMP_ROOT!r})
import torch
from kdump.record.flight import salvager

def shm_importer(doc):
    return torch.from_file(doc["path"], shared=True, size=doc["nbytes"], dtype=torch.uint8)

real_write = salvager._write_memory
def slow_write(memory, dest):
    time.sleep(float(sys.argv[1]))  # kdump must wait for this before it salvages
    real_write(memory, dest)

salvager._write_memory = slow_write
sys.exit(salvager.main(sys.argv[2:], importer=shm_importer))
"""

STUCK_SALVAGER = """
import argparse, signal, socket, sys, time
ap = argparse.ArgumentParser()
ap.add_argument("--socket"); ap.add_argument("--journal-dir"); ap.add_argument("--parent")
ap.add_argument("--ignore-signal", action="append")
args = ap.parse_args()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
s = socket.socket(socket.AF_UNIX); s.bind(args.socket); s.listen(8)
print("ready", flush=True)
time.sleep(3600)  # accepts nothing, answers nothing
"""

# A recorded process: announces a shared file as its device tier, fills it, waits to be killed.
OWNER = """
import os, sys, time
from pathlib import Path
from kdump.record.flight.announce import announce
journal, mem = Path(sys.argv[1]), Path(sys.argv[2])
mem.write_bytes(bytes(4096))
print(announce(journal, 0, {"path": str(mem), "nbytes": 4096}), flush=True)
with open(mem, "r+b") as f:
    f.write(bytes((i * 7 + 3) % 256 for i in range(4096)))
print("filled", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _pattern(seed: int) -> bytes:
    return bytes((i * 7 + seed) % 256 for i in range(NBYTES))


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDUMP_")}
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([KDUMP_ROOT, *old])
    env.update(extra)
    return env


@pytest.fixture
def short_dir():
    d = Path(tempfile.mkdtemp(prefix="kd-", dir="/tmp"))  # Unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(tmp_path, short_dir, monkeypatch):
    jdir = tmp_path / "run"
    jdir.mkdir()
    srv = Salvager(short_dir / "s.sock", jdir, importer=shm_importer)
    srv.listen()
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    monkeypatch.setenv(ENV, str(srv.socket_path))
    yield srv
    srv.stop.set()
    t.join(timeout=5)


def _raw(srv: Salvager, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(srv.socket_path))
        s.sendall(payload)
        return protocol.recv_message(s, 10)


def _frame(obj: object) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def test_announce_without_a_salvage_process_gives_the_reason(monkeypatch, short_dir):
    monkeypatch.delenv(ENV, raising=False)
    reason = announce(Path("/dev/shm/kdump-journal-1-a"), 0, {})
    assert reason is not None and "not running under `kdump record`" in reason
    monkeypatch.setenv(ENV, str(short_dir / "nobody.sock"))
    reason = announce(Path("/dev/shm/kdump-journal-1-a"), 0, {})
    assert reason is not None and "cannot reach the salvage process" in reason


def test_announce_is_held_and_the_end_writes_the_live_bytes(server, tmp_path):
    mem = tmp_path / "mem"
    mem.write_bytes(_pattern(1))
    journal = server.journal_dir / f"kdump-journal-{os.getpid()}-1"
    assert announce(journal, 0, {"path": str(mem), "nbytes": NBYTES}) is None
    held = request(server.socket_path, {"op": "status"}, 10)["held"]
    assert held == [{"pid": os.getpid(), "journal": str(journal), "device": 0, "nbytes": NBYTES}]
    with open(mem, "r+b") as f:  # the owner writes after announcing: the file must hold this
        f.write(_pattern(2))
    reply = request(server.socket_path, {"op": "ended"}, 10)
    assert reply["ok"] and reply["written"] == [str(dump_path(journal, 0))]
    assert dump_path(journal, 0).read_bytes() == _pattern(2)
    assert not [p for p in journal.parent.iterdir() if p.name.endswith(".tmp")]
    assert server.stop.wait(5)  # it ends after the program did


def test_malformed_and_oversized_requests_are_refused(server, tmp_path, monkeypatch):
    mem = tmp_path / "mem"
    mem.write_bytes(_pattern(1))
    doc = {"path": str(mem), "nbytes": NBYTES}
    good = str(server.journal_dir / "kdump-journal-9-a")

    def refused(payload: bytes, why: str) -> None:
        reply = _raw(server, payload)
        assert reply["ok"] is False and why in reply["reason"], reply

    refused(struct.pack(">I", protocol.MAX_FRAME + 1), "over the")
    refused(struct.pack(">I", 2) + b"\xff\xfe", "not UTF-8 JSON")
    refused(_frame([1, 2]), "not an object")
    refused(_frame({"op": "eval", "code": "1"}), "unknown request")
    refused(_frame({"op": "status", "x": 1}), "takes no fields")
    base = {"op": "announce", "journal": good, "device": 0, "doc": doc}
    for change, why in [
        ({"journal": "relative/kdump-journal-9-a"}, "not a journal of this run"),
        ({"journal": str(tmp_path / "kdump-journal-9-a")}, "not a journal of this run"),
        ({"journal": good + ".cuda0"}, "not a journal of this run"),
        ({"journal": str(server.journal_dir / "passwd")}, "not a journal of this run"),
        ({"journal": 7}, "journal must be a path"),
        ({"device": "0"}, "device index"),
        ({"device": True}, "device index"),
        ({"device": 5000}, "device index"),
        ({"doc": [doc]}, "doc must be an object"),
        ({"extra": 1}, "exactly journal, device and doc"),
        ({"doc": {"path": str(mem)}}, "cannot import the memory"),
    ]:
        refused(_frame({**base, **change}), why)
    # a client that stops mid-message is timed out; the server goes on serving
    monkeypatch.setattr(protocol, "IO_TIMEOUT", 0.3)
    refused(struct.pack(">I", 100) + b"{", "in time")
    assert request(server.socket_path, {"op": "status"}, 10)["held"] == []
    assert not list(server.journal_dir.iterdir())  # nothing was written anywhere


def test_owner_death_is_noticed_and_its_file_written_at_once(server, tmp_path):
    journal = server.journal_dir / "kdump-journal-77-b"
    mem = tmp_path / "mem"
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(journal), str(mem), "60"],
        env=_child_env(**{ENV: str(server.socket_path)}),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "None\n"  # held
    assert proc.stdout.readline() == "filled\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    dest = dump_path(journal, 0)
    deadline = time.monotonic() + 10
    while not dest.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dest.read_bytes() == _pattern(3)  # without any "ended" from kdump
    assert request(server.socket_path, {"op": "status"}, 10)["held"] == []


def test_announce_is_bounded_when_the_salvage_process_hangs(short_dir, monkeypatch):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:  # listens, never answers
        hung.bind(str(short_dir / "hung.sock"))
        hung.listen(4)
        monkeypatch.setenv(ENV, str(short_dir / "hung.sock"))
        monkeypatch.setattr(protocol, "ANNOUNCE_TIMEOUT", 0.5)
        t0 = time.monotonic()
        reason = announce(Path("/dev/shm/kdump-journal-1-a"), 0, {})
        assert time.monotonic() - t0 < 3
    assert reason == "the salvage process did not answer in 0.5 s"


# kdump itself: starts the salvage process, says where, then waits to be SIGKILLed
KDUMP_STANDIN = """
import sys, time
from pathlib import Path
from kdump.record.flight import salvager
got = salvager.start(Path(sys.argv[1]), {}, argv=[sys.executable, sys.argv[2], "0"])
print(got.socket_path, got.proc.pid, flush=True)
time.sleep(120)
"""


def test_salvage_process_writes_everything_and_exits_when_kdump_dies(tmp_path, monkeypatch):
    fake = tmp_path / "fake_salvager.py"
    fake.write_text(FAKE_SALVAGER)
    jdir = tmp_path / "run"
    jdir.mkdir()
    kd = subprocess.Popen(
        [sys.executable, "-c", KDUMP_STANDIN, str(jdir), str(fake)],
        env=_child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert kd.stdout is not None
    sock, pid = kd.stdout.readline().split()
    mem = tmp_path / "mem"
    mem.write_bytes(_pattern(4))
    journal = jdir / f"kdump-journal-{os.getpid()}-k"
    monkeypatch.setenv(ENV, sock)
    assert announce(journal, 1, {"path": str(mem), "nbytes": NBYTES}) is None
    kd.kill()
    kd.wait()
    deadline = time.monotonic() + 20
    while pid_alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(int(pid))  # it exited (a zombie until whoever adopted it reaps it)
    assert dump_path(journal, 1).read_bytes() == _pattern(4)  # this process still lives
    shutil.rmtree(Path(sock).parent, ignore_errors=True)


def _fake_start(monkeypatch, tmp_path: Path, argv: list[str]) -> list[salvager.Started]:
    started: list[salvager.Started] = []
    real = salvager.start

    def start(journal_dir, base_env, flush_signal=None):
        got = real(journal_dir, base_env, flush_signal, argv=argv)
        if not isinstance(got, str):
            started.append(got)
        return got

    monkeypatch.setattr(salvager, "start", start)
    return started


def _launch(tmp_path: Path, monkeypatch, program: str, *args: str, **opts) -> tuple[int, list]:
    monkeypatch.setenv("KDUMP_JOURNAL_DIR", str(tmp_path / "shm"))
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDINS), KDUMP_ROOT, *old]))
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(program))
    lines: list[str] = []
    options = {"out": str(tmp_path / "out"), "mode": "ring", **opts}
    rc = launcher.launch(
        [sys.executable, str(script), *args], ("plainmod:axpy",), options, echo=lines.append
    )
    return rc, lines


ANNOUNCER = """
import os, sys, time
from pathlib import Path
from kdump.record.flight.announce import ENV, announce
mem = Path(sys.argv[1])
mem.write_bytes(bytes(4096))
journal = Path(os.environ["KDUMP_JOURNAL_DIR"]) / f"kdump-journal-{os.getpid()}-fake"
print("announce:", announce(journal, 0, {"path": str(mem), "nbytes": 4096}), flush=True)
with open(mem, "r+b") as f:
    f.write(bytes((i * 7 + 5) % 256 for i in range(4096)))
"""


def test_launcher_waits_for_the_salvage_process_then_salvages(tmp_path, monkeypatch, capfd):
    fake = tmp_path / "fake_salvager.py"
    fake.write_text(FAKE_SALVAGER)
    _fake_start(monkeypatch, tmp_path, [sys.executable, str(fake), "1.0"])
    seen: list[bytes] = []
    real_salvage = launcher.salvage_run

    def salvage_run(journals, out, context, echo):
        seen.extend(p.read_bytes() for p in journals.glob("*.cuda0"))
        return real_salvage(journals, out, context, echo)

    monkeypatch.setattr(launcher, "salvage_run", salvage_run)
    rc, lines = _launch(tmp_path, monkeypatch, ANNOUNCER, str(tmp_path / "mem"))
    assert rc == 0, lines
    assert "announce: None" in capfd.readouterr().out
    assert seen == [_pattern(5)]  # written (slowly) before kdump salvaged
    assert any("wrote the device tier of 1 memory" in line for line in lines), lines


RECORDER = """
import os, sys, torch
import plainmod
x, y = torch.ones(4), torch.zeros(4)
for _ in range(3):
    plainmod.axpy(2.0, x, y)
print("socket:", os.environ.get("KDUMP_SALVAGER"), flush=True)
sock = os.environ.get("KDUMP_SALVAGER")
if sock:
    print("mode:", oct(os.stat(os.path.dirname(sock)).st_mode & 0o777), flush=True)
    from kdump.record.flight.announce import announce
    print("announce:", announce(os.path.join(os.environ["KDUMP_JOURNAL_DIR"],
          f"kdump-journal-{os.getpid()}-x"), 0, {"kind": "nonsense"}), flush=True)
"""


def _bundles(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "out").rglob("journal-*.kdump"))


def test_stuck_salvage_process_is_killed_and_the_host_tier_still_salvaged(
    tmp_path, monkeypatch, capfd
):
    stuck = tmp_path / "stuck.py"
    stuck.write_text(STUCK_SALVAGER)
    started = _fake_start(monkeypatch, tmp_path, [sys.executable, str(stuck)])
    monkeypatch.setattr(salvager, "END_TIMEOUT", 1.0)
    t0 = time.monotonic()
    rc, lines = _launch(tmp_path, monkeypatch, RECORDER)
    assert rc == 0, lines
    assert time.monotonic() - t0 < 60
    assert any("did not finish in 1 s" in line and "killed it" in line for line in lines), lines
    (held,) = started
    assert held.proc.poll() is not None and not held.folder.exists()
    assert len(_bundles(tmp_path)) == 3  # the host tier, salvaged all the same


def test_real_salvage_process_is_started_private_and_refuses_nonsense(tmp_path, monkeypatch, capfd):
    rc, lines = _launch(tmp_path, monkeypatch, RECORDER)
    out = capfd.readouterr().out
    assert rc == 0, lines
    sock = out.split("socket: ", 1)[1].split("\n", 1)[0]
    assert sock != "None" and not Path(sock).parent.exists()  # removed at the end
    assert "mode: 0o700" in out
    assert "the salvage process refused: cannot import the memory (DeviceShareError" in out
    assert len(_bundles(tmp_path)) == 3


def test_no_salvage_process_option_and_a_salvage_process_that_cannot_start(
    tmp_path, monkeypatch, capfd
):
    rc, lines = _launch(tmp_path, monkeypatch, RECORDER, salvage_process=False)
    assert rc == 0 and "socket: None" in capfd.readouterr().out
    _fake_start(monkeypatch, tmp_path, [sys.executable, "-c", "import sys; sys.exit(3)"])
    rc, lines = _launch(tmp_path, monkeypatch, RECORDER)
    assert rc == 0 and "socket: None" in capfd.readouterr().out
    assert any("did not start (exited with 3)" in line for line in lines), lines
    assert any("host tier only" in line for line in lines)


def test_kdump_salvage_removes_the_device_tier_files_with_the_journal(tmp_path):
    from click.testing import CliRunner

    from kdump.cli.salvage import command
    from kdump.record.flight.journal import Journal

    shm = tmp_path / "shm"
    shm.mkdir()
    pid = os.fork()
    if pid == 0:  # a process that made a journal and died
        try:
            Journal.create(shm, slots=2, slot_bytes=16 << 10)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    (journal,) = shm.glob("kdump-journal-*")
    core = tmp_path / "cuda-coredump.h.1.nvcudmp"
    core.write_bytes(b"core")
    for keep in (True, False):
        for d in (0, 3):
            dump_path(journal, d).write_bytes(b"x" * 16)
        args = [str(shm), "-o", str(tmp_path / "out")] + (["--keep"] if keep else [])
        r = CliRunner().invoke(command, [*args, "--cuda-coredump", str(core)])
        assert r.exit_code == 0, r.output
        assert "cuda" not in r.output.replace(str(core), "")  # no journals of their own
        assert len(protocol.device_files(journal)) == (2 if keep else 0)
    assert not journal.exists()
    (report,) = (tmp_path / "out").glob("journal-*-salvage.json")
    assert json.loads(report.read_text())["crash"]["cuda_coredump"] == str(core)


def test_kdump_salvage_looks_into_run_folders_a_killed_kdump_record_left(tmp_path):
    """`kdump record` killed by SIGKILL leaves its run folder (kdump-run-*) with the journals:
    `kdump salvage` of the journal folder finds them there and removes the emptied run folder."""
    from click.testing import CliRunner

    from kdump.cli.salvage import command
    from kdump.format.journal import RUN_PREFIX
    from kdump.record.flight.journal import Journal

    shm = tmp_path / "shm"
    run = shm / f"{RUN_PREFIX}abc123"
    run.mkdir(parents=True)
    pid = os.fork()
    if pid == 0:  # a recorded process that made a journal and died with its kdump
        try:
            Journal.create(run, slots=2, slot_bytes=16 << 10)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    (journal,) = run.glob("kdump-journal-*")
    r = CliRunner().invoke(command, [str(shm), "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert str(journal) in r.output and not journal.exists() and not run.exists()


def test_env_var_table_and_cli_options():
    from click.testing import CliRunner

    from kdump.cli.record import command

    assert ENV in {v.name for v in config.ENV_VARS}
    r = CliRunner().invoke(command, ["--help"])
    assert "--no-salvage-process" in r.output and "--cuda-coredump" in r.output


def test_coredump_env_and_crash_context(tmp_path):
    env = launcher.coredump_env(tmp_path / "out", {})
    assert env["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1"
    assert env["CUDA_COREDUMP_FILE"].endswith("cuda-coredump.%h.%p.nvcudmp")
    assert env["CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION"] == "0"
    assert "CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION" not in launcher.coredump_env(
        tmp_path / "out", {"CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION": "1"}
    )
    core = tmp_path / "out" / "cuda-coredump.node.a.b.4242.nvcudmp"
    core.write_bytes(b"x")
    found = launcher.coredumps(tmp_path / "out", time.time() - 5)
    assert found == {4242: core}
    ctx = launcher.crash_context(134, b"boom", found)
    assert ctx["cuda_coredumps"] == {"4242": str(core)} and ctx["signal_name"] == "SIGABRT"


def _valid_doc() -> dict:
    return {
        "kind": devshare.KIND,
        "version": devshare.VERSION,
        "device": 0,
        "device_uuid": "GPU-0000",
        "handle": "ab" * 64,
        "storage_nbytes": 1 << 20,
        "storage_offset": 0,
        "ref_counter_handle": "2f746f726368",
        "ref_counter_offset": 0,
        "event_handle": "",
        "event_sync_required": False,
        "offset": 512,
        "nbytes": 1024,
    }


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "file"},
        {"version": 2},
        {"device": -1},
        {"device": True},
        {"device": 4096},
        {"handle": "AB"},
        {"handle": "abc"},
        {"handle": ""},
        {"handle": "ab" * 9000},
        {"nbytes": 0},
        {"nbytes": 1.5},
        {"offset": (1 << 20) - 100},
        {"event_sync_required": 1},
        {"device_uuid": 3},
        {"extra": 1},
    ],
)
def test_devshare_validation_refuses_each_bad_field(change):
    assert devshare.validate(_valid_doc()) == _valid_doc()
    with pytest.raises(devshare.DeviceShareError):
        devshare.validate({**_valid_doc(), **change})
    with pytest.raises(devshare.DeviceShareError):
        devshare.validate([_valid_doc()])


def test_devshare_export_refuses_what_it_cannot_share():
    with pytest.raises(devshare.DeviceShareError):
        devshare.export_cuda(torch.zeros(4))


# -- on a GPU ---------------------------------------------------------------------------------

GPU_OWNER = """
import ctypes, os, sys, time
import torch
from kdump.record.flight.devshare import export_cuda
from kdump.record.flight.announce import announce
journal, mode = sys.argv[1], sys.argv[2]
buf = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
free0 = torch.cuda.mem_get_info()[0]
print("announce:", announce(journal, 0, export_cuda(buf[4096:])), flush=True)
# the salvage process created its CUDA context for this import: what it costs the device
print("context bytes:", free0 - torch.cuda.mem_get_info()[0], flush=True)
g = torch.Generator(device="cuda").manual_seed(5)
buf.copy_(torch.randint(0, 256, (1 << 20,), generator=g, device="cuda", dtype=torch.uint8))
torch.cuda.synchronize()
print("filled", flush=True)
if mode == "illegal":
    from cuda.bindings import driver
    from cuda.core import Program, ProgramOptions

    def ok(result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        return rest[0] if rest else None

    cc = torch.cuda.get_device_capability()
    src = 'extern "C" __global__ void poke(int* p) { *p = 1; }'
    cubin = Program(src, "c++", ProgramOptions(arch=f"sm_{cc[0]}{cc[1]}")).compile("cubin")
    ok(driver.cuInit(0))
    if not int(ok(driver.cuCtxGetCurrent())):  # load into torch's primary context
        ctx = ok(driver.cuDevicePrimaryCtxRetain(ok(driver.cuDeviceGet(0))))
        ok(driver.cuCtxSetCurrent(ctx))
    mod = ok(driver.cuModuleLoadData(bytes(cubin.code)))
    fn = ok(driver.cuModuleGetFunction(mod, b"poke"))
    ptr = ctypes.c_void_p(8)
    args = (ctypes.c_void_p * 1)(ctypes.addressof(ptr))
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    ok(driver.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, ctypes.addressof(args), 0))
    try:
        torch.cuda.synchronize()
    except Exception as exc:
        print("sticky:", type(exc).__name__, str(exc).splitlines()[0], flush=True)
    try:  # the owner itself can no longer read its buffer
        buf[:8].cpu()
        print("owner read: ok", flush=True)
    except Exception:
        print("owner read: failed", flush=True)
    sys.exit(1)
time.sleep(120)
"""


def _process_gpu_bytes(pid: int) -> int | None:
    """GPU memory process `pid` holds, as nvidia-smi lists it (None: no answer)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) << 20
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["illegal", "sigkill"])
def test_device_tier_survives_its_owner(tmp_path, mode):
    """A recorded process announces a CUDA buffer, fills it, then hits an illegal address or is
    SIGKILLed: the salvage process's .cuda0 file holds the filled bytes bitwise."""
    jdir = tmp_path / "run"
    jdir.mkdir()
    got = salvager.start(jdir, _child_env())
    assert not isinstance(got, str), got
    try:
        journal = jdir / "kdump-journal-1-gpu"
        proc = subprocess.Popen(
            [sys.executable, "-c", GPU_OWNER, str(journal), mode],
            env=_child_env(**{ENV: str(got.socket_path)}),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline() == "announce: None\n"
        # the drop of the device's free memory across the import, unless nvidia-smi can say what
        # the salvage process itself holds (other processes of a parallel run move free memory)
        free_drop = int(proc.stdout.readline().split(":")[1])
        context_bytes = _process_gpu_bytes(got.proc.pid) or free_drop
        print(f"\nkdump: salvage process CUDA context: {context_bytes / 2**20:.0f} MiB")
        assert proc.stdout.readline() == "filled\n"
        if mode == "sigkill":
            proc.send_signal(signal.SIGKILL)
        rest = proc.communicate(timeout=120)[0]
        if mode == "illegal":
            assert "sticky:" in rest and proc.returncode != 0, rest
        dest = dump_path(journal, 0)
        deadline = time.monotonic() + 30
        while not dest.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        g = torch.Generator(device="cuda").manual_seed(5)
        want = torch.randint(0, 256, (1 << 20,), generator=g, device="cuda", dtype=torch.uint8)
        assert dest.read_bytes() == want[4096:].cpu().numpy().tobytes()
        assert context_bytes < 2 << 30
    finally:
        done = salvager.finish(got)
    assert done.problem is None and done.written == (str(dest),)  # at the owner's death
