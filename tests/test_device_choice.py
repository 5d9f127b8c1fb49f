"""`--device auto`: a GPU when there is one, except for a target without a spec that was recorded
on the CPU (a user's own function gets its tensors on the device it saw)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdump.bundle import capture_call, load_bundle, save_calls
from kdump.replay.session import resolve_device


def _cpu_call(tmp_path: Path):
    x = torch.randn(4, 3)
    save_calls(tmp_path / "c.kdump", [capture_call("targets.replay_targets:scale_into", [x], {})])
    return load_bundle(tmp_path / "c.kdump").call(0)


def test_auto_keeps_a_cpu_recorded_generic_call_on_the_cpu(tmp_path, monkeypatch) -> None:
    call = _cpu_call(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", call, generic=True) == torch.device("cpu")
    assert resolve_device("auto", call, generic=False) == torch.device("cuda")


def test_auto_without_a_gpu_is_the_cpu(tmp_path, monkeypatch) -> None:
    call = _cpu_call(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", call, generic=False) == torch.device("cpu")
    with pytest.raises(Exception, match="no CUDA GPU"):
        resolve_device("cuda", call, generic=False)
