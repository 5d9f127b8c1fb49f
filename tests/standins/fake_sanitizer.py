#!/usr/bin/env python3
"""A stand-in for compute-sanitizer, for CPU tests of sanitizer mode.

It takes compute-sanitizer's flags (each with a value) followed by the program to run, answers
`--version`, and behaves as FAKE_SANITIZER says:

- clean (default): run the program, write a report with 0 errors to --log-file, exit with the
  program's status (1 with an error line when the program died of a signal);
- report: run the program, copy the report at FAKE_SANITIZER_REPORT to --log-file, exit with
  --error-exitcode;
- noop: exit 0 without running anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


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
        shutil.copyfile(os.environ["FAKE_SANITIZER_REPORT"], log)
        return int(flags["--error-exitcode"])
    with open(log, "w") as f:
        f.write("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n")
    if rc < 0:
        print("========= Error: process didn't terminate successfully", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
