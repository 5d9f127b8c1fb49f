"""Patching: every call path sglang / vLLM / DeepGEMM use, aliases, idempotence, reversal."""

from __future__ import annotations

import binascii
import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.errors import UsageError
from kdump.kernels.deepgemm import state as deepgemm_state
from kdump.record.hooks import PatchSet, is_hook, parse_target, parse_targets

STANDINS = Path(__file__).parent / "standins"
STANDIN_MODULES = (
    "deep_gemm",
    "deep_gemm._C",
    "sglang_like",
    "vllm_like",
    "fromimport_like",
    "plainmod",
    "copier",
    "dg_inputs",
)


@pytest.fixture
def standins():
    """The stand-in modules, importable for this test only and freshly imported each time."""
    sys.path.insert(0, str(STANDINS))
    for m in STANDIN_MODULES:
        sys.modules.pop(m, None)

    deepgemm_state.reset()
    yield
    sys.path.remove(str(STANDINS))
    for m in STANDIN_MODULES:
        sys.modules.pop(m, None)
    deepgemm_state.reset()


def _inputs(seed: int = 0):
    from dg_inputs import make_contiguous

    return make_contiguous(seed)


def _expected_d(a, b, d, layout):
    import deep_gemm._C as C

    ref = d.clone()
    C._grouped_contiguous(a, b, ref, layout)
    return ref


def _returned(call):
    """The recorded return value (a tensor) of a loaded call."""
    from kdump.bundle.materialize import materialize

    tree = call.entry.outputs.returned
    mat = materialize(
        call.output_storages,
        call.output_tensors,
        lambda i: call._bundle.read_blob(call.output_storages[i].blob),
    )
    return mat.tensors[tree["$tensor"]]


def _check_bundle(path: Path, inputs, d_after, target: str, called_as: str) -> None:
    a, b, d_before, layout = inputs
    call = load_bundle(path).calls[0]
    assert call.target == target
    assert call.called_as == called_as
    args = call.args
    assert torch.equal(args[0][0].view(torch.uint8), a[0].view(torch.uint8))
    assert torch.equal(args[0][1], a[1])
    assert torch.equal(args[1][0].view(torch.uint8), b[0].view(torch.uint8))
    assert torch.equal(args[2], d_before)  # d as it was BEFORE the call
    assert torch.equal(args[3], layout)
    assert torch.equal(call.outputs["d"], d_after)  # and after
    assert call.names[:4] == ["a", "b", "d", "grouped_layout"]


def test_sglang_attribute_lookup_at_call_time(standins, tmp_path):
    import sglang_like

    a, b, d, layout = _inputs()
    d_before = d.clone()
    expected = _expected_d(a, b, d, layout)
    with kdump.recording("deep_gemm", out=tmp_path) as rec:
        sglang_like.moe_gemm(a, b, d, layout)
    assert torch.equal(d, expected)
    assert len(rec.written) == 1
    with pytest.raises(ValueError):  # pybind-like: no signature; names come from the spec
        inspect.signature(sys.modules["deep_gemm._C"].m_grouped_fp8_fp4_gemm_nt_contiguous)
    _check_bundle(
        rec.written[0],
        (a, b, d_before, layout),
        d,
        "deep_gemm:m_grouped_fp8_gemm_nt_contiguous",
        "deep_gemm:m_grouped_fp8_gemm_nt_contiguous",
    )


@pytest.mark.parametrize("cached_before", [True, False])
def test_vllm_function_cached_in_module_globals(standins, tmp_path, cached_before):
    import deep_gemm
    import vllm_like

    original = deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous
    a, b, d, layout = _inputs(1)
    if cached_before:
        vllm_like._lazy_init()  # the raw function is now cached in vllm_like's globals
        assert vllm_like._grouped_impl is original
    with kdump.recording("deep_gemm", out=tmp_path) as rec:
        vllm_like.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout)
        assert is_hook(vllm_like._grouped_impl)
    assert len(rec.written) == 1
    call = load_bundle(rec.written[0]).calls[0]
    assert call.target == "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
    expected_name = (
        "vllm_like:_grouped_impl"
        if cached_before
        else "deep_gemm:m_grouped_fp8_fp4_gemm_nt_contiguous"
    )
    assert call.called_as == expected_name
    assert vllm_like._grouped_impl is original  # unpatched: the cache holds the original again


def test_from_import_copies_before_and_after_start(standins, tmp_path):
    import fromimport_like  # copied the function before recording starts

    a, b, d, layout = _inputs(2)
    with kdump.recording("deep_gemm", out=tmp_path) as rec:
        fromimport_like.run(a, b, d, layout)
        sys.modules.pop("copier", None)
        import plainmod

        # plainmod was loaded before: copier, imported now, copies the patched function.
        with kdump.recording("plainmod:axpy", out=tmp_path / "p") as rec2:
            import copier

            assert is_hook(copier.my_axpy)
            x, y = torch.randn(5), torch.randn(5)
            copier.my_axpy(1.5, x, y)
        assert copier.my_axpy is plainmod.axpy and not is_hook(plainmod.axpy)
    assert [load_bundle(p).calls[0].called_as for p in rec.written] == [
        "fromimport_like:grouped_gemm"
    ]
    assert len(rec2.written) == 1


def test_target_module_imported_after_recording_starts(standins, tmp_path):
    assert "plainmod" not in sys.modules
    with kdump.recording(["plainmod:axpy", "copier:my_axpy"], out=tmp_path) as rec:
        import copier  # imports plainmod: both patched by the import hook

        x, y = torch.randn(6), torch.randn(6)
        y0 = y.clone()
        ret = copier.my_axpy(0.25, x, y)
    assert len(rec.written) == 1  # one function object: recorded once
    call = load_bundle(rec.written[0]).calls[0]
    assert call.target == "plainmod:axpy"
    assert torch.equal(call.args[2], y0)
    assert torch.equal(_returned(call), ret)  # the return value is recorded too
    assert not any(type(f).__name__ == "_ImportWatcher" for f in sys.meta_path)


def test_alias_pair_recorded_once_per_call(standins, tmp_path):
    import deep_gemm

    assert deep_gemm.m_grouped_fp8_gemm_nt_contiguous is (
        deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous
    )
    with kdump.recording("deep_gemm", out=tmp_path) as rec:
        for name in ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_contiguous"):
            a, b, d, layout = _inputs(3)
            getattr(deep_gemm, name)(a, b, d, layout)
    calls = [load_bundle(p).calls[0] for p in rec.written]
    assert [c.meta["call_index"] for c in calls] == [0, 1]  # one counter for both names
    assert {c.target for c in calls} == {"deep_gemm:m_grouped_fp8_gemm_nt_contiguous"}
    assert [c.called_as.split(":")[1] for c in calls] == [
        "m_grouped_fp8_gemm_nt_contiguous",
        "m_grouped_fp8_fp4_gemm_nt_contiguous",
    ]


def test_nested_hooked_calls_record_only_the_outer(standins, tmp_path):
    import vllm_like

    a, b, d, layout = _inputs(4)
    with kdump.recording(
        ["deep_gemm", "vllm_like:m_grouped_fp8_gemm_nt_contiguous"], out=tmp_path
    ) as rec:
        vllm_like.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout)
    assert [load_bundle(p).calls[0].target for p in rec.written] == [
        "vllm_like:m_grouped_fp8_gemm_nt_contiguous"
    ]


def test_patching_is_idempotent_and_reversible(standins, tmp_path):
    import deep_gemm
    import deep_gemm._C as C
    import fromimport_like
    import vllm_like

    vllm_like._lazy_init()
    original = C.m_grouped_fp8_fp4_gemm_nt_contiguous
    specs = parse_targets(["deep_gemm"])
    ps = PatchSet(specs, lambda *a: None, lambda *a: None)
    ps.patch()
    ps.patch()  # twice: still one wrapper around the original
    for holder, name in [
        (deep_gemm, "m_grouped_fp8_gemm_nt_contiguous"),
        (deep_gemm, "m_grouped_fp8_fp4_gemm_nt_contiguous"),
        (C, "m_grouped_fp8_fp4_gemm_nt_contiguous"),
        (fromimport_like, "grouped_gemm"),
        (vllm_like, "_grouped_impl"),
    ]:
        value = getattr(holder, name)
        assert is_hook(value) and value.__wrapped__ is original, (holder, name)
    assert is_hook(deep_gemm.set_num_sms)
    ps.unpatch()
    assert deep_gemm.m_grouped_fp8_gemm_nt_contiguous is original
    assert deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous is original
    assert C.m_grouped_fp8_fp4_gemm_nt_contiguous is original
    assert fromimport_like.grouped_gemm is original
    assert vllm_like._grouped_impl is original
    assert not is_hook(deep_gemm.set_num_sms)


def test_two_sessions_cannot_record_one_target(standins, tmp_path):
    import copier
    import plainmod

    with kdump.recording("plainmod:axpy", out=tmp_path):
        kdump.recording("plainmod:cheap", out=tmp_path).stop()  # another target: fine
        for target in ("plainmod:axpy", "copier:my_axpy"):
            with pytest.raises(UsageError, match="already being recorded"):
                kdump.recording(target, out=tmp_path)
        assert is_hook(plainmod.axpy) and is_hook(copier.my_axpy)  # the first session's hooks
    assert not is_hook(plainmod.axpy) and not is_hook(copier.my_axpy)


def test_builtin_without_signature(standins, tmp_path):
    import plainmod

    data = bytes(range(200))
    expected = binascii.crc_hqx(data, 7)
    with kdump.recording("plainmod:crc", out=tmp_path) as rec:
        got = plainmod.crc(data, 7)
        assert is_hook(binascii.crc_hqx)  # the same object in binascii: patched there too
    assert got == expected
    assert binascii.crc_hqx(data, 7) == expected and not is_hook(binascii.crc_hqx)
    call = load_bundle(rec.written[0]).calls[0]
    assert call.names == ["data", "crc"]  # from the builtin's text signature
    assert call.args[1] == 7
    assert call.entry.outputs.returned == expected


def test_methods_and_static_methods(standins, tmp_path):
    import plainmod

    layer = plainmod.Layer(1.5)
    x = torch.randn(3, 4)
    with kdump.recording(
        ["plainmod:Layer.forward", "plainmod:Layer.static_add"], out=tmp_path
    ) as rec:
        y = layer.forward(x)
        z = plainmod.Layer.static_add(x, x)
        z2 = layer.static_add(x, y)
    assert torch.equal(y, x * 1.5) and torch.equal(z, x + x) and torch.equal(z2, x + y)
    targets = sorted(load_bundle(p).calls[0].target for p in rec.written)
    assert targets == ["plainmod:Layer.forward", *["plainmod:Layer.static_add"] * 2]
    assert isinstance(vars(plainmod.Layer)["static_add"], staticmethod)
    assert not is_hook(vars(plainmod.Layer)["static_add"].__func__)


# torch.ops: an operator defined here with torch.library.
_LIB = torch.library.Library("kdumptest", "FRAGMENT")
_LIB.define("scale(Tensor x, float s) -> Tensor")
_LIB.impl("scale", lambda x, s: x * s, "CompositeExplicitAutograd")


def test_torch_ops_operator(tmp_path):
    packet = torch.ops.kdumptest.scale
    x = torch.randn(7)
    with kdump.recording("torch.ops.kdumptest.scale", out=tmp_path) as rec:
        y1 = torch.ops.kdumptest.scale(x, 2.0)
        y2 = torch.ops.kdumptest.scale.default(x, 3.0)
    assert torch.equal(y1, x * 2.0) and torch.equal(y2, x * 3.0)
    assert torch.ops.kdumptest.scale is packet  # restored
    calls = [load_bundle(p).calls[0] for p in rec.written]
    assert [c.called_as for c in calls] == [
        "torch.ops.kdumptest.scale",
        "torch.ops.kdumptest.scale.default",
    ]
    assert {c.target for c in calls} == {"torch.ops.kdumptest:scale"}
    assert torch.equal(calls[0].args[0], x) and calls[0].args[1] == 2.0


@pytest.mark.parametrize(
    ("text", "module", "qualname", "canonical"),
    [
        ("pkg.mod:f", "pkg.mod", "f", "pkg.mod:f"),
        ("pkg.mod:Cls.meth", "pkg.mod", "Cls.meth", "pkg.mod:Cls.meth"),
        ("torch.ops.mylib.op", "torch.ops.mylib", "op", "torch.ops.mylib:op"),
        (
            "vllm.third_party.deep_gemm:fp8_m_grouped_gemm_nt_masked",
            "vllm.third_party.deep_gemm",
            "fp8_m_grouped_gemm_nt_masked",
            "deep_gemm:m_grouped_fp8_gemm_nt_masked",
        ),
    ],
)
def test_parse_target(text, module, qualname, canonical):
    (spec,) = parse_target(text)
    assert (spec.module, spec.qualname, spec.id) == (module, qualname, canonical)


@pytest.mark.parametrize("bad", ["nocolon", "m:", ":f", "m:1bad", "torch.ops.x.y.z", ""])
def test_parse_target_rejects(bad):
    with pytest.raises(UsageError):
        parse_targets([bad])


def test_deep_gemm_preset_covers_entry_points_and_setters():
    from kdump.kernels.deepgemm import names

    specs = parse_targets(["deep_gemm"])
    texts = {s.text for s in specs}
    for mod in names.DEEPGEMM_MODULES:
        for canon, aliases in names.DEEPGEMM_ENTRY_POINTS.items():
            assert {f"{mod}:{n}" for n in (canon, *aliases)} <= texts
        assert {f"{mod}:{s}" for s in names.DEEPGEMM_SETTERS} <= texts
    assert all(s.optional for s in specs)
    assert {s.kind for s in specs if s.qualname.startswith("set_")} == {"setter"}


def test_import_of_unrelated_modules_is_untouched(standins, tmp_path):
    with kdump.recording("plainmod:axpy", out=tmp_path):
        mod = importlib.import_module("dg_inputs")  # not watched: loader untouched
        assert "exec_module" not in vars(mod.__spec__.loader)
