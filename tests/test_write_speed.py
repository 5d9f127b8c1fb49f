"""The per-process caches of the write path keep the facts a bundle records right."""

from __future__ import annotations

import os

import torch

from kdump import envinfo
from kdump.bundle import capture_call, load_bundle, save_calls, writer


def test_process_facts_are_cached_but_rank_follows_the_environment(monkeypatch) -> None:
    first = envinfo.collect(include_gpu=False)
    first["platform"] = "changed by the caller"  # a caller's edit must not reach the cache
    again = envinfo.collect(include_gpu=False)
    assert again["pid"] == os.getpid()
    assert again["platform"] != "changed by the caller"
    monkeypatch.setenv("RANK", "3")
    assert envinfo.current_rank() == 3
    assert envinfo.collect(include_gpu=False)["ranks"]["rank"] == 3
    monkeypatch.setenv("RANK", "5")
    assert envinfo.collect(include_gpu=False)["ranks"]["rank"] == 5


def test_facts_are_recollected_in_a_new_process(monkeypatch) -> None:
    envinfo.collect(include_gpu=False)
    monkeypatch.setattr(envinfo.os, "getpid", lambda: 424242)
    assert envinfo.collect(include_gpu=False)["pid"] == 424242


def test_small_and_large_inline_bundles_round_trip(tmp_path) -> None:
    gen = torch.Generator(device="cpu").manual_seed(7)
    small = torch.randn(64, 33, generator=gen, device="cpu")
    n = writer.INLINE_HASH_MAX // 4 + 1024  # just over the pipelined writer's threshold
    large = torch.randn(n, generator=gen, device="cpu")
    for name, tensors in (("small", [small, small[3:]]), ("large", [large, small])):
        path = save_calls(tmp_path / f"{name}.kdump", [capture_call("m:f", tensors)])
        got = load_bundle(path).calls[0].materialize("cpu").tensors
        assert len(got) == len(tensors)
        for g, want in zip(got, tensors):
            assert torch.equal(g, want)
            assert g.storage_offset() == want.storage_offset()
