"""Sanitizer replay: the eager replay (or the graph chain) under compute-sanitizer.

The caching allocator is off and every storage ends flush with its own allocation (no alignment
slack, no halo: slack would hide near out-of-bounds accesses), API-error noise is not reported,
torch's own kernels are excluded, and the text report is parsed into findings whose addresses are
mapped back to the argument and element they fall in or near.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kdump.bundle.tensors import StorageRecord, TensorRecord, locate_address
from kdump.errors import CannotRunError
from kdump.replay.isolate import (
    child_environment,
    read_events,
    run_group,
    verdict_from_events,
    worker_command,
)
from kdump.replay.session import Request
from kdump.replay.verdict import Finding, Step, Verdict
from kdump.tools import find_tool, tool_version

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
SANITIZER_EXIT = 86  # --error-exitcode: tells "errors found" apart from the program's own codes

_PREFIX = re.compile(r"^=+ ?")
_SUMMARY = re.compile(r"^=+ (?:ERROR|RACECHECK) SUMMARY: ([\d,.]+) (?:errors?|hazards?)", re.M)
_HEADER = re.compile(
    r"^(Invalid (?P<space>__\w+__|\w+) (?P<access>read|write|atomic) of size (?P<size>\d+) bytes?"
    r"|Uninitialized (?P<ispace>__\w+__) memory read of size (?P<isize>\d+) bytes?"
    r"|(?:Warp|Lane|Device) [\w -]+"
    r"|Misaligned .*|Out-of-range .*|Malloc/Free error .*|Barrier error .*"
    r"|(?:Error|Warning): Race reported .*|Race reported .*|Invalid .*)$"
)
_AT = re.compile(
    r"^at (?P<kernel>.+?)\+0x(?P<pc>[0-9a-fA-F]+)(?: in (?P<file>.+?):(?P<line>\d+))?$"
)
_THREAD = re.compile(r"by thread \((?P<t>\d+,\d+,\d+)\) in block \((?P<b>\d+,\d+,\d+)\)")
_ADDRESS = re.compile(r"^(?:Address|Access to) (?P<addr>0x[0-9a-fA-F]+) (?P<what>.*)$")
_NEAREST = re.compile(
    r"and is (?P<dist>[\d,]+) bytes (?P<dir>after|before) the nearest allocation at "
    r"(?P<alloc>0x[0-9a-fA-F]+) of size (?P<asize>[\d,]+) bytes"
)


@dataclass
class SanitizerRecord:
    """One error in a compute-sanitizer report."""

    tool: str
    kind: str  # the report's first line, e.g. "Invalid __global__ write of size 4 bytes"
    access: str = ""
    size: int = 0
    kernel: str = ""
    pc: str = ""
    source: str = ""
    thread: str = ""
    block: str = ""
    address: int | None = None
    address_note: str = ""
    nearest: dict[str, Any] = field(default_factory=dict)
    argument: str = ""  # filled by map_addresses

    def describe(self) -> str:
        where = f" in {self.kernel}" if self.kernel else ""
        src = f" ({self.source})" if self.source else ""
        tb = f", thread ({self.thread}) block ({self.block})" if self.thread else ""
        addr = f" at {self.address:#x}" if self.address is not None else ""
        arg = f" → {self.argument}" if self.argument else ""
        return f"{self.kind}{where}{src}{tb}{addr}{arg}"


@dataclass
class SanitizerReport:
    tool: str
    errors: int | None  # from the summary line; None when there was none (e.g. the tool died)
    records: list[SanitizerRecord]


def parse_report(text: str, tool: str = "memcheck") -> SanitizerReport:
    """Parse compute-sanitizer's text report (its --log-file)."""
    records: list[SanitizerRecord] = []
    cur: SanitizerRecord | None = None
    for raw in text.splitlines():
        if not raw.startswith("="):
            continue
        line = _PREFIX.sub("", raw).strip()
        if not line:
            cur = None
            continue
        if line.startswith(("ERROR SUMMARY", "RACECHECK SUMMARY", "COMPUTE-SANITIZER", "LEAK")):
            cur = None
            continue
        m = _HEADER.match(line)
        if m and not line.startswith(("Saved host backtrace", "Host Frame")):
            cur = SanitizerRecord(tool=tool, kind=line)
            if m.group("access"):
                cur.access = m.group("access")
                cur.size = int(m.group("size"))
            elif m.group("isize"):
                cur.access = "read"
                cur.size = int(m.group("isize"))
            records.append(cur)
            continue
        if cur is None:
            continue
        if (m := _AT.match(line)) and not cur.kernel:
            cur.kernel = m.group("kernel")
            cur.pc = "0x" + m.group("pc")
            if m.group("file"):
                cur.source = f"{m.group('file')}:{m.group('line')}"
        elif m := _THREAD.search(line):
            cur.thread, cur.block = m.group("t"), m.group("b")
        elif m := _ADDRESS.match(line):
            cur.address = int(m.group("addr"), 16)
            cur.address_note = m.group("what")
        elif m := _NEAREST.search(line):
            cur.nearest = {
                "distance": int(m.group("dist").replace(",", "")),
                "direction": m.group("dir"),
                "allocation": int(m.group("alloc"), 16),
                "allocation_size": int(m.group("asize").replace(",", "")),
            }
    summary = _SUMMARY.findall(text)
    errors = int(re.sub(r"[,.]", "", summary[-1])) if summary else None
    return SanitizerReport(tool, errors, records)


@dataclass(frozen=True)
class PlacedTensor:
    """Where a replayed argument lived in the sanitizer run."""

    name: str
    data_ptr: int
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def locate(addr: int, tensors: list[PlacedTensor]) -> str:
    """'d[4097, 12]' or '16 bytes past the end of d' for the nearest argument."""
    storages = [StorageRecord("cuda", t.data_ptr, 0, 0, 0) for t in tensors]
    records = [
        TensorRecord(i, _DTYPE_BY_SIZE[t.itemsize], t.shape, t.stride, 0, data_ptr=t.data_ptr)
        for i, t in enumerate(tensors)
    ]
    found = locate_address(addr, storages, records, [t.name for t in tensors])
    return found or "no argument nearby"


# locate_address needs only the element size of a placed tensor, not its real dtype.
_DTYPE_BY_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def find_sanitizer(explicit: str | None = None) -> Path:
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise CannotRunError(f"compute-sanitizer not found at {explicit}")
        return p
    found = find_tool("compute-sanitizer")
    if found is None:
        raise CannotRunError(
            "compute-sanitizer not found (looked in KDUMP_SANITIZER, CUDA_HOME, PATH, "
            "/usr/local/cuda and pip's nvidia wheels); install the CUDA toolkit or "
            "nvidia-cuda-sanitizer-api, or pass --sanitizer PATH"
        )
    return found


def run_sanitizer(
    req: Request,
    tool: str,
    sanitizer: Path,
    timeout: float | None,
    kernel_filter: str | None,
    base_env: dict[str, str] | None = None,
) -> Verdict:
    """Run one eager (or graph, `req.mode`) replay under `tool`; findings are exit 4."""
    child_req = replace(
        req,
        repeat=1,
        options={**req.options, "placement": "flush_end", "halo": 0, "reference": False},
    )
    with tempfile.TemporaryDirectory(prefix="kdump-sanitizer-") as tmp:
        req_path, result_path = Path(tmp, "request.json"), Path(tmp, "result.json")
        progress_path, log_path = Path(tmp, "progress"), Path(tmp, "sanitizer.log")
        req_path.write_text(json.dumps(asdict(child_req)))
        cmd = [
            str(sanitizer),
            "--tool",
            tool,
            "--error-exitcode",
            str(SANITIZER_EXIT),
            "--report-api-errors",
            "no",
            "--print-limit",
            "200",
            "--log-file",
            str(log_path),
            "--target-processes",
            "application-only",
        ]
        if kernel_filter:
            cmd += ["--kernel-name", f"kns={kernel_filter}"]
        else:
            cmd += ["--kernel-name-exclude", "kns=at::native"]  # torch's own kernels
        cmd += worker_command(req_path, result_path, progress_path)
        env = child_environment(
            base_env,
            PYTORCH_NO_CUDA_MEMORY_CACHING="1",
            DG_USE_TEMP_CUBLASLT_WORKSPACE="1",
            DG_JIT_WITH_LINEINFO="1",
        )
        rc, stderr = run_group(cmd, env, timeout)
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        keep = req.options.get("sanitizer_log_dir")
        if keep and log:
            Path(keep).mkdir(parents=True, exist_ok=True)
            name = f"{Path(req.bundle).stem}-call{req.call}-{req.mode}-{tool}.log"
            Path(keep, name).write_text(log)
        events = read_events(progress_path)
        if result_path.exists():
            v = Verdict.from_json(json.loads(result_path.read_text()))
        else:
            v = verdict_from_events(req, events)
        placed = next((e["placed"] for e in events if "placed" in e), [])
        tensors = [
            PlacedTensor(
                p["name"], p["data_ptr"], p["itemsize"], tuple(p["shape"]), tuple(p["stride"])
            )
            for p in placed
        ]
    v.mode = f"sanitizer/{tool}"
    if rc is None:
        v.findings.append(Finding("hang", f"sanitizer/{tool}", f"no result after {timeout:g} s"))
        return v
    if "refused" in stderr.lower() or ("not supported" in stderr.lower() and not log):
        raise CannotRunError(f"compute-sanitizer cannot run here: {stderr.strip()[:200]}")
    report = parse_report(log, tool)
    for r in report.records:
        if r.address is not None:
            r.argument = locate(r.address, tensors)
    version = tool_version(sanitizer)
    status = "ok" if not report.records and rc != SANITIZER_EXIT else "fail"
    summary = (
        f"{report.errors if report.errors is not None else len(report.records)} error(s) "
        f"(compute-sanitizer {version or '?'})"
    )
    v.steps.append(
        Step(
            f"sanitizer/{tool}",
            status,
            summary,
            0.0,
            {"errors": report.errors, "records": len(report.records)},
        )
    )
    for r in report.records[:20]:
        v.findings.append(Finding("memory", f"sanitizer/{tool}", r.describe(), asdict(r)))
    if status == "fail" and not report.records:
        v.findings.append(
            Finding(
                "memory",
                f"sanitizer/{tool}",
                f"compute-sanitizer reported errors the parser did not read: "
                f"{log.strip().splitlines()[-1] if log.strip() else stderr[-200:]}",
            )
        )
    if tool == "memcheck":
        v.notes.append(
            "memcheck does not see TMA loads past an allocation on older drivers "
            "(compute-sanitizer before 2026.2): the halo pass of eager/graph mode covers those"
        )
    return v
