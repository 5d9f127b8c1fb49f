#!/usr/bin/env python3
"""A stand-in for compute-sanitizer, for CPU tests of sanitizer mode.

It takes compute-sanitizer's flags (each with a value) followed by the program to run, answers
`--version`, and behaves as FAKE_SANITIZER says:

- clean (default): run the program, write a report with 0 errors to --log-file, exit with the
  program's status (1 with an error line when the program died of a signal);
- report: run the program, write the report at FAKE_SANITIZER_REPORT to --log-file, exit with
  --error-exitcode. The report may name addresses of the replayed arguments as
  `@{NAME:FIELD+N}` / `@{NAME:FIELD-N}` (FIELD: ptr = first element, end = one past the view,
  alloc = the allocation, alloc_end = one past it; hexadecimal) and `@{NAME:alloc_size}`
  (decimal), read from the replay child's `placed` progress event;
- noop: exit 0 without running anything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

_TOKEN = re.compile(
    r"@\{(?P<name>[^:}]+):(?P<field>ptr|end|alloc_end|alloc_size|alloc)(?P<off>[+-]\d+)?\}"
)


def _placed(program: list[str]) -> dict[str, dict]:
    """The replay child's placed arguments, by name (its folder is the last argument)."""
    progress = Path(program[-1], "progress")
    if not progress.exists():
        return {}
    for line in progress.read_text().splitlines():
        event = json.loads(line)
        if "placed" in event:
            return {p["name"]: p for p in event["placed"]}
    return {}


def _value(p: dict, field: str) -> int:
    if field == "ptr":
        return p["data_ptr"]
    if field == "end":
        last = sum((n - 1) * s for n, s in zip(p["shape"], p["stride"]))
        return p["data_ptr"] + (last + 1) * p["itemsize"]
    if field == "alloc":
        return p["alloc_ptr"]
    if field == "alloc_end":
        return p["alloc_ptr"] + p["alloc_nbytes"]
    return p["alloc_nbytes"]


def render(template: str, placed: dict[str, dict]) -> str:
    def sub(m: re.Match[str]) -> str:
        value = _value(placed[m.group("name")], m.group("field")) + int(m.group("off") or 0)
        return str(value) if m.group("field") == "alloc_size" else hex(value)

    return _TOKEN.sub(sub, template)


def main(argv: list[str]) -> int:
    if argv == ["--version"]:
        print("NVIDIA (R) Compute Sanitizer\nVersion 2025.3.1 (stand-in)")
        return 0
    flags: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        flags[argv[i]] = argv[i + 1]
        i += 2
    program = argv[i:]
    behaviour = os.environ.get("FAKE_SANITIZER", "clean")
    if behaviour == "noop":
        return 0
    rc = subprocess.call(program)
    log = flags["--log-file"]
    if behaviour == "report":
        text = render(Path(os.environ["FAKE_SANITIZER_REPORT"]).read_text(), _placed(program))
        Path(log).write_text(text)
        return int(flags["--error-exitcode"])
    with open(log, "w") as f:
        f.write("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n")
    if rc < 0:
        print("========= Error: process didn't terminate successfully", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
