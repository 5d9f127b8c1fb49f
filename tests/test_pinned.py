"""kdump.record.flight.pinned against a fake CUDA runtime (registrations tracked by address)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kdump.format.journal import JournalError
from kdump.record.flight import pinned


class FakeRuntime:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []

    def cudaHostRegister(self, addr: int, size: int, flags: int) -> int:
        self.calls.append(f"register {addr:#x}")
        if any(a < addr + size and addr < a + n for a, n in self.registered.items()):
            return pinned.ALREADY_REGISTERED
        self.registered[addr] = size
        return 0

    def cudaHostUnregister(self, addr: int) -> int:
        self.calls.append(f"unregister {addr:#x}")
        return 0 if self.registered.pop(addr, None) is not None else 1


class Owner:
    pass


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(pinned, "_take_last_error", lambda device: None)
    return fake


def test_end_is_idempotent(rt: FakeRuntime) -> None:
    owner = Owner()
    end = pinned.register(0x1000, 4096, 0, "the journal", owner)
    assert rt.registered == {0x1000: 4096}
    end()
    end()
    assert rt.registered == {} and rt.calls.count("unregister 0x1000") == 1
    del owner
    gc.collect()
    assert rt.calls.count("unregister 0x1000") == 1  # ended already: nothing more at collection


def test_a_collected_owner_ends_its_registration(rt: FakeRuntime) -> None:
    """An owner dropped without closing (a failed test's journal) leaves no stale registration
    for the next mapping at the same address."""
    owner = Owner()
    pinned.register(0x1000, 4096, 0, "the journal", owner)
    del owner
    gc.collect()
    assert rt.registered == {}
    again = Owner()
    pinned.register(0x1000, 8192, 0, "the journal", again)
    assert rt.calls == ["register 0x1000", "unregister 0x1000", "register 0x1000"]
    assert rt.registered == {0x1000: 8192}


def test_stale_registration_at_the_same_address_is_ended_and_retried(rt: FakeRuntime) -> None:
    rt.registered[0x1000] = 4096  # left by a mapping unmapped without unregistering
    owner = Owner()
    pinned.register(0x1000, 4096, 0, "the journal", owner)
    assert rt.calls == ["register 0x1000", "unregister 0x1000", "register 0x1000"]
    assert rt.registered == {0x1000: 4096}


def test_refusal_names_both_errors(rt: FakeRuntime) -> None:
    rt.registered[0x800] = 4096  # overlaps, but starts elsewhere: unregistering 0x1000 fails
    with pytest.raises(JournalError, match=r"CUDA error 712"):
        pinned.register(0x1000, 4096, 0, "the static region", Owner())
    assert rt.registered == {0x800: 4096}


def test_refusal_on_a_disk_folder_says_to_use_shared_memory(
    rt: FakeRuntime, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(pinned, "filesystem_of", lambda path: "ext4")
    rt.registered[0x800] = 4096
    with pytest.raises(JournalError, match=r"is on ext4.*under /dev/shm \(KDUMP_JOURNAL_DIR\)"):
        pinned.register(0x1000, 4096, 0, "the journal", Owner(), path=tmp_path / "j")
    monkeypatch.setattr(pinned, "filesystem_of", lambda path: "tmpfs")
    with pytest.raises(JournalError) as info:
        pinned.register(0x1000, 4096, 0, "the journal", Owner(), path=tmp_path / "j")
    assert "/dev/shm" not in str(info.value)


def test_filesystem_of_reads_the_longest_mount() -> None:
    assert pinned.filesystem_of(Path("/proc/self")) == "proc"
    if Path("/dev/shm").is_dir():
        assert pinned.filesystem_of(Path("/dev/shm/x")) in pinned.SHARED_MEMORY_FS
