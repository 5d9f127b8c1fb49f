"""Typed errors. The library raises these; only the CLI turns them into messages and exit codes."""

from __future__ import annotations

from enum import Enum, IntEnum


class ExitCode(IntEnum):
    """Exit codes of every kdump command (the README's table is checked against this)."""

    CLEAN = 0
    MISMATCH = 1  # wrong results: reference / recorded output mismatch, nondeterminism
    USAGE = 2  # usage error, unreadable or invalid bundle
    KERNEL_ERROR = 3  # crash, illegal address, hang
    MEMORY_FINDING = 4  # sanitizer error, halo or guard violation
    CONTRACT = 5  # the recorded call violates the kernel's contract
    INTERNAL = 70  # a bug in kdump
    CANNOT_RUN = 125  # no GPU, wrong architecture, library missing


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


def worst_exit_code(codes: list[int] | tuple[int, ...]) -> int:
    """Combine the exit codes of several findings by the documented precedence."""
    present = set(codes)
    for code in EXIT_PRECEDENCE:
        if code in present:
            return int(code)
    return 0


class KdumpError(Exception):
    """Base of every error kdump raises on purpose. The message is one line that says what to do."""

    exit_code: ExitCode = ExitCode.INTERNAL


class UsageError(KdumpError):
    exit_code = ExitCode.USAGE


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

    exit_code = ExitCode.USAGE

    def __init__(self, message: str, kind: BundleErrorKind = BundleErrorKind.INVALID) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple[type[BundleError], tuple[str, BundleErrorKind]]:
        return type(self), (str(self), self.kind)  # the kind survives a worker process


class CannotRunError(KdumpError):
    """This machine cannot run the request: no GPU, wrong architecture, library missing."""

    exit_code = ExitCode.CANNOT_RUN


class ContractViolation(KdumpError):
    """The recorded call violates the kernel's documented contract."""

    exit_code = ExitCode.CONTRACT


class UnknownTargetError(UsageError):
    """A target name that resolves to nothing."""
