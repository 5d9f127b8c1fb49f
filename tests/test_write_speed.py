"""The per-process caches of the write path keep the facts a bundle records right."""

from __future__ import annotations

import os

import torch

from kdump import envinfo
from kdump.bundle import (
    CallRecord,
    argtree,
    attach_outputs,
    capture_call,
    load_bundle,
    save_calls,
    writer,
)


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
    n = writer.INLINE_HASH_MAX // 4 + 1024  # just over the spooled writer's threshold
    large = torch.randn(n, generator=gen, device="cpu")
    for name, tensors in (("small", [small, small[3:]]), ("large", [large, small])):
        path = save_calls(tmp_path / f"{name}.kdump", [capture_call("m:f", tensors)])
        got = load_bundle(path).calls[0].materialize("cpu").tensors
        assert len(got) == len(tensors)
        for g, want in zip(got, tensors):
            assert torch.equal(g, want)
            assert g.storage_offset() == want.storage_offset()


# ---------------------------------------------------------------------------------------------
# Header templates (the sync recorder's small-bundle path)


def _calls_of_one_signature() -> list[CallRecord]:
    """Calls of one target and layout whose header values all differ: addresses (fresh tensors),
    argument values, contents shared or not (blob de-duplication), a long exception text, and a
    return value."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    calls = []
    for i in range(8):
        x = torch.randn(8, 4, generator=gen)
        out = x.clone() if i % 3 == 0 else torch.randn(8, 4, generator=gen)  # same bytes as x
        meta = {"call_index": i, "time_ns": 10**18 + i, "note": 'quote " and \\ é'}
        if i == 5:
            meta["exception"] = "E" * (2 * argtree.LIMITS.max_string)  # cut, as ever
        call = capture_call(
            "m:f",
            [x, i * 0.5, out],
            {"scale": i, "name": f"n{i}"},
            names=["x", "a", "out"],
            meta=meta,
        )
        after = out.mul_(2) if i % 2 else out
        attach_outputs(call, [x, after], [1], returned=(i, None))
        calls.append(call)
    return calls


def test_header_templates_write_what_the_ordinary_path_writes(tmp_path, monkeypatch) -> None:
    from kdump.bundle.header_cache import HeaderCache

    monkeypatch.setattr(writer, "_utc_now", lambda: "2026-01-01T00:00:00Z")
    cache = HeaderCache()
    env = {"python": "3.x", "libraries": {"lib": {"v": 1.0, "n": 1}}}
    for i, call in enumerate(_calls_of_one_signature()):
        info = {"recorder": "sync", "k": i}
        fast = save_calls(tmp_path / f"t{i}.kdump", [call], env=env, info=info, headers=cache)
        plain = save_calls(tmp_path / f"p{i}.kdump", [call], env=env, info=info)
        assert fast.read_bytes() == plain.read_bytes(), i
        load_bundle(fast).verify()
    # Two de-duplication patterns (x == out or not) by two output states: templates were used.
    assert cache.hits >= 4


def test_a_template_is_per_signature(tmp_path, monkeypatch) -> None:
    from kdump.bundle.header_cache import HeaderCache

    monkeypatch.setattr(writer, "_utc_now", lambda: "2026-01-01T00:00:00Z")
    cache = HeaderCache(max_entries=2)  # evictions too
    shapes = [(4, 4), (16,), (4, 4), (2, 8), (16,), (4, 4)]
    for i, shape in enumerate(shapes):
        x = torch.arange(16, dtype=torch.float32).reshape(shape) + i
        view = x.reshape(-1)[3:]  # a view with an offset: one storage, two tensors
        call = capture_call("m:g", [x, view], meta={"i": i})
        fast = save_calls(tmp_path / f"t{i}.kdump", [call], headers=cache)
        plain = save_calls(tmp_path / f"p{i}.kdump", [call])
        assert fast.read_bytes() == plain.read_bytes(), shape
        got = load_bundle(fast).calls[0].materialize("cpu").tensors
        assert torch.equal(got[0], x) and torch.equal(got[1], view)
        assert got[1].storage_offset() == 3


def test_the_manifest_encoder_is_json_dumps() -> None:
    import json
    import math

    from kdump.bundle.manifest import encode_json, escaped

    values = [
        {"a": [1, 2.5, None, True, 'é"\\\x00\x7f'], "b": {}},
        "x",
        3,
        [float("nan"), math.inf, 1e300, -0.0, 10**30],
        {1: 2, None: 3, 2.5: "q", False: 1},
        (1, (2,)),
    ]
    for v in values:
        text = json.dumps(v, separators=(",", ":"))
        assert encode_json(v) == text
        assert escaped(text) == json.dumps(text)[1:-1]


def test_recorded_small_calls_use_templates_and_stay_exact(tmp_path) -> None:
    import sys
    import types

    from tests.test_format_reader import read_call

    mod = types.ModuleType("kdump_template_target")

    def scale(x: torch.Tensor, out: torch.Tensor, k: float = 2.0) -> None:
        out.copy_(x * k)

    scale.__module__ = mod.__name__
    mod.scale = scale  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    import kdump

    x, out = torch.randn(64), torch.empty(64)
    with kdump.recording(f"{mod.__name__}:scale", out=tmp_path) as rec:
        for i in range(40):
            if i % 10 == 0:
                x = torch.randn(64)  # new addresses, same signature
            mod.scale(x, out, k=float(i))
    assert len(rec.written) == 40
    assert rec.recorder.headers.hits >= 30
    for i, p in enumerate(rec.written):
        bundle = load_bundle(p)
        bundle.verify()
        assert bundle.calls[0].meta["call_index"] == i
        _, kwargs, tensors = read_call(p, 0)  # the independent reader agrees
        assert kwargs == {"k": float(i)}
        assert torch.equal(tensors[0], bundle.calls[0].materialize("cpu").tensors[0])


def test_a_template_that_does_not_reproduce_its_header_is_not_kept(tmp_path, monkeypatch) -> None:
    from kdump.bundle import header_cache
    from kdump.bundle.manifest import Template

    wrong = Template("{{}}", ())
    monkeypatch.setattr(header_cache, "build_template", lambda *a: wrong)
    cache = header_cache.HeaderCache()
    for i, call in enumerate(_calls_of_one_signature()[:3]):
        fast = save_calls(tmp_path / f"t{i}.kdump", [call], headers=cache)
        load_bundle(fast).verify()
    assert cache.hits == 0
