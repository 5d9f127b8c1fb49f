"""CUDA memory shared with another process through CUDA IPC, described as JSON.

`export_cuda(t)` describes a contiguous CUDA tensor's bytes through torch's own storage sharing
(`UntypedStorage._share_cuda_`, what `torch.multiprocessing` sends); `import_cuda(doc)` in another
process maps the same memory as a 1-D uint8 tensor of exactly `nbytes`. The importer keeps the
memory alive while it holds the tensor, also after the owner died (SIGKILL, or a sticky
illegal-address error after which the owner cannot read its own memory).

Cost: each importing process holds one CUDA context per device it imported on (a few hundred
MiB of device memory on a recent GPU; tests/test_salvager.py measures it on the GPU).

Devices are matched by UUID, so an importer whose CUDA_VISIBLE_DEVICES numbers the devices
differently finds the same GPU; without UUIDs the index is used as it is.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from kdump.errors import CannotRunError, UsageError

if TYPE_CHECKING:
    import torch

KIND = "cuda-ipc"
VERSION = 1
MAX_HEX = 16384  # hex characters of one handle field (a cudaMalloc handle is 64 bytes)
MAX_DEVICES = 1024
MAX_NBYTES = 1 << 46
_HEX = re.compile(r"\A(?:[0-9a-f]{2})*\Z")
_INT_FIELDS = ("device", "storage_nbytes", "storage_offset", "ref_counter_offset", "offset")
_HEX_FIELDS = ("handle", "ref_counter_handle", "event_handle")
FIELDS = frozenset(
    ("kind", "version", "device_uuid", "event_sync_required", "nbytes", *_INT_FIELDS, *_HEX_FIELDS)
)


class DeviceShareError(UsageError):
    """A shared-memory description that is malformed, or memory that cannot be described."""


class DeviceNotFoundError(CannotRunError):
    """The described memory's device is not visible in this process."""


def _uuid(index: int) -> str | None:
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else None


def export_cuda(t: torch.Tensor) -> dict[str, Any]:
    """A JSON-serialisable description of the bytes of contiguous CUDA tensor `t`."""
    if t.device.type != "cuda":
        raise DeviceShareError(f"only CUDA memory can be shared this way, not {t.device}")
    if not t.is_contiguous():
        raise DeviceShareError("the tensor must be contiguous: its bytes are shared as one range")
    nbytes = t.numel() * t.element_size()
    if nbytes <= 0:
        raise DeviceShareError("an empty tensor has no memory to share")
    storage = t.untyped_storage()
    (
        device,
        handle,
        storage_nbytes,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return {
        "kind": KIND,
        "version": VERSION,
        "device": int(device),
        "device_uuid": _uuid(int(device)),
        "handle": bytes(handle).hex(),
        "storage_nbytes": int(storage_nbytes),
        "storage_offset": int(storage_offset),
        "ref_counter_handle": bytes(ref_counter_handle).hex(),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle or b"").hex(),
        "event_sync_required": bool(event_sync_required),
        "offset": t.storage_offset() * t.element_size(),
        "nbytes": nbytes,
    }


def validate(doc: Any) -> dict[str, Any]:
    """`doc` checked field by field (DeviceShareError on anything unexpected); returned as is."""
    if not isinstance(doc, dict):
        raise DeviceShareError(
            f"a shared-memory description is an object, not {type(doc).__name__}"
        )
    keys = set(doc)
    if keys != FIELDS:
        extra, lacking = sorted(keys - FIELDS), sorted(FIELDS - keys)
        raise DeviceShareError(f"shared-memory description: unknown {extra}, lacking {lacking}")
    if doc["kind"] != KIND or doc["version"] != VERSION:
        raise DeviceShareError(f"shared-memory description is not {KIND} version {VERSION}")
    for name in (*_INT_FIELDS, "nbytes"):
        v = doc[name]
        if type(v) is not int or not 0 <= v <= MAX_NBYTES:
            raise DeviceShareError(f"shared-memory description: {name} must be an int in range")
    if doc["device"] >= MAX_DEVICES:
        raise DeviceShareError(f"shared-memory description: device {doc['device']} out of range")
    for name in _HEX_FIELDS:
        v = doc[name]
        if not isinstance(v, str) or len(v) > MAX_HEX or not _HEX.match(v):
            raise DeviceShareError(f"shared-memory description: {name} must be lower-case hex")
    if not doc["handle"] or not doc["ref_counter_handle"]:
        raise DeviceShareError("shared-memory description: empty handle")
    uuid = doc["device_uuid"]
    if uuid is not None and (not isinstance(uuid, str) or not 0 < len(uuid) <= 128):
        raise DeviceShareError("shared-memory description: device_uuid must be a short string")
    if type(doc["event_sync_required"]) is not bool:
        raise DeviceShareError("shared-memory description: event_sync_required must be a bool")
    if doc["nbytes"] == 0 or doc["offset"] + doc["nbytes"] > doc["storage_nbytes"]:
        raise DeviceShareError("shared-memory description: the range lies outside the storage")
    return doc


def local_device(doc: dict[str, Any]) -> int:
    """This process' index of the device `doc` names (by UUID where both sides know it)."""
    import torch

    if not torch.cuda.is_available():
        raise DeviceNotFoundError("no CUDA device is visible here: cannot import CUDA memory")
    n = torch.cuda.device_count()
    uuid = doc["device_uuid"]
    if uuid is not None:
        for i in range(n):
            if _uuid(i) == uuid:
                return i
        if _uuid(0) is not None:
            raise DeviceNotFoundError(
                f"the owner's device {uuid} is not among the {n} visible here "
                "(CUDA_VISIBLE_DEVICES differs); make it visible to kdump"
            )
    if doc["device"] >= n:
        raise DeviceNotFoundError(f"device {doc['device']} is not visible here ({n} devices)")
    return doc["device"]


def import_cuda(doc: dict[str, Any]) -> torch.Tensor:
    """The memory `doc` describes, as a 1-D uint8 CUDA tensor of exactly `nbytes`; holding it
    keeps the memory alive."""
    validate(doc)  # before torch: a malformed description is refused at once
    import torch

    device = local_device(doc)
    torch.cuda._lazy_init()  # what torch.multiprocessing does before it opens a handle
    storage = torch.UntypedStorage._new_shared_cuda(
        device,
        bytes.fromhex(doc["handle"]),
        doc["storage_nbytes"],
        doc["storage_offset"],
        bytes.fromhex(doc["ref_counter_handle"]),
        doc["ref_counter_offset"],
        bytes.fromhex(doc["event_handle"]),  # torch takes bytes here, zeros when unused
        doc["event_sync_required"],
    )
    out = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    out.set_(storage, doc["offset"], (doc["nbytes"],), (1,))
    return out
