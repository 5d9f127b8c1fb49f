"""Reading and writing .kdump bundles (normative spec: docs/FORMAT.md).

A bundle is a safetensors file. Each stored blob (the bytes of one storage span) is a 1-D uint8
tensor named by its SHA-256; the JSON manifest sits in `__metadata__["kdump.manifest"]`. Blobs may
instead live in the capture directory's shared content-addressed store (`blobs/ab/<sha256>`), which
`pack` folds back into one self-contained file.

The format itself (constants, typed records, the parser and the validator, torch-free) is
`kdump.format`. Modules here, by job: reader (Bundle, Call, load_bundle), tensors (layout facts:
dtype names, storages and views of a call's tensors), capture (capture_call, attach_outputs:
snapshots of a call's spans), materialize (re-creating tensors with their exact layout),
manifest (the manifest, its header and the one header template), header_cache (templates by call
signature), writer (save_calls: one write or spooled), spool, fileio and staging (spans into a
bundle's file, from host or device), packing (pack), store (atomic_write, BlobStore), argtree
(argument trees), inspect (what `kdump info` shows).

Importing this package, or reading a manifest, does not import torch: the names that need it are
loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kdump.bundle.reader import Bundle, Call, MaterializedCall, iter_bundles, load_bundle
from kdump.bundle.store import BlobStore, atomic_write
from kdump.format import argtree
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
    from kdump.bundle.capture import (
        CallRecord,
        Captured,
        attach_outputs,
        capture_call,
        input_tensors,
    )
    from kdump.bundle.materialize import Placement
    from kdump.bundle.packing import pack
    from kdump.bundle.writer import save_calls

_LAZY = {
    "CallRecord": "kdump.bundle.capture",
    "Captured": "kdump.bundle.capture",
    "attach_outputs": "kdump.bundle.capture",
    "capture_call": "kdump.bundle.capture",
    "input_tensors": "kdump.bundle.capture",
    "pack": "kdump.bundle.packing",
    "save_calls": "kdump.bundle.writer",
    "Placement": "kdump.bundle.materialize",
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
