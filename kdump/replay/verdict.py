"""What a replay says: steps, findings and the exit code they add up to."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kdump.errors import kind_exit_code, precedence_rank, worst_exit_code

CLEAN, NO_ORACLE, FAILED = "clean", "no_oracle", "failed"


@dataclass
class Finding:
    """One problem found. `kind` decides the exit code."""

    kind: str  # a kdump.errors.FindingKind value
    step: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return int(kind_exit_code(self.kind))


@dataclass
class Step:
    name: str  # e.g. "eager/run 1"
    status: str  # ok | fail | error | skipped
    message: str = ""
    seconds: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class Verdict:
    bundle: str
    call: int
    target: str
    mode: str
    backend: str = ""
    device: str = ""
    steps: list[Step] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Which tensors the replay judged as outputs, when it found them by running (else empty)
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return worst_exit_code([f.exit_code for f in self.findings])

    def strict_exit_code(self) -> int:
        """The exit code under --strict: a replay without an oracle is 1, not 0."""
        return 1 if self.outcome == NO_ORACLE else self.exit_code

    @property
    def has_oracle(self) -> bool:
        """Whether anything judged the results: the reference, the recording, a fresh eager
        run (agreeing with another run of itself, "vs run 1", is determinism, not
        correctness)."""
        return any(" vs " in s.name and " vs run " not in s.name for s in self.steps)

    @property
    def outcome(self) -> str:
        """clean, no_oracle (ran without error, nothing to compare with: never clean), or
        failed."""
        if self.findings:
            return FAILED
        return CLEAN if self.has_oracle else NO_ORACLE

    @property
    def clean(self) -> bool:
        """No finding (see `outcome`: a clean replay also had an oracle)."""
        return not self.findings

    def headline(self) -> str:
        if not self.findings:
            if not self.has_oracle:
                return "ran without error — no oracle to compare with"
            return "clean"
        # Nondeterminism first among wrong results: a mismatch against the recording of a
        # result that changes from run to run says little.
        first = min(
            self.findings,
            key=lambda f: (precedence_rank(f.exit_code), f.kind != "nondeterminism"),
        )
        kind = first.kind.replace("_", " ")
        # Messages that already start with their kind ("hang: ...") are not prefixed twice.
        msg = first.message
        text = msg if msg.lower().startswith(kind) else f"{kind}: {msg}"
        return f"{text} (step {first.step})"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        d["outcome"] = self.outcome
        d["headline"] = self.headline()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Verdict:
        return cls(
            bundle=d["bundle"],
            call=d["call"],
            target=d["target"],
            mode=d["mode"],
            backend=d.get("backend", ""),
            device=d.get("device", ""),
            steps=[Step(**s) for s in d.get("steps", [])],
            findings=[Finding(**f) for f in d.get("findings", [])],
            notes=list(d.get("notes", [])),
            outputs=dict(d.get("outputs") or {}),
        )
