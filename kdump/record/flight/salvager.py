"""The salvage process of `kdump record`: it holds the flight recorder's device tier.

After an illegal-address error a process cannot read its own GPU memory, and a tree kill leaves
it no time to: but a *sibling* process that imported that memory through CUDA IPC still can,
also after the owner was SIGKILLed. So `kdump record` starts this process (a child of kdump, in
its own session, not of the recorded program: a tree kill of the program does not reach it)
before the program. Each recorded process announces its device-tier memory right after it
allocated it (`announce`); this process imports it (kdump.record.flight.devshare) and keeps it.
When the process dies (noticed through a pidfd, or by polling where there is none), or when kdump
says that the program ended, it writes each import to `<journal>.cuda<device>` (raw bytes,
atomically), then releases it. The recorder's salvage reads those files; what lies inside them is
the recorder's business.

The requests and replies, their framing and the files written are the announce protocol
(kdump.record.flight.announce), which the recorded side imports too. CUDA is initialised only at
the first announcement: a program that never uses CUDA costs one idle process (torch is imported
in the background at start, host memory only, so that the first announcement is answered in
time).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdump.format.journal import FILE_PREFIX
from kdump.record.flight.announce import (
    ENV,
    IO_TIMEOUT,
    ProtocolError,
    dump_path,
    is_device_file,
    pid_alive,
    recv_message,
    request,
    send_message,
)

START_TIMEOUT = 20.0  # until the salvage process listens
END_TIMEOUT = 60.0  # writing every import at the program's end
FOLDER_PREFIX = "kdump-salvager-"  # the socket's private folder
WATCH_PERIOD = 0.1
MAX_HANDLERS = 32  # concurrent requests; more are refused at once
MAX_DEVICE = 1023
IGNORED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
SOCKET_NAME = "salvager.sock"
_PEERCRED = struct.Struct("3i")


# -- the salvage process --------------------------------------------------------------------


Importer = Callable[[dict[str, Any]], Any]


@dataclass
class Holding:
    pid: int
    journal: Path
    device: int
    memory: Any  # what the importer returned: a 1-D uint8 tensor
    nbytes: int


@dataclass
class _Watched:
    pidfd: int | None
    holdings: list[Holding] = field(default_factory=list)


def _default_importer(doc: dict[str, Any]) -> Any:
    from kdump.record.flight.devshare import import_cuda

    return import_cuda(doc)


def _write_memory(memory: Any, dest: Path) -> None:
    """The imported bytes to `dest`, atomically (readers see no file or the whole one)."""
    from kdump.bundle.store import atomic_write

    host = memory.detach().to("cpu").contiguous()
    atomic_write(dest, memoryview(host.numpy()).cast("B"))


class Salvager:
    """The server: imports announced memory, writes it out when its process dies."""

    def __init__(
        self,
        socket_path: Path,
        journal_dir: Path,
        parent: int | None = None,
        importer: Importer = _default_importer,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.journal_dir = Path(journal_dir).resolve()
        self.parent = parent
        self.importer = importer
        self.lock = threading.RLock()  # the holdings
        self.write_lock = threading.RLock()  # held from taking a process' holdings to written
        self.watched: dict[int, _Watched] = {}
        self.written: list[str] = []
        self.failed: list[str] = []
        self.stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_HANDLERS)
        self.listener: socket.socket | None = None

    # serving

    def listen(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        s.listen(64)
        s.settimeout(WATCH_PERIOD)
        self.listener = s

    def serve(self) -> None:
        """Accept requests until told to end or the parent dies; the watcher runs alongside."""
        assert self.listener is not None
        watcher = threading.Thread(target=self._watch, name="kdump-salvager-watch", daemon=True)
        watcher.start()
        try:
            while not self.stop.is_set():
                try:
                    conn, _ = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self.stop.is_set():
                        break
                    raise
                if not self._slots.acquire(blocking=False):
                    conn.close()  # too many at once: the announcer reports it
                    continue
                threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()
        finally:
            self.listener.close()
            watcher.join(timeout=5)

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            with conn:
                pid, uid, _ = _PEERCRED.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                )
                try:
                    if uid != os.getuid():
                        raise ProtocolError("requests come from the recorded program's user only")
                    req = recv_message(conn)
                    reply = self.handle(req, pid)
                except ProtocolError as exc:
                    reply = {"ok": False, "reason": str(exc)}
                with contextlib.suppress(OSError, ProtocolError):
                    conn.settimeout(IO_TIMEOUT)
                    send_message(conn, reply)
                if reply.get("ended"):
                    self.stop.set()
        except OSError:
            pass  # the requester went away: nothing to answer
        finally:
            self._slots.release()

    def handle(self, req: dict[str, Any], pid: int) -> dict[str, Any]:
        """The reply to request `req` of process `pid` (ProtocolError on a malformed one)."""
        op = req.get("op")
        if op == "announce":
            return self._announce(req, pid)
        if op not in ("status", "ended"):
            raise ProtocolError(f"unknown request {str(op)[:40]!r}")
        if set(req) != {"op"}:
            raise ProtocolError(f"request {op!r} takes no fields")
        if op == "status":
            with self.lock:
                held = [
                    {
                        "pid": h.pid,
                        "journal": str(h.journal),
                        "device": h.device,
                        "nbytes": h.nbytes,
                    }
                    for w in self.watched.values()
                    for h in w.holdings
                ]
                return {"ok": True, "held": held, "written": self.written, "failed": self.failed}
        self.write_all()  # "ended"
        with self.lock:
            return {"ok": True, "ended": True, "written": self.written, "failed": self.failed}

    def _journal(self, value: Any) -> Path:
        if not isinstance(value, str) or not 0 < len(value) <= 4096 or "\0" in value:
            raise ProtocolError("journal must be a path")
        p = Path(value)
        name = p.name
        if (
            not p.is_absolute()
            or not name.startswith(FILE_PREFIX)
            or name.endswith(".tmp")
            or is_device_file(name)
            or len(name) > 200
            or p.parent.resolve() != self.journal_dir
        ):
            raise ProtocolError(f"journal {value!r} is not a journal of this run's folder")
        return self.journal_dir / name

    def _announce(self, req: dict[str, Any], pid: int) -> dict[str, Any]:
        if set(req) != {"op", "journal", "device", "doc"}:
            raise ProtocolError("announce takes exactly journal, device and doc")
        journal = self._journal(req["journal"])
        device = req["device"]
        if type(device) is not int or not 0 <= device <= MAX_DEVICE:
            raise ProtocolError("device must be a device index")
        doc = req["doc"]
        if not isinstance(doc, dict):
            raise ProtocolError("doc must be an object")
        if pid <= 0 or not pid_alive(pid):
            raise ProtocolError("the announcing process is gone")
        try:
            memory = self.importer(doc)
            nbytes = int(memory.numel())
        except Exception as exc:  # any import failure is the announcer's reason
            return {
                "ok": False,
                "reason": f"cannot import the memory ({type(exc).__name__}: {exc})",
            }
        holding = Holding(pid, journal, device, memory, nbytes)
        with self.lock:
            w = self.watched.get(pid)
            if w is None:
                w = self.watched[pid] = _Watched(_pidfd(pid))
            # a newer announcement of the same journal and device replaces the older import
            w.holdings = [h for h in w.holdings if (h.journal, h.device) != (journal, device)]
            w.holdings.append(holding)
        return {"ok": True}

    # writing

    def write_pid(self, pid: int) -> None:
        """Write and release every import of process `pid`. Announcements of other processes go
        on meanwhile; `write_all` waits for a write in progress."""
        with self.write_lock:
            with self.lock:
                w = self.watched.pop(pid, None)
            if w is None:
                return
            if w.pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(w.pidfd)
            for h in w.holdings:
                dest = dump_path(h.journal, h.device)
                try:
                    _write_memory(h.memory, dest)
                    with self.lock:
                        self.written.append(str(dest))
                except Exception as exc:
                    with self.lock:
                        self.failed.append(f"{dest}: {type(exc).__name__}: {exc}")
                    _say(f"cannot write {dest} ({type(exc).__name__}: {exc})")
                h.memory = None  # releases the import
            w.holdings.clear()

    def write_all(self) -> None:
        with self.write_lock:
            with self.lock:
                pids = list(self.watched)
            for pid in pids:
                self.write_pid(pid)

    def _watch(self) -> None:
        """Write a process' imports as soon as it dies; everything when kdump itself died."""
        while not self.stop.is_set():
            with self.lock:
                fds = {w.pidfd: pid for pid, w in self.watched.items() if w.pidfd is not None}
                polled = [pid for pid, w in self.watched.items() if w.pidfd is None]
            dead: list[int] = []
            if fds:
                try:
                    ready, _, _ = select.select(list(fds), [], [], WATCH_PERIOD)
                except (OSError, ValueError):
                    ready = []
                dead += [fds[fd] for fd in ready]
            else:
                self.stop.wait(WATCH_PERIOD)
            dead += [pid for pid in polled if not pid_alive(pid)]
            for pid in dead:
                self.write_pid(pid)
            if self.parent is not None and os.getppid() != self.parent:
                self.write_all()  # the journals stay for `kdump salvage`, with these files
                self.stop.set()


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined]  # Linux 5.3+
    except (AttributeError, OSError):
        return None  # poll instead


def _say(line: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"kdump: salvage process: {line}\n")
        sys.stderr.flush()


def main(argv: list[str] | None = None, importer: Importer = _default_importer) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdump.record.flight.salvager", description=__doc__)
    ap.add_argument("--socket", required=True, type=Path)
    ap.add_argument("--journal-dir", required=True, type=Path)
    ap.add_argument("--parent", type=int, help="exit (after writing) when this process is gone")
    ap.add_argument("--ignore-signal", type=int, action="append", default=[])
    args = ap.parse_args(argv)
    # signals meant for the program (Ctrl-C, the flush signal, a group kill) must not end us
    for name in IGNORED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    for num in args.ignore_signal:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(num, signal.SIG_IGN)
    server = Salvager(args.socket, args.journal_dir, args.parent, importer)
    server.listen()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    # torch takes seconds to import on a busy host: have it ready before the first announcement,
    # which must be answered within ANNOUNCE_TIMEOUT (importing it starts no CUDA)
    threading.Thread(target=_preimport, name="kdump-salvager-import", daemon=True).start()
    try:
        server.serve()
    finally:
        _remove_own_folder(args.socket)
    return 0


def _remove_own_folder(sock: Path) -> None:
    """Remove the socket and its private folder: when kdump was SIGKILLed, nobody else will
    (kdump's `finish` removes them too, when it lives)."""
    with contextlib.suppress(OSError):
        sock.unlink()
    folder = sock.parent
    if folder.name.startswith(FOLDER_PREFIX):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only empty: never anything else's


def _preimport() -> None:
    with contextlib.suppress(Exception):
        import torch  # noqa: F401


# -- kdump record's side --------------------------------------------------------------------


@dataclass
class Started:
    """A running salvage process, as the launcher holds it."""

    proc: subprocess.Popen[bytes]
    folder: Path
    socket_path: Path


def _kdump_pythonpath(env: Mapping[str, str]) -> str:
    root = str(Path(__file__).resolve().parents[3])  # the folder holding the kdump package
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([root, *old])


def start(
    journal_dir: Path,
    base_env: Mapping[str, str],
    flush_signal: int | None = None,
    argv: list[str] | None = None,
) -> Started | str:
    """Start the salvage process and wait until it listens: its handle, or why it did not start.
    `argv` replaces `python -m kdump.record.flight.salvager` (tests give one with a fake
    importer)."""
    tmp = tempfile.gettempdir()
    if len(os.path.join(tmp, "kdump-salvager-XXXXXXXX", SOCKET_NAME)) > 100:
        tmp = "/tmp"  # a Unix socket path has a 108-byte limit
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=tmp))  # mode 0700
    sock = folder / SOCKET_NAME
    env = {k: v for k, v in base_env.items() if k not in ("KDUMP_RECORD", ENV)}
    env["PYTHONPATH"] = _kdump_pythonpath(base_env)
    cmd = list(argv or [sys.executable, "-m", "kdump.record.flight.salvager"])
    cmd += ["--socket", str(sock), "--journal-dir", str(journal_dir), "--parent", str(os.getpid())]
    if flush_signal:
        cmd += ["--ignore-signal", str(flush_signal)]
    try:
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True
        )
    except OSError as exc:
        _remove(folder)
        return f"cannot start the salvage process ({exc})"
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        _kill(proc)
        _remove(folder)
        why = f"exited with {proc.returncode}" if ready else f"not ready in {START_TIMEOUT:g} s"
        return f"the salvage process did not start ({why})"
    proc.stdout.close()
    return Started(proc, folder, sock)


@dataclass(frozen=True)
class Finished:
    written: tuple[str, ...]
    failed: tuple[str, ...]
    problem: str | None  # why the salvage process did not finish cleanly


def finish(started: Started, timeout: float | None = None) -> Finished:
    """Tell the salvage process that the program ended, wait (at most `timeout` s, default
    END_TIMEOUT) until it wrote every import, then make sure it is gone (killed when stuck) and
    remove its folder."""
    timeout = END_TIMEOUT if timeout is None else timeout
    written: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    problem = None
    try:
        if started.proc.poll() is not None:
            problem = f"the salvage process had died (exit {started.proc.returncode})"
        else:
            reply = request(started.socket_path, {"op": "ended"}, timeout)
            written = tuple(str(p) for p in reply.get("written", []) if isinstance(p, str))
            failed = tuple(str(p) for p in reply.get("failed", []) if isinstance(p, str))
            if reply.get("ok") is not True:
                problem = f"the salvage process answered {reply.get('reason')!r}"
    except (OSError, ProtocolError) as exc:
        problem = f"the salvage process did not finish in {timeout:g} s ({exc})"
    try:
        started.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill(started.proc)
        problem = (problem or "the salvage process did not exit") + "; killed it"
    _remove(started.folder)
    return Finished(written, failed, problem)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _remove(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
