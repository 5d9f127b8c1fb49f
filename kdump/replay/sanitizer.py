"""Sanitizer replay: the eager replay (or the graph chain) under compute-sanitizer.

The caching allocator is off and every storage ends flush with its own allocation (no alignment
slack, no halo: slack would hide near out-of-bounds accesses), API-error noise is not reported,
torch's own kernels are excluded, and the text report is parsed into findings whose addresses are
mapped back to the argument and element they fall in or near.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kdump.cuda.tools import find_tool, tool_version
from kdump.errors import CannotRunError, FindingKind
from kdump.replay.addresses import PlacedTensor, locate_access
from kdump.replay.child import child_environment, judge, launch
from kdump.replay.options import TOOLS as TOOLS
from kdump.replay.session import Request
from kdump.replay.verdict import Finding, Step, Verdict

MAX_FINDINGS = 20  # findings per tool and replay; the rest are counted
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
# racecheck: "Error: Race reported between Write access at K+0x90 in f.cu:10:K(int *)" (and its
# "and Read access at ... [248 hazards]" continuation), or, with --racecheck-report hazard,
# "ERROR: Potential WAR hazard detected at __shared__ 0x0 in block (0,0,0) :".
_RACE = re.compile(
    r"^(?:(?:Error|Warning|ERROR|WARNING): )?(?:Race reported between (?P<first>\w+) access"
    r"|Potential (?P<hazard>\w+) hazard detected at (?P<space>__\w+__) (?P<addr>0x[0-9a-fA-F]+)"
    r"(?: in block \((?P<block>\d+,\d+,\d+)\))?)"
)
_RACE_AT = re.compile(
    r"(?:at (?:(?P<kernel>.+?)\+)?0x(?P<pc>[0-9a-fA-F]+))?"
    r"(?: in (?P<file>[^\s:]+):(?P<line>\d+)(?::(?P<func>[^\[]+?))?)?\s*(?:\[|$)"
)
_RACE_AND = re.compile(r"^and (?P<second>\w+) access.*?(?:\[(?P<count>[\d,]+) hazards?\])?$")
_FRAME = re.compile(r"^Device Frame: ?(?P<kernel>.+?)(?:\+0x[0-9a-fA-F]+)?(?: in \S+:\d+)?$")
_RACE_THREAD = re.compile(r"^(?P<access>Read|Write) Thread \((?P<t>\d+,\d+,\d+)\) at")
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
    kernel: str = ""  # the launched kernel (the outermost device frame)
    function: str = ""  # the device function the access is in, when the kernel inlined it
    pc: str = ""
    source: str = ""
    thread: str = ""
    block: str = ""
    address: int | None = None
    address_note: str = ""
    nearest: dict[str, Any] = field(default_factory=dict)
    hazard: str = ""  # racecheck: "Write/Read race (248 hazards)", "WAR hazard"
    argument: str = ""  # where the address is: filled by map_addresses
    location: dict[str, Any] = field(default_factory=dict)  # addresses.Location as a dict

    def describe(self) -> str:
        """'memcheck: Invalid __global__ write of size 4 bytes in K (f.cu:12), thread (64,0,0)
        block (17,0,0), at 0x7f..: 16 bytes past the end of d'."""
        where = f" in {self.kernel}" if self.kernel else ""
        if self.function:
            where = f" in {self.function} (inlined into {self.kernel})"
        src = f" ({self.source})" if self.source else ""
        if self.thread:
            tb = f", thread ({self.thread}) block ({self.block})"
        else:
            tb = f", block ({self.block})" if self.block else ""
        addr = f", at {self.address:#x}" if self.address is not None else ""
        arg = f": {self.argument}" if self.argument else ""
        return f"{self.tool}: {self.kind}{where}{src}{tb}{addr}{arg}"


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
        if race := _race_record(line, tool):
            cur = race
            records.append(cur)
            continue
        if cur is not None and cur.hazard and _race_line(cur, line):
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
        elif m := _FRAME.match(line):
            # a caller of the function named by "at" (compiled with line info, the access's
            # function was inlined): the last frame is the launched kernel
            if not cur.function:
                cur.function = cur.kernel
            cur.kernel = m.group("kernel")
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


def _race_record(line: str, tool: str) -> SanitizerRecord | None:
    """A racecheck hazard's first line as a record, or None."""
    m = _RACE.match(line)
    if m is None:
        return None
    if m.group("first"):
        rec = SanitizerRecord(tool=tool, kind=f"Race reported between {m.group('first')} access")
        rec.hazard = f"{m.group('first')} race"
        rec.access = m.group("first").lower()
        _race_site(rec, line[m.end() :])
        return rec
    # A shared-memory offset, not a device address: nothing to map to an argument.
    where = f"{m.group('space')} {m.group('addr')}"
    rec = SanitizerRecord(tool=tool, kind=f"Potential {m.group('hazard')} hazard at {where}")
    rec.hazard = f"{m.group('hazard')} hazard"
    rec.address_note = where
    rec.block = m.group("block") or ""
    return rec


def _race_site(rec: SanitizerRecord, text: str) -> None:
    """Kernel, pc and source of the first access of a race (the first one named)."""
    m = _RACE_AT.search(text.strip())
    if m is None or rec.source:
        return
    if m.group("pc"):
        rec.pc = "0x" + m.group("pc")
    if m.group("file"):
        rec.source = f"{m.group('file')}:{m.group('line')}"
    kernel = m.group("kernel") or m.group("func") or ""
    if kernel and not rec.kernel:
        rec.kernel = kernel.strip()


def _race_line(rec: SanitizerRecord, line: str) -> bool:
    """Fold a continuation line of a racecheck hazard into `rec`; False if it is none."""
    if m := _RACE_AND.match(line):
        rec.hazard = f"{rec.hazard.split()[0]}/{m.group('second')} race"
        rec.kind = f"{rec.kind} and {m.group('second')} access"
        if m.group("count"):
            rec.hazard += f" ({m.group('count')} hazards)"
            rec.kind += f" ({m.group('count')} hazards)"
        return True
    if m := _RACE_THREAD.match(line):
        if not rec.thread:
            rec.thread = m.group("t")
        _race_site(rec, line[m.end() - 2 :])  # from "at 0x..."
        return True
    return False


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


def sanitizer_flags(tool: str, log_path: Path, kernel_filter: str | None) -> list[str]:
    """compute-sanitizer's command line up to the program it runs."""
    flags = [
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
        return [*flags, "--kernel-name", f"kns={kernel_filter}"]
    return [*flags, "--kernel-name-exclude", "kns=at::native"]  # torch's own kernels


def run_sanitizer(
    req: Request,
    tool: str,
    sanitizer: Path,
    base_env: dict[str, str] | None = None,
) -> Verdict:
    """Run one eager (or graph, `req.mode`) replay under `tool`; findings are exit 4. A replay
    that dies or hangs under the sanitizer is a kernel error, one that never ran an internal
    error, exactly as without it (kdump.replay.child)."""
    env = child_environment(
        base_env,
        PYTORCH_NO_CUDA_MEMORY_CACHING="1",
        DG_USE_TEMP_CUBLASLT_WORKSPACE="1",
        DG_JIT_WITH_LINEINFO="1",
    )
    v = _run_under(req, tool, sanitizer, env)
    if req.mode == "graph" and _capture_failed(v):
        # Without torch's caching allocator every allocation is a cudaMalloc, which a stream
        # capture refuses: a kernel that allocates while it is captured (temporaries, a
        # workspace) cannot be captured that way. Run the chain again with the allocator on.
        del env["PYTORCH_NO_CUDA_MEMORY_CACHING"]
        v = _run_under(req, tool, sanitizer, env)
        v.notes.append(
            "the kernel allocates during capture, so the graph chain ran with torch's caching "
            "allocator on: the sanitizer sees the allocator's segments, not each buffer "
            "(kdump's guards around the arguments still bound them)"
        )
    return v


def _capture_failed(v: Verdict) -> bool:
    return any(
        f.kind == FindingKind.KERNEL_ERROR.value and f.step.endswith("graph/capture")
        for f in v.findings
    )


def _run_under(req: Request, tool: str, sanitizer: Path, env: dict[str, str]) -> Verdict:
    opts = req.options
    child_req = Request(req.bundle, req.call, opts.for_sanitizer(req.mode))
    with tempfile.TemporaryDirectory(prefix="kdump-sanitizer-") as tmp:
        log_path = Path(tmp, "sanitizer.log")
        wrapper = [str(sanitizer), *sanitizer_flags(tool, log_path, opts.sanitizer.kernel_filter)]
        ended = launch(child_req, opts.timeout, env, wrapper)
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
    keep = opts.sanitizer.log_dir
    if keep and log:
        Path(keep).mkdir(parents=True, exist_ok=True)
        name = f"{Path(req.bundle).stem}-call{req.call}-{req.mode}-{tool}.log"
        Path(keep, name).write_text(log)
    low = ended.stderr.lower()
    if not ended.events and ("refused" in low or ("not supported" in low and not log)):
        raise CannotRunError(f"compute-sanitizer cannot run here: {ended.stderr.strip()[:200]}")
    v = judge(child_req, ended, opts.timeout, f"compute-sanitizer ({sanitizer})").verdict
    v.mode = f"sanitizer/{tool}"
    if ended.rc is None or not ended.events:
        return v  # hung or never ran: the report, if any, does not cover the replay
    placed = next((e["placed"] for e in ended.events if "placed" in e), [])
    tensors = [PlacedTensor.from_event(p) for p in placed]
    _add_report(v, tool, log, ended.rc, ended.stderr, tensors, sanitizer)
    return v


def map_addresses(report: SanitizerReport, tensors: list[PlacedTensor]) -> None:
    """Fill each record's `argument` and `location` from the replay's placed arguments."""
    for r in report.records:
        if r.address is None or not tensors:
            continue
        loc = locate_access(r.address, tensors, r.nearest or None)
        r.argument = loc.text
        r.location = asdict(loc)


def _add_report(
    v: Verdict,
    tool: str,
    log: str,
    rc: int,
    stderr: str,
    tensors: list[PlacedTensor],
    sanitizer: Path,
) -> None:
    """The sanitizer's step and its memory findings (the first MAX_FINDINGS, with a count of the
    rest). A crash of the same replay becomes the symptom of the first finding, its cause."""
    step = f"sanitizer/{tool}"
    report = parse_report(log, tool)
    map_addresses(report, tensors)
    version = tool_version(sanitizer)
    status = "ok" if not report.records and rc != SANITIZER_EXIT else "fail"
    total = report.errors if report.errors is not None else len(report.records)
    first = report.records[0].describe() if report.records else ""
    summary = f"{total} error(s) (compute-sanitizer {version or '?'})" + (
        f"; first: {first}" if first else ""
    )
    shown = report.records[:MAX_FINDINGS]
    rest = max(total, len(report.records)) - len(shown)
    metrics = {"errors": report.errors, "records": len(report.records), "not_shown": rest}
    v.steps.append(Step(step, status, summary, 0.0, metrics))
    memory = FindingKind.MEMORY.value
    for r in shown:
        v.findings.append(Finding(memory, step, r.describe(), asdict(r)))
    if rest > 0 and shown:
        v.notes.append(
            f"{tool}: {rest} more error(s) not listed (the first {len(shown)} are findings; "
            "--sanitizer-logs DIR keeps the whole report)"
        )
    if status == "fail" and not report.records:
        last = log.strip().splitlines()[-1] if log.strip() else stderr[-200:]
        v.findings.append(
            Finding(
                memory, step, f"compute-sanitizer reported errors the parser did not read: {last}"
            )
        )
    if shown:
        _cause_of_crash(v, shown[0], total)
    if tool == "memcheck":
        v.notes.append(
            "memcheck does not see TMA loads past an allocation on older drivers "
            "(compute-sanitizer before 2026.2): the halo differential of eager and graph mode "
            "covers those"
        )


def _cause_of_crash(v: Verdict, first: SanitizerRecord, total: int) -> None:
    """A kernel error of the same replay is the symptom; the sanitizer's first finding is the
    cause. The kernel error keeps its kind (and so its exit code) but names the cause first, so
    the headline explains the crash."""
    for k, f in enumerate(v.findings):
        if f.kind != FindingKind.KERNEL_ERROR.value or "caused_by" in f.details:
            continue
        more = f" (first of {total})" if total > 1 else ""
        message = f"caused by {first.describe()}{more}; symptom: {f.message}"
        details = {**f.details, "caused_by": asdict(first), "symptom": f.message}
        v.findings[k] = Finding(f.kind, f.step, message, details)
