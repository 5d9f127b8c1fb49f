"""Notes the flight recorder leaves next to its journal for salvage: the process' last words (an
uncaught exception's traceback, and the CUDA error when it is one: the crash context) and the
recorded calls that raised (so their bundles say the call raised instead of "the kernel had not
finished"). Each file is replaced whole, whenever the process dies.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

from kdump.record.flight.salvage import CRASH_SUFFIX, raised_path


def write_last_words(journal: Path, kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    """Write the Python traceback (and the CUDA error, when it is one) next to the journal:
    salvage puts them in the crash context."""
    text = "".join(traceback.format_exception(kind, exc, tb))[-8000:]
    doc: dict[str, Any] = {"traceback": text, "exception": f"{kind.__name__}: {exc}"[:2000]}
    if "CUDA" in str(exc) or "cuda" in kind.__name__.lower():
        doc["cuda_error"] = str(exc)[:2000]
    tmp = journal.with_name(journal.name + CRASH_SUFFIX + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, journal.with_name(journal.name + CRASH_SUFFIX))


class RaisedNotes:
    """The notes of recorded calls that raised (the program may catch it and go on). Only the
    newest notes are kept, one per slot at most: a program that raises at every call must not
    fill /dev/shm. Not thread-safe: the recorder holds its lock around `note`."""

    def __init__(self) -> None:
        self._notes: dict[int, str] = {}  # slot -> the note of its call that raised

    def note(
        self, journal: Path, reserved: tuple[int, int], index: int, exc: BaseException
    ) -> None:
        """Note that the call recorded in slot `reserved` = (slot, seq) raised `exc`."""
        doc = {
            "slot": reserved[0],
            "seq": reserved[1],
            "call_index": index,
            "exception": f"{type(exc).__name__}: {exc}"[:2000],
        }
        notes = self._notes
        notes.pop(reserved[0], None)
        notes[reserved[0]] = json.dumps(doc)  # a slot's older note: its call is gone
        text = "".join(line + "\n" for line in notes.values())
        path = raised_path(journal)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # whole or not at all, whenever the process dies
