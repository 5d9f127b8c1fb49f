"""`file.kdump#N`: one call of a bundle on the command line (call 0 without `#N`)."""

from __future__ import annotations

from dataclasses import dataclass

from kdump.bundle import Bundle, Call, load_bundle
from kdump.errors import UsageError


@dataclass(frozen=True)
class CallRef:
    path: str
    index: int = 0
    explicit: bool = False  # the call number was given

    @property
    def label(self) -> str:
        return f"{self.path}#{self.index}" if self.explicit else self.path


def parse_ref(text: str) -> CallRef:
    path, sep, idx = text.rpartition("#")
    if not sep:
        return CallRef(text)
    if not idx.isdigit():
        raise UsageError(f"{text!r}: the part after '#' must be a call number, e.g. file.kdump#0")
    return CallRef(path, int(idx), explicit=True)


def open_ref(ref: CallRef) -> tuple[Bundle, Call]:
    bundle = load_bundle(ref.path)
    return bundle, bundle.call(ref.index)
