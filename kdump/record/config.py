"""What a recording session does: `RecordConfig`, built from keyword options or the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdump import config
from kdump.errors import UsageError
from kdump.record.triggers import TriggerConfig

MODES = ("sync", "ring")


@dataclass(frozen=True)
class RingConfig:
    """The flight recorder's budgets (mode ring)."""

    slots: int = 64  # 64 x 1 MiB of pinned shared memory: small next to a serving GPU's host
    slot_bytes: int = 1 << 20
    journal_dir: Path = Path("/dev/shm")
    static_bytes: int = 1 << 30  # static operands, copied once per (storage, version); 0: off
    # Device memory of the recorder per GPU (the journal's twin, the ring of gathered rows):
    # small next to a serving GPU's memory; 0 turns the device tier off.
    device_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.device_bytes < 0:
            raise UsageError(f"--device-bytes {self.device_bytes}: use 0 (off) or a size")
        if self.slots < 2:
            raise UsageError(f"--ring-slots {self.slots}: the ring needs at least 2 slots")
        if self.slot_bytes < 4096:
            raise UsageError(f"--slot-bytes {self.slot_bytes}: use at least 4K per slot")
        if self.static_bytes < 0:
            raise UsageError(f"--static-bytes {self.static_bytes}: use 0 (off) or a size")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RingConfig:
        from kdump.config import parse_bytes

        def get(name: str) -> str:
            value = config.get(name, env)
            assert value is not None  # every ring variable has a default
            return value

        try:
            slots = int(get("KDUMP_RING_SLOTS"))
        except ValueError:
            raise UsageError("KDUMP_RING_SLOTS must be a whole number of slots, e.g. 64")
        return cls(
            slots=slots,
            slot_bytes=parse_bytes(get("KDUMP_SLOT_BYTES")),
            journal_dir=Path(get("KDUMP_JOURNAL_DIR")),
            static_bytes=parse_bytes(get("KDUMP_STATIC_BYTES")),
            device_bytes=parse_bytes(get("KDUMP_DEVICE_BYTES")),
        )


Outputs = str | tuple[str | int, ...]  # default | none | all | parameter names / positions


@dataclass(frozen=True)
class RecordConfig:
    targets: tuple[str, ...] = ("deep_gemm",)
    out: Path = Path("kdump-out")
    mode: str = "sync"
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    outputs: Outputs = "default"
    ring: RingConfig = field(default_factory=lambda: RingConfig())

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"unknown recording mode {self.mode!r}; use ring or sync")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RecordConfig:
        """The configuration `kdump record` passes to its processes (kdump.config.ENV_VARS)."""

        def get(name: str) -> str | None:
            return config.get(name, env)

        targets = tuple(t.strip() for t in (get("KDUMP_TARGETS") or "deep_gemm").split(","))
        return cls(
            targets=tuple(t for t in targets if t),
            out=Path(get("KDUMP_OUT") or "kdump-out"),
            mode=(get("KDUMP_MODE") or "sync").lower(),
            trigger=TriggerConfig.build(
                calls=get("KDUMP_CALLS"),
                every=get("KDUMP_EVERY"),
                first_per_signature=get("KDUMP_FIRST_PER_SIGNATURE"),
                ranks=get("KDUMP_RANKS"),
                predicate=get("KDUMP_PREDICATE"),
                max_bundles=get("KDUMP_MAX_BUNDLES"),
                max_bytes=get("KDUMP_MAX_BYTES"),
                keep=get("KDUMP_KEEP") or "oldest",
                on_exception=config.get_flag("KDUMP_ON_EXCEPTION", env),
            ),
            outputs=parse_outputs(get("KDUMP_OUTPUTS")),
            ring=RingConfig.from_env(env),
        )

    @property
    def private_store(self) -> bool:
        """Whether limits may delete bundles: then each process keeps its blobs in its own folder,
        so evicting never removes a blob another process's bundle uses."""
        trig = self.trigger
        return trig.max_bytes is not None or (
            trig.keep == "newest" and trig.max_bundles is not None
        )


def parse_outputs(value: Any) -> Outputs:
    if value is None:
        return "default"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("", "default", "1", "true", "yes", "on"):
            return "default"
        if v in ("none", "0", "false", "no", "off"):
            return "none"
        if v == "all":
            return "all"
        items = [x.strip() for x in value.split(",") if x.strip()]
    else:
        items = list(value)
    return tuple(int(x) if isinstance(x, int) or str(x).isdigit() else str(x) for x in items)
