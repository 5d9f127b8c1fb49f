"""Typed errors and the one table of exit codes. The library raises these errors; only the CLI
turns them into messages and exit codes. Verdicts, the CLI, `--help` and the README's exit-code
table are all derived from `ExitCode` and `FindingKind` below."""

from __future__ import annotations

import errno
import textwrap
from enum import Enum, IntEnum
from typing import ClassVar


class ExitCode(IntEnum):
    """Exit codes of every kdump command, each with a short label (for `--help`) and a meaning
    (for the README)."""

    label: str
    meaning: str

    def __new__(cls, value: int, label: str, meaning: str) -> ExitCode:
        obj = int.__new__(cls, value)
        obj._value_ = value
        obj.label = label
        obj.meaning = meaning
        return obj

    CLEAN = (
        0,
        "clean",
        "clean; also a replay that ran without error but had no oracle to compare with (no "
        "reference, no recorded output; `--strict` makes it 1)",
    )
    MISMATCH = (
        1,
        "wrong results",
        "wrong results: mismatch against reference or recorded output, nondeterminism",
    )
    USAGE = (
        2,
        "usage, environment or bundle error",
        "usage error; the environment stops the command (permission denied, disk full or "
        "read-only, missing folder); unreadable or invalid bundle",
    )
    KERNEL_ERROR = (
        3,
        "kernel error (crash, illegal address, hang)",
        "kernel error: crash, illegal address, hang (timeout)",
    )
    MEMORY_FINDING = (
        4,
        "memory finding",
        "memory finding: sanitizer error, halo or guard violation",
    )
    CONTRACT = (
        5,
        "contract violation",
        "the recorded call violates the kernel's contract (nothing launched unless `--force`)",
    )
    INTERNAL = (
        70,
        "internal error",
        "internal error: a bug in kdump (one line; traceback with `-v`, anywhere before `--`)",
    )
    CANNOT_RUN = (
        125,
        "cannot run here (no GPU, library missing)",
        "cannot run here: no GPU, wrong architecture, library missing",
    )


class FindingKind(str, Enum):
    """What a finding (or an error) is; each kind has exactly one exit code."""

    code: ExitCode
    description: str

    def __new__(cls, value: str, code: ExitCode, description: str) -> FindingKind:
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.code = code
        obj.description = description
        return obj

    MISMATCH = ("mismatch", ExitCode.MISMATCH, "output differs from the reference or recording")
    NONDETERMINISM = ("nondeterminism", ExitCode.MISMATCH, "runs on the same inputs differ")
    USAGE = ("usage", ExitCode.USAGE, "the command line or request is wrong")
    BUNDLE = ("bundle", ExitCode.USAGE, "the bundle is unreadable or invalid")
    KERNEL_ERROR = ("kernel_error", ExitCode.KERNEL_ERROR, "the kernel raised, crashed or died")
    HANG = ("hang", ExitCode.KERNEL_ERROR, "the replay ran past its timeout and was killed")
    MEMORY = ("memory", ExitCode.MEMORY_FINDING, "sanitizer error, halo or guard violation")
    CONTRACT = ("contract", ExitCode.CONTRACT, "the call violates the kernel's contract")
    INTERNAL = ("internal", ExitCode.INTERNAL, "a bug in kdump, or a replay that never ran")
    CANNOT_RUN = ("cannot_run", ExitCode.CANNOT_RUN, "this machine cannot run the request")


# Codes kdump chooses that no finding has: an interrupted command (Ctrl-C; a SIGTERM ends it as
# the shell reports a death by that signal, 128 + 15) and `kdump record`, which passes the
# program's own code through.
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


# With several findings the first code in this order wins.
EXIT_PRECEDENCE: tuple[ExitCode, ...] = (
    ExitCode.USAGE,
    ExitCode.CANNOT_RUN,
    ExitCode.INTERNAL,
    ExitCode.CONTRACT,
    ExitCode.KERNEL_ERROR,
    ExitCode.MEMORY_FINDING,
    ExitCode.MISMATCH,
)


def kind_exit_code(kind: str) -> ExitCode:
    """The exit code of a finding kind; a kind this table does not know is a bug in kdump."""
    try:
        return FindingKind(kind).code
    except ValueError:
        return ExitCode.INTERNAL


def worst_exit_code(codes: list[int] | tuple[int, ...]) -> int:
    """Combine the exit codes of several findings by the documented precedence."""
    present = set(codes)
    for code in EXIT_PRECEDENCE:
        if code in present:
            return int(code)
    return 0


# `git bisect run` reads 0 as good, 125 as skip, 128 (any code above 127) as abort and any
# other code as bad. Only a reproduced failure may mark a commit bad.
BISECT_GOOD = 0
BISECT_BAD = 1
BISECT_SKIP = 125
BISECT_ABORT = 128


def bisect_exit_code(code: int) -> int:
    """The `git bisect run` exit code for a kdump exit code: clean is good; a reproduced failure
    (mismatch, kernel error, memory finding, contract violation) is bad; a library that cannot
    run at this commit is skip; a usage, bundle or internal error (or an unknown code) aborts."""
    if code == ExitCode.CLEAN:
        return BISECT_GOOD
    if code in (
        ExitCode.MISMATCH,
        ExitCode.KERNEL_ERROR,
        ExitCode.MEMORY_FINDING,
        ExitCode.CONTRACT,
    ):
        return BISECT_BAD
    if code == ExitCode.CANNOT_RUN:
        return BISECT_SKIP
    return BISECT_ABORT


def bisect_text() -> str:
    """The `--bisect` paragraph shared by `kdump replay --help` and the README."""
    bad = ", ".join(str(int(c)) for c in ExitCode if bisect_exit_code(c) == BISECT_BAD)
    abort = ", ".join(str(int(c)) for c in ExitCode if bisect_exit_code(c) == BISECT_ABORT)
    return (
        "`kdump replay --bisect` follows `git bisect run` (e.g. `git bisect run kdump replay "
        f"--bisect BUNDLE`): clean exits {BISECT_GOOD} (good); a reproduced failure ({bad}) "
        f"exits {BISECT_BAD} (bad); a library that cannot be imported or built at this commit "
        f"({int(ExitCode.CANNOT_RUN)}) exits {BISECT_SKIP} (skip); a usage, bundle or internal "
        f"error ({abort}) exits {BISECT_ABORT} (abort); an interrupted run exits "
        f"{EXIT_INTERRUPTED}, which `git bisect run` also reads as abort. A replay without an "
        f"oracle is good ({BISECT_GOOD}) unless `--strict` makes it bad ({BISECT_BAD})."
    )


def precedence_rank(code: int) -> int:
    """Position of `code` in EXIT_PRECEDENCE (unknown codes last)."""
    for i, c in enumerate(EXIT_PRECEDENCE):
        if c == code:
            return i
    return len(EXIT_PRECEDENCE)


def exit_codes_help() -> str:
    """The exit-code paragraph of `--help` (click keeps a paragraph led by \\b as written)."""
    pairs = ", ".join(f"{int(c)} {c.label}" for c in ExitCode)
    pairs += f", {EXIT_INTERRUPTED} interrupted (Ctrl-C; SIGTERM: {EXIT_TERMINATED})"
    body = textwrap.fill(
        f"Exit codes: {pairs}. kdump record exits with the program's own code.", width=92
    )
    order = ", ".join(str(int(c)) for c in EXIT_PRECEDENCE)
    return f"\b\n{body}\nSeveral findings: the first code in the order {order} wins."


def exit_codes_markdown() -> str:
    """The README's exit-code section body, generated from the tables above."""
    lines = ["| code | meaning | finding kinds |", "|---|---|---|"]
    for c in ExitCode:
        kinds = ", ".join(f"`{k.value}`" for k in FindingKind if k.code == c)
        lines.append(f"| {int(c)} | {c.meaning} | {kinds} |")
    lines += [
        f"| {BISECT_ABORT} | `kdump replay --bisect` only: abort `git bisect run` (a usage, "
        "bundle or internal error; see below) |  |",
        f"| {EXIT_INTERRUPTED} | interrupted (Ctrl-C); a SIGTERM ends kdump with "
        f"{EXIT_TERMINATED} |  |",
        "| the program's | `kdump record` passes the program's exit code through (128 + N when "
        "signal N ended it); its own codes only when it cannot start or record the program |  |",
    ]
    order = ", ".join(str(int(c)) for c in EXIT_PRECEDENCE)
    lines += ["", f"With several findings the first in the order {order} wins.", "", bisect_text()]
    return "\n".join(lines)


class KdumpError(Exception):
    """Base of every error kdump raises on purpose. The message is one line that says what to do.

    A subclass names its `finding_kind` (or inherits it); its `exit_code` always follows from the
    table, so a replay that meets the error reports its kind as it is and nothing maps exit codes
    back to kinds. A subclass that sets `exit_code` itself is refused (a kind and a code that
    disagree is what this rule exists to prevent)."""

    finding_kind: ClassVar[FindingKind] = FindingKind.INTERNAL
    exit_code: ClassVar[ExitCode] = FindingKind.INTERNAL.code

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "exit_code" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} sets exit_code: set finding_kind (or derive from the error of "
                "its kind); the exit code follows from the kind"
            )
        cls.exit_code = cls.finding_kind.code


class UsageError(KdumpError):
    finding_kind = FindingKind.USAGE


class BundleErrorKind(str, Enum):
    """What is wrong with a bundle (tests and callers match this, not the message)."""

    INVALID = "invalid"  # generic
    NOT_FOUND = "not-found"  # no such file, a directory, unreadable
    NOT_A_BUNDLE = "not-a-bundle"
    TRUNCATED = "truncated"
    BAD_HEADER = "bad-header"
    UNSUPPORTED_VERSION = "unsupported-version"
    SCHEMA = "schema"  # a field missing, mistyped, out of range or inconsistent
    UNKNOWN_SOURCE = "unknown-source"
    CHECKSUM = "checksum"
    MISSING_BLOB = "missing-blob"
    LIMIT = "limit"  # over a size limit of the format


class BundleError(KdumpError):
    """The bundle is unreadable, corrupt, or not something this reader can trust."""

    finding_kind = FindingKind.BUNDLE

    def __init__(self, message: str, kind: BundleErrorKind = BundleErrorKind.INVALID) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple[type[BundleError], tuple[str, BundleErrorKind]]:
        return type(self), (str(self), self.kind)  # the kind survives a worker process


class CannotRunError(KdumpError):
    """This machine cannot run the request: no GPU, wrong architecture, library missing."""

    finding_kind = FindingKind.CANNOT_RUN


class InternalError(KdumpError):
    """A bug in kdump itself (e.g. its own CUDA source does not compile)."""

    finding_kind = FindingKind.INTERNAL


class ContractViolation(KdumpError):
    """The recorded call violates the kernel's documented contract."""

    finding_kind = FindingKind.CONTRACT


class UserEnvironmentError(UsageError):
    """The user's environment stops the command: a permission, a full or read-only disk, a
    missing folder, a file where a folder should be. Not a bug in kdump (exit 2)."""


# errno -> what to do about it; {path} is the file the system named.
_ENV_ADVICE: dict[int, str] = {
    errno.EACCES: "permission denied for {path}: choose a location you can write (or read), "
    "or fix its permissions",
    errno.EPERM: "operation not permitted on {path}: choose a location you own, or fix its "
    "permissions",
    errno.ENOSPC: "no space left on the device of {path}: free some space or write elsewhere",
    errno.EDQUOT: "disk quota exceeded writing {path}: free some space or write elsewhere",
    errno.EFBIG: "{path} is too large for its file system: write to another file system",
    errno.EROFS: "{path} is on a read-only file system: choose a writable location",
    errno.EISDIR: "{path} is a folder: give a file name",
    errno.ENOTDIR: "a part of {path} is a file, not a folder: check the path",
    errno.ENOENT: "{path} does not exist: check the path, or create its folder first",
    errno.EEXIST: "{path} already exists where kdump needs a new file or a folder: remove it "
    "or choose another path",
    errno.ENAMETOOLONG: "the path {path} is too long: choose a shorter one",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) and run it again",
    errno.ENFILE: "too many open files on this system: close some programs and run it again",
    errno.EIO: "input/output error on {path}: check the disk",
    errno.EPIPE: "the output was closed before kdump finished writing it",
}


def environment_error(exc: OSError, path: object = None) -> UserEnvironmentError | None:
    """The typed error for an OSError the user's environment caused, with one line that says
    what to do; None for any other OSError (a bug in kdump stays one). `path`: the file being
    written, for errors that do not name one (a write to a full disk)."""
    advice = _ENV_ADVICE.get(exc.errno) if exc.errno is not None else None
    if advice is None:
        return None
    # Bundle paths are untrusted; the CLI escapes the whole message before printing it.
    name = next((n for n in (exc.filename, exc.filename2, path) if n is not None), None)
    path = repr(str(name)) if name is not None else "the output"
    return UserEnvironmentError(advice.format(path=path))


class UnknownTargetError(UsageError):
    """A target name that resolves to nothing."""


class UntrustedTargetError(UsageError):
    """A bundle names a target that is neither a registered plug-in's nor allowed by the user."""


def error_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
