"""The announce protocol between a recorded process and the salvage process of `kdump record`.

Both sides import this module and nothing of each other: the recorded process' device tier
(kdump.record.flight.devring) announces its memory here (`announce`); the salvage process
(kdump.record.flight.salvager) serves the requests, and when the announcer dies writes each
import to `<journal>.cuda<device>` (`dump_path`), which salvage (kdump.record.flight.salvage)
reads back.

Protocol: over a Unix socket in a private folder (mode 0700) named by the environment variable
`ENV`, one request per connection, each message a 4-byte big-endian length and a JSON object (at
most MAX_FRAME bytes); nothing in a request is evaluated. Who announces comes from the socket's
peer credentials, not the request.

    {"op": "announce", "journal": PATH, "device": N, "doc": {...}} -> {"ok": true}
                                                            or {"ok": false, "reason": "..."}
    {"op": "status"} -> {"ok": true, "held": [...], "written": [...], "failed": [...]}
    {"op": "ended"}  -> writes every import, then {"ok": true, "written": [...], "failed": [...]}
                        and the process exits
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kdump import config
from kdump.errors import UsageError

ENV = "KDUMP_SALVAGER"  # the salvage process' socket, set by `kdump record` for the program
MAX_FRAME = 64 << 10  # a description is well under 2 KiB; replies list paths
IO_TIMEOUT = 5.0  # one request's reads and writes on the server side
ANNOUNCE_TIMEOUT = 5.0  # all of announce(), CUDA start-up of the salvage process included
DUMP_SUFFIX = ".cuda"  # <journal>.cuda<N>: the device tier of device N
_DUMP_FILE = re.compile(r"\.cuda\d+\Z")
_LEN = struct.Struct(">I")


class ProtocolError(UsageError):
    """A message on the salvage socket that is malformed, too big, or not answered in time."""


class ProtocolTimeout(ProtocolError):
    """No complete message within the time allowed."""


# -- where the salvage process writes a device tier -------------------------------------------


def dump_path(journal: str | os.PathLike[str], device: int) -> Path:
    """Where the device tier of `journal` on device `device` is written."""
    p = Path(journal)
    return p.with_name(f"{p.name}{DUMP_SUFFIX}{int(device)}")


def dump_paths(journal: str | os.PathLike[str]) -> dict[int, Path]:
    """The device-tier dumps next to a journal, by device index."""
    p = Path(journal)
    found: dict[int, Path] = {}
    for f in p.parent.glob(f"{p.name}{DUMP_SUFFIX}*"):
        tail = f.name[len(p.name) + len(DUMP_SUFFIX) :]
        if tail.isdigit():
            found[int(tail)] = f
    return found


def device_files(journal: str | os.PathLike[str]) -> list[Path]:
    """The device-tier files written for `journal`, any device, in name order."""
    return sorted(dump_paths(journal).values())


def is_device_file(path: str | os.PathLike[str]) -> bool:
    return bool(_DUMP_FILE.search(Path(path).name))


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie its parent has not reaped counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:  # a killed child its parent has not reaped yet is a zombie: dead for our purpose
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


# -- framing ------------------------------------------------------------------------------------


def send_message(sock: socket.socket, obj: Mapping[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ProtocolError(f"message of {len(data)} bytes is over the {MAX_FRAME}-byte limit")
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolTimeout("no complete message in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise ProtocolTimeout("no complete message in time") from None
        if not chunk:
            raise ProtocolError("the other side closed the connection mid-message")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket, timeout: float | None = None) -> dict[str, Any]:
    """One message: a JSON object of at most MAX_FRAME bytes, read within `timeout` s
    (default IO_TIMEOUT)."""
    deadline = time.monotonic() + (IO_TIMEOUT if timeout is None else timeout)
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > MAX_FRAME:
        raise ProtocolError(f"message of {n} bytes is over the {MAX_FRAME}-byte limit")
    raw = _recv_exact(sock, n, deadline)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("message is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message is a JSON {type(obj).__name__}, not an object")
    return obj


def request(socket_path: str | os.PathLike[str], obj: Mapping[str, Any], timeout: float) -> dict:
    """Send one request, wait for its reply; ProtocolError / OSError when that fails."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(os.fspath(socket_path))
        send_message(s, obj)
        return recv_message(s, max(0.0, deadline - time.monotonic()))


# -- the recorded process' side -----------------------------------------------------------------


def announce(journal_path: Path, device_index: int, doc: dict[str, Any]) -> str | None:
    """Hand the device-tier memory `doc` (devshare.export_cuda) of this process' journal to the
    salvage process. None when it now holds an import, else why the device tier is not held.
    Takes at most ANNOUNCE_TIMEOUT s and never raises."""
    try:
        path = config.get(ENV)
        if not path:
            return f"not running under `kdump record` with its salvage process ({ENV} is not set)"
        req = {"op": "announce", "journal": str(journal_path), "device": device_index, "doc": doc}
        try:
            reply = request(path, req, ANNOUNCE_TIMEOUT)
        except (TimeoutError, ProtocolTimeout):
            return f"the salvage process did not answer in {ANNOUNCE_TIMEOUT:g} s"
        except ProtocolError as exc:
            return f"the salvage process answered badly ({exc})"
        except OSError as exc:
            return f"cannot reach the salvage process ({exc.strerror or exc})"
        if reply.get("ok") is True:
            return None
        reason = reply.get("reason")
        return f"the salvage process refused: {reason if isinstance(reason, str) else reply}"
    except Exception as exc:  # recording must never break the program
        return f"announcing to the salvage process failed ({type(exc).__name__}: {exc})"
