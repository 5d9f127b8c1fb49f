"""Reading and writing .kdump bundles (normative spec: docs/FORMAT.md).

A bundle is a safetensors file. Each stored blob (the bytes of one storage span) is a 1-D uint8
tensor named by its SHA-256; the JSON manifest sits in `__metadata__["kdump.manifest"]`. Blobs may
instead live in the capture directory's shared content-addressed store (`blobs/ab/<sha256>`), which
`pack` folds back into one self-contained file.

Modules: format (constants, typed manifest records), parse (header and manifest JSON -> records),
validate (one pass over the records), reader (Bundle, Call, load_bundle), writer (capture_call,
save_calls, pack), store (atomic_write, BlobStore), tensors (exact-layout capture and
re-materialisation, needs torch), argtree (argument trees).

Importing this package, or reading a manifest, does not import torch: the names that need it are
loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kdump.bundle import argtree
from kdump.bundle.reader import Bundle, Call, MaterializedCall, iter_bundles, load_bundle
from kdump.bundle.store import BlobStore, atomic_write
from kdump.format.records import (
    FORMAT_VERSION,
    SUPPORTED_VERSIONS,
    BlobRecord,
    CallEntry,
    Manifest,
    OutputsRecord,
    Source,
    StorageRecord,
    TensorRecord,
)

if TYPE_CHECKING:
    from kdump.bundle.tensors import Captured, Placement
    from kdump.bundle.writer import (
        CallRecord,
        attach_outputs,
        capture_call,
        input_tensors,
        pack,
        save_calls,
    )

_LAZY = {
    "CallRecord": "kdump.bundle.writer",
    "attach_outputs": "kdump.bundle.writer",
    "capture_call": "kdump.bundle.writer",
    "input_tensors": "kdump.bundle.writer",
    "pack": "kdump.bundle.writer",
    "save_calls": "kdump.bundle.writer",
    "Placement": "kdump.bundle.tensors",
    "Captured": "kdump.bundle.tensors",
}

__all__ = [
    "FORMAT_VERSION",
    "SUPPORTED_VERSIONS",
    "BlobRecord",
    "BlobStore",
    "Bundle",
    "Call",
    "CallEntry",
    "CallRecord",
    "Captured",
    "Manifest",
    "MaterializedCall",
    "OutputsRecord",
    "Placement",
    "Source",
    "StorageRecord",
    "TensorRecord",
    "argtree",
    "atomic_write",
    "attach_outputs",
    "capture_call",
    "input_tensors",
    "iter_bundles",
    "load_bundle",
    "pack",
    "save_calls",
    "tensor_paths",
]

tensor_paths = argtree.tensor_paths


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kdump.bundle' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
