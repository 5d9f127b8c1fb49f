"""Today's DeepGEMM lines: binding by the runtime signature of the installed build (pybind
docstrings, Python wrappers over torch.ops), the FP4 aliases and the k-grouped FP4 entry point,
the `epilogue` argument, the k-grouped keywords, the new global setters and the locality-domain
calls, the DJ_JIT_* fallback, which build ran (the manifest), and the mega-MoE kernels recorded
with opaque pointers and refused for replay. Stand-ins shaped like each line's API, on the CPU."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from kdump import config
from kdump.bundle import capture_call, load_bundle, save_calls
from kdump.errors import ExitCode, UsageError
from kdump.format.argtree import Pointer
from kdump.kernels import registry
from kdump.kernels.deepgemm import build, names, signature, state
from kdump.kernels.deepgemm.contract import check_operands
from kdump.kernels.deepgemm.plugin import PLUGIN
from kdump.kernels.deepgemm.scales import pack_ue8m0
from kdump.replay import replay

FP8_CONTIG = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
SMALL = {"num_groups": 3, "n": 128, "k": 256, "expected_m": 40}

# upstream 2.8's pybind docstrings (the .pyi stub calls the last one `epilogue_class`)
UPSTREAM_CONTIG_DOC = (
    "a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], "
    "d: torch.Tensor, grouped_layout: torch.Tensor, recipe: typing.Optional[tuple["
    "typing.SupportsInt, typing.SupportsInt, typing.SupportsInt]] = None, recipe_a: "
    "typing.Optional[tuple[int, int]] = None, recipe_b: typing.Optional[tuple[int, int]] = None, "
    "compiled_dims: str = 'nk', disable_ue8m0_cast: bool = False, use_psum_layout: bool = False, "
    "ensure_zero_padding: bool = True, expected_m_for_psum_layout: typing.Optional[int] = None, "
    "epilogue: deep_gemm._C.epilogue.Epilogue = None"
)
UPSTREAM_KGROUPED_DOC = (
    "a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], d: "
    "torch.Tensor, ks_cpu: collections.abc.Sequence[int], grouped_layout: torch.Tensor, c: "
    "typing.Optional[torch.Tensor] = None, recipe: tuple[int, int, int] = (1, 1, 128), "
    "compiled_dims: str = 'mn', use_psum_layout: bool = False, "
    "epilogue: deep_gemm._C.epilogue.Epilogue = None"
)


class PybindFn:
    """Like a pybind11 function: inspect.signature fails, the signature is __doc__'s first line."""

    def __init__(self, name: str, params: str, impl: Any = None) -> None:
        self.__name__ = name
        self.__qualname__ = name
        self.__doc__ = f"{name}({params}) -> None\n\nA DeepGEMM kernel.\n"
        self._impl = impl

    @property
    def __signature__(self) -> Any:
        raise ValueError(f"no signature found for builtin {self.__name__}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl(*args, **kwargs) if self._impl is not None else None


def sgl_k_grouped(
    a,
    b,
    d,
    ks,
    grouped_layout,
    c=None,
    recipe=(1, 1, 128),
    compiled_dims="mn",
    use_psum_layout=False,
    use_padded_sf_layout=False,
):
    """sgl-deep-gemm's Python wrapper (its last keyword where upstream has `epilogue`)."""


# --- runtime signatures ------------------------------------------------------------------------


def test_pybind_docstring_is_the_signature() -> None:
    fn = PybindFn("m_grouped_fp8_fp4_gemm_nt_contiguous", UPSTREAM_CONTIG_DOC)
    sig = signature.runtime_signature(fn)
    assert sig is not None and sig.source == "pybind"
    assert sig.positional_names() == names.deepgemm_params("m_grouped_fp8_gemm_nt_contiguous")
    defaults = {p.name: p.default for p in sig.params}
    assert defaults["compiled_dims"] == "'nk'" and defaults["a"] is None
    kg = signature.runtime_signature(
        PybindFn("k_grouped_fp8_gemm_tn_contiguous", UPSTREAM_KGROUPED_DOC)
    )
    assert kg is not None and kg.positional_names()[3] == "ks_cpu"
    assert {p.name: p.default for p in kg.params}["recipe"] == "(1, 1, 128)"  # commas kept


def test_pybind_overloads_keyword_only_and_python_docstrings() -> None:
    doc = "set_block_size_multiple_of(*args, **kwargs)\nOverloaded function.\n\n"
    doc += "1. set_block_size_multiple_of(value: int) -> None\n\n"
    doc += "2. set_block_size_multiple_of(value: tuple[int, int]) -> None\n"
    fn = PybindFn("set_block_size_multiple_of", "")
    fn.__doc__ = doc
    assert signature.positional_names(fn) == ("value",)
    parsed = signature.parse_pybind_signature(
        "f(a: int, *, b: str = 'x,y', c: dict[str, int] = {})"
    )
    assert parsed is not None and parsed.positional_names() == ("a",)
    assert [p.default for p in parsed.params] == [None, "'x,y'", "{}"]

    def wrapper(a, b, d):
        """m_grouped_fp8_gemm_nt_contiguous(x, y) -- a Python docstring never counts"""

    assert signature.runtime_signature(wrapper).positional_names() == ("a", "b", "d")


_LIB: list[Any] = []


def _torch_ops_line() -> types.ModuleType:
    """sgl-kernel's shape: Python shims forwarding *args to torch.ops.<ns>.<op>, whose schema
    takes the FP8 operands split (a, sfa, b, sfb)."""
    ns = "kdump_dglines"
    if not _LIB:
        lib = torch.library.Library(ns, "DEF")
        lib.define(
            "m_grouped_fp8_gemm_nt_contiguous(Tensor a, Tensor sfa, Tensor b, Tensor sfb, "
            "Tensor(d!) d, Tensor grouped_layout, int[]? recipe=None, str compiled_dims='nk', "
            "bool disable_ue8m0_cast=False, float alpha=1.0) -> ()"
        )
        lib.impl("m_grouped_fp8_gemm_nt_contiguous", lambda *a: None, "CPU")
        _LIB.append(lib)

    def wrap(name: str) -> Any:
        func = getattr(getattr(torch.ops, ns), name)

        def _fn(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        return _fn

    mod = types.ModuleType("deep_gemm")
    mod.m_grouped_fp8_gemm_nt_contiguous = wrap("m_grouped_fp8_gemm_nt_contiguous")
    return mod


def test_python_shim_over_torch_ops_reads_the_schema() -> None:
    mod = _torch_ops_line()
    sig = signature.runtime_signature(mod.m_grouped_fp8_gemm_nt_contiguous)
    assert sig is not None and sig.source == "python over torch.ops"
    assert sig.positional_names()[:6] == ("a", "sfa", "b", "sfb", "d", "grouped_layout")
    op = torch.ops.kdump_dglines.m_grouped_fp8_gemm_nt_contiguous
    assert signature.runtime_signature(op).source == "torch.ops"
    assert PLUGIN.param_names(FP8_CONTIG, mod.m_grouped_fp8_gemm_nt_contiguous) == (
        sig.positional_names()
    )


def test_a_kdump_hook_is_read_through() -> None:
    from kdump.kernels.plugin import TargetSpec
    from kdump.record.hooks import HookState, make_call_wrapper

    fn = PybindFn("m_grouped_fp8_fp4_gemm_nt_contiguous", UPSTREAM_CONTIG_DOC)
    st = HookState(TargetSpec("deep_gemm", fn.__name__, FP8_CONTIG), fn, lambda *a: None)
    hooked = make_call_wrapper(st, fn.__name__, fn)
    assert signature.positional_names(hooked)[-1] == "epilogue"


# --- binding by the runtime's names ------------------------------------------------------------


def _no_deep_gemm_loaded(monkeypatch) -> None:
    for name in names.DEEPGEMM_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_split_operands_bind_as_pairs_and_satisfy_the_contract(monkeypatch) -> None:
    _no_deep_gemm_loaded(monkeypatch)
    spec = registry.spec_for(FP8_CONTIG)
    args, _ = spec.generate(seed=1, **SMALL)
    (a, sfa), (b, sfb), d, layout = args
    split = [a, sfa, b, sfb, d, layout]
    assert spec.validate(spec.bind(split, {}))  # by upstream's table the split call is wrong
    monkeypatch.setitem(sys.modules, "deep_gemm", _torch_ops_line())
    bound = spec.bind(split, {"alpha": 1.0})  # a keyword of this build, kept as given
    assert bound["a"][0] is a and bound["a"][1] is sfa and bound["b"][1] is sfb
    assert bound["alpha"] == 1.0 and spec.validate(bound) == []
    names_ = signature.positional_names(sys.modules["deep_gemm"].m_grouped_fp8_gemm_nt_contiguous)
    recorded = spec.with_names(names_)  # the bundle's names win over the live build's
    monkeypatch.delitem(sys.modules, "deep_gemm")
    assert recorded.bind(split, {})["a"][1] is sfa
    with pytest.raises(UsageError, match="unexpected argument 'bogus'"):
        recorded.bind(split, {"bogus": 1})


def test_k_grouped_tail_binds_by_each_line_order(monkeypatch) -> None:
    _no_deep_gemm_loaded(monkeypatch)
    spec = registry.spec_for("deep_gemm:k_grouped_fp8_gemm_tn_contiguous")
    d = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    layout = torch.tensor([256, 128], dtype=torch.int32)
    a = (torch.zeros(384, 128, dtype=torch.float8_e4m3fn), torch.ones(3, 128))
    tail = [a, a, d, [256, 128], layout, None, (1, 1, 128), "mn", False, True]
    sgl = spec.with_names(signature.positional_names(sgl_k_grouped)).bind(tail, {})
    assert sgl["use_padded_sf_layout"] is True and sgl["epilogue"] is None
    assert spec.validate(sgl) == []
    fake = types.ModuleType("deep_gemm")
    fake.k_grouped_fp8_gemm_tn_contiguous = PybindFn(
        "k_grouped_fp8_gemm_tn_contiguous", UPSTREAM_KGROUPED_DOC
    )
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    up = spec.bind(tail, {})  # the loaded build: upstream, ks_cpu and epilogue
    assert up["ks"] == [256, 128] and up["epilogue"] is True and up["use_padded_sf_layout"] is False


def test_a_call_recorded_in_another_argument_order_is_refused_not_misplaced(monkeypatch) -> None:
    """Recorded on sgl-deep-gemm, replayed through an upstream build: position 9 is
    use_padded_sf_layout there and epilogue here, so passing it on by position would misplace
    it; the backend says so in one line (cannot run) before launching anything."""
    from kdump.errors import CannotRunError
    from kdump.kernels.deepgemm.backend import _same_order

    _no_deep_gemm_loaded(monkeypatch)
    spec = registry.spec_for("deep_gemm:k_grouped_fp8_gemm_tn_contiguous")
    recorded = spec.with_names(signature.positional_names(sgl_k_grouped))
    upstream = PybindFn("k_grouped_fp8_gemm_tn_contiguous", UPSTREAM_KGROUPED_DOC)
    _same_order(recorded, upstream, 5)  # a, b, d, ks, grouped_layout: the same places
    with pytest.raises(CannotRunError, match="argument 9: use_padded_sf_layout there, epilogue"):
        _same_order(recorded, upstream, 10)
    _same_order(recorded, sgl_k_grouped, 10)  # the recording build itself


def test_k_grouped_keywords_and_old_names() -> None:
    spec = registry.spec_for("deep_gemm:k_grouped_fp8_gemm_nt_contiguous")
    d = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    layout = torch.tensor([128, 256], dtype=torch.int32)
    bound = spec.bind([None, None, d], {"ks_cpu": [128, 128], "ks_tensor": layout})
    assert bound["ks"] == [128, 128] and bound["grouped_layout"] is layout
    assert bound["recipe"] == (1, 1, 128) and bound["compiled_dims"] == "mn"
    assert spec.validate(bound) == []
    bad = dict(bound, ks=[128], use_padded_sf_layout="yes")
    messages = " | ".join(str(v) for v in spec.validate(bad))
    assert (
        "ks: 1 groups, d has 2" in messages and "use_padded_sf_layout: expected a bool" in messages
    )
    no_ks = dict(bound, ks=None)
    assert "use_psum_layout=True" in str(spec.validate(no_ks))
    assert spec.validate(dict(no_ks, use_psum_layout=True)) == []
    fp4 = registry.spec_for("deep_gemm:k_grouped_fp4_gemm_nt_contiguous")
    assert fp4.id == "deep_gemm:k_grouped_fp4_gemm_nt_contiguous"  # its own entry point
    assert fp4.bind([None, None, d, [64, 64], layout], {})["recipe"] == (1, 1, 32)


# --- FP4 aliases -------------------------------------------------------------------------------


def test_fp4_names_alias_the_m_grouped_entry_points() -> None:
    for alias, canon in (
        ("m_grouped_fp4_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_contiguous"),
        ("m_grouped_fp4_gemm_nt_masked", "m_grouped_fp8_gemm_nt_masked"),
    ):
        assert registry.canonical_id(f"deep_gemm:{alias}") == f"deep_gemm:{canon}"
        assert registry.canonical_id(f"vllm.third_party.deep_gemm.{alias}") == f"deep_gemm:{canon}"
        assert registry.spec_for(f"deep_gemm:{alias}").id == f"deep_gemm:{canon}"
    texts = {t.text for t in PLUGIN.presets()["deep_gemm"]}
    new_names = (
        *("m_grouped_fp4_gemm_nt_contiguous", "m_grouped_fp4_gemm_nt_masked"),
        *("k_grouped_fp4_gemm_nt_contiguous", "fp8_fp4_mega_moe", "bf16_mega_moe"),
        *("set_block_size_multiple_of", "use_deterministic_algorithms", "localize"),
    )
    for fn in new_names:
        assert f"deep_gemm:{fn}" in texts


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _fp4(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 [.., K/2] with the even element in the low nibble, float64 values)."""
    codes = torch.randint(0, 16, shape, generator=gen)
    mag = E2M1[codes & 7]
    values = torch.where((codes & 8) != 0, -mag, mag)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, values


def _per32_scales(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    sf = torch.exp2(torch.randint(-2, 3, shape, generator=gen).float())
    return pack_ue8m0(sf), sf.double()


@pytest.mark.parametrize("a_kind", ["fp4", "fp8"])
def test_fp4_operands_pass_the_contract_and_the_reference_dequantises_them(a_kind) -> None:
    gen = torch.Generator().manual_seed(3)
    m, n, k, groups = 256, 64, 256, 2
    if a_kind == "fp4":
        a, av = _fp4(gen, m, k)
    else:
        av = (torch.randn(m, k, generator=gen) * 2).to(torch.float8_e4m3fn)
        a, av = av, av.double()
    sfa, sfa_v = _per32_scales(gen, m, k // 32)
    b, bv = _fp4(gen, groups, n, k)
    sfb, sfb_v = _per32_scales(gen, groups, n, k // 32)
    layout = torch.tensor([0] * 128 + [1] * 128, dtype=torch.int32)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    spec = registry.spec_for("deep_gemm:m_grouped_fp4_gemm_nt_contiguous")
    bound = spec.bind([(a, sfa), (b, sfb), d, layout], {})
    assert spec.validate(bound) == []
    got = spec.reference(bound)["d"].double()
    deq_a = av * sfa_v.repeat_interleave(32, dim=1)
    deq_b = bv * sfb_v.repeat_interleave(32, dim=2)
    want = torch.cat([deq_a[:128] @ deq_b[0].T, deq_a[128:] @ deq_b[1].T])
    assert torch.allclose(got, want.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-3)
    # kdump's packaged kernel implements FP8 only: its structural contract still says so
    assert any("expected float8_e4m3fn" in str(v) for v in check_operands(spec.function, bound))
    half_k = dict(bound, a=(a[:, : a.shape[1] // 2], sfa))
    assert "packed FP4: two values a byte" in str(spec.validate(half_k))


# --- the epilogue ------------------------------------------------------------------------------


def _saved(tmp_path: Path, name: str, target: str, args, kwargs, names_=None) -> Path:
    path = tmp_path / f"{name}.kdump"
    save_calls(path, [capture_call(target, args, kwargs, names=names_)])
    return path


def test_epilogue_is_recorded_as_given_and_a_plain_one_binds(tmp_path) -> None:
    spec = registry.spec_for(FP8_CONTIG)
    args, _ = spec.generate(seed=2, **SMALL)
    path = _saved(tmp_path, "plain", FP8_CONTIG, args, {"epilogue": "identity"}, spec.param_names())
    call = load_bundle(path).calls[0]
    assert call.kwargs["epilogue"] == "identity"
    bound = spec.bind(call.args, call.kwargs)
    assert spec.refusal(bound) is None and spec.validate(bound) == []
    assert spec.bind(args, {"epilogue_class": None})["epilogue"] is None  # the stub's name


def test_callable_epilogue_is_refused_with_one_line(tmp_path) -> None:
    spec = registry.spec_for(FP8_CONTIG)
    args, _ = spec.generate(seed=2, **SMALL)
    path = _saved(tmp_path, "callable", FP8_CONTIG, args, {"epilogue": lambda x: x * 2})
    call = load_bundle(path).calls[0]
    for bound in (
        spec.bind(call.encoded_args, call.encoded_kwargs),
        spec.bind(call.args, call.kwargs),
    ):
        why = spec.refusal(bound)
        assert why is not None and "Python callable as its epilogue" in why and "\n" not in why
    [v] = replay([path], device="cpu", backend="reference")
    assert v.exit_code == ExitCode.CANNOT_RUN, v.headline()
    assert any("callable as its epilogue" in f.message for f in v.findings)
    alpha = {"$opaque": "deep_gemm._C.epilogue.Alpha", "repr": "<Alpha>"}
    opaque = spec.refusal(spec.bind(args, {"epilogue": alpha}))
    assert opaque is not None and "cannot rebuild" in opaque


# --- mega-MoE ----------------------------------------------------------------------------------

# the names of the binding below the Python API (the symmetric buffer passed as its parts)
MEGA_C_NAMES = [
    *("y", "l1_weights", "l1_weights_sf", "l2_weights", "l2_weights_sf"),
    *("cumulative_local_expert_recv_stats", "sym_buffer", "sym_buffer_ptrs", "rank_idx"),
    *("num_max_tokens_per_rank", "num_experts", "num_topk"),
]


def test_mega_moe_records_opaque_pointers_and_refuses_replay(tmp_path) -> None:
    [target] = [t for t in PLUGIN.presets()["deep_gemm"] if t.text == "deep_gemm:fp8_fp4_mega_moe"]
    assert target.pointer_params == ("sym_buffer_ptrs",) and target.output_names == ("y",)
    y = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.zeros(2, 8, 8, dtype=torch.int8)
    ptrs = [Pointer(0x7F3A_0000_0000), Pointer(0x7F3B_0000_0000)]
    args = [
        y,
        w,
        w.float(),
        w,
        w.float(),
        None,
        torch.zeros(64, dtype=torch.int8),
        ptrs,
        0,
        4,
        2,
        1,
    ]
    mega = "deep_gemm:fp8_fp4_mega_moe"
    path = _saved(tmp_path, "mega", mega, args, {}, MEGA_C_NAMES)
    call = load_bundle(path).calls[0]
    assert call.encoded_args[7] == [{"$pointer": 0x7F3A_0000_0000}, {"$pointer": 0x7F3B_0000_0000}]
    assert call.args[7] == ptrs
    spec = registry.spec_for(mega).with_names(call.names)
    why = spec.refusal(spec.bind(call.encoded_args, call.encoded_kwargs))
    assert "other ranks' symmetric memory" in why and "2 raw addresses" in why
    [v] = replay([path], device="cpu")
    assert v.exit_code == ExitCode.CANNOT_RUN, v.headline()
    assert any("symmetric memory" in f.message for f in v.findings)
    # the Python API's form: the symmetric buffer object, recorded by its repr
    symm = {"$opaque": "deep_gemm.mega.SymmBuffer", "repr": "<SymmBuffer>"}
    obj = spec.refusal(registry.spec_for(mega).bind([y, w, w, symm], {}))
    assert "symmetric buffer object" in obj


# --- setters, the locality domain, JIT settings and the build: recorded and re-applied --------


def _line_module(tmp_path: Path, deepjit: bool) -> tuple[types.ModuleType, dict[str, Any]]:
    """An upstream-2.8-shaped module (pybind setters and entry points) in a folder of its own,
    with an extension file that does (or does not) read DJ_JIT_* settings."""
    folder = tmp_path / "dg_line" / "deep_gemm"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    # DeepJIT composes DJ_JIT_<X> at run time: its binary holds its namespace, not the names
    jit = b"_ZN8deep_jit3Env3getE\0JIT_CACHE_DIR\0.dj\0" if deepjit else b"/.deep_gemm\0"
    (folder / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF\0DG_JIT_\0" + jit)
    st: dict[str, Any] = {"block": None, "deterministic": False, "localized": 0}
    spec = registry.spec_for(FP8_CONTIG)

    def gemm(a, b, d, grouped_layout, *rest, **kw):
        d.copy_(spec.reference(spec.bind([a, b, d, grouped_layout], {}))["d"])

    mod = types.ModuleType("deep_gemm")
    mod.__file__ = str(folder / "__init__.py")
    mod.__version__ = "2.8.0"
    mod.m_grouped_fp8_fp4_gemm_nt_contiguous = PybindFn(
        "m_grouped_fp8_fp4_gemm_nt_contiguous", UPSTREAM_CONTIG_DOC, gemm
    )
    mod.m_grouped_fp4_gemm_nt_contiguous = mod.m_grouped_fp8_fp4_gemm_nt_contiguous
    mod.set_block_size_multiple_of = PybindFn(
        "set_block_size_multiple_of", "value: int | tuple[int, int]", lambda v: st.update(block=v)
    )
    mod.use_deterministic_algorithms = PybindFn(
        "use_deterministic_algorithms", "enabled: bool", lambda v: st.update(deterministic=v)
    )
    mod.get_deterministic_algorithms = lambda: st["deterministic"]
    mod.get_num_locality_domains = lambda: 2

    def localize(t: torch.Tensor, dim: int = -2) -> torch.Tensor:
        st["localized"] += 1
        return t

    mod.localize = localize
    mod.destroy_localizer = lambda: None
    return mod, st


def test_setters_locality_and_jit_recorded_then_reapplied(tmp_path, monkeypatch) -> None:
    import kdump

    mod, st = _line_module(tmp_path, deepjit=True)
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    monkeypatch.delenv("DG_JIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("DJ_JIT_CACHE_DIR", str(tmp_path / "dj-cache"))
    state.reset()
    spec = registry.spec_for(FP8_CONTIG)
    args, _ = spec.generate(seed=5, **SMALL)
    with kdump.recording("deep_gemm", out=tmp_path / "out") as rec:
        mod.set_block_size_multiple_of((16, 32))
        mod.use_deterministic_algorithms(True)
        mod.localize(args[1][0], dim=-2)
        mod.destroy_localizer()
        mod.m_grouped_fp4_gemm_nt_contiguous(*args)
    [path] = rec.written
    bundle = load_bundle(path)
    lib = bundle.env["libraries"]["deep_gemm"]
    assert lib["setters"]["set_block_size_multiple_of"] == [16, 32]
    assert lib["deterministic_algorithms"] is True and lib["locality_domains"] == 2
    local = lib["setters"]["localize"]
    assert local["calls"] == 1 and local["last"]["dim"] == -2
    assert local["last"]["tensor"]["shape"] == list(args[1][0].shape)
    assert lib["jit"]["line"] == "deepjit" and lib["api"] == "pybind"
    assert lib["jit"]["settings"]["CACHE_DIR"] == {
        "value": str(tmp_path / "dj-cache"),
        "from": "DJ_JIT_CACHE_DIR",
    }
    assert bundle.env["env_vars"]["DJ_JIT_CACHE_DIR"] == str(tmp_path / "dj-cache")
    call = bundle.calls[0]
    assert call.target == FP8_CONTIG and call.called_as.endswith("m_grouped_fp4_gemm_nt_contiguous")

    st.update(block=None, deterministic=False)
    [v] = replay([path], device="cpu", backend="reference", isolate=False)
    assert v.exit_code == ExitCode.CLEAN, v.headline()
    assert st["block"] == (16, 32) and st["deterministic"] is True  # re-applied to the library
    notes = " | ".join(v.notes)
    assert "block_size_multiple_of=[16, 32]" in notes and "deterministic_algorithms=True" in notes
    assert "locality domains" in notes and "ordinary device memory" in notes
    state.reset()


def test_invalid_setting_values_are_noted_not_applied() -> None:
    notes = PLUGIN.apply_state(
        {"setters": {"set_block_size_multiple_of": [0, 32], "use_deterministic_algorithms": 3}},
        torch.device("cpu"),
    )
    text = " | ".join(notes)
    assert "block_size_multiple_of=[0, 32] not applied" in text
    assert "deterministic_algorithms=3 not applied" in text


def test_dj_jit_fallback_and_defaults() -> None:
    env = {"HOME": "/home/u", "DJ_JIT_CACHE_DIR": "/c/dj", "DJ_JIT_DEBUG": "1", "DG_JIT_DEBUG": "0"}
    got = config.deepgemm_jit_settings(True, env)
    assert got["CACHE_DIR"] == {"value": "/c/dj", "from": "DJ_JIT_CACHE_DIR"}
    assert got["DEBUG"] == {"value": "0", "from": "DG_JIT_DEBUG"}  # DG_ wins over DJ_
    assert config.deepgemm_jit_settings(True, {"HOME": "/home/u"})["CACHE_DIR"] == {
        "value": "/home/u/.dj",
        "from": "default",
    }
    legacy = config.deepgemm_jit_settings(False, env)  # no DJ_ fallback before DeepJIT
    assert legacy["CACHE_DIR"] == {"value": "/home/u/.deep_gemm", "from": "default"}
    assert "DJ_JIT_CACHE_DIR" in config.recorded_environment(env)


def test_jit_line_is_read_from_the_extension(tmp_path) -> None:
    new, _ = _line_module(tmp_path / "new", deepjit=True)
    old, _ = _line_module(tmp_path / "old", deepjit=False)
    assert build.jit_line(new) == "deepjit" and build.jit_line(old) == "legacy"
    assert build.jit_line(types.ModuleType("deep_gemm")) == "unknown"


# --- which build ran ---------------------------------------------------------------------------


def _install(
    site: Path,
    dist: str,
    version: str,
    module: str,
    files: bool = True,
    direct_url: dict | None = None,
) -> Path:
    """A minimal installed distribution of `module` in `site` (what pip leaves behind)."""
    pkg = site / module
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("__version__ = 'from-module'\n")
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{module}\n")
    record = f"{module}/__init__.py,,\n" if files else ""
    (info / "RECORD").write_text(record + f"{info.name}/METADATA,,\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    return pkg / "__init__.py"


def _fake_module(name: str, file: Path, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = str(file)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def test_build_facts_name_the_distribution_version_and_commit(tmp_path, monkeypatch) -> None:
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))
    sha = "1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d"
    url = {"url": "https://github.com/x/y", "vcs_info": {"vcs": "git", "commit_id": sha}}
    file = _install(site, "kdump-fake-sgl-line", "0.2.5", "kdump_fake_dg", direct_url=url)
    _install(site, "kdump-fake-other-line", "2.8.2", "kdump_fake_dg", files=False)
    facts = build.module_build(_fake_module("kdump_fake_dg", file))
    assert facts["distribution"] == "kdump-fake-sgl-line" and facts["version"] == "0.2.5"
    assert facts["commit"] == sha and facts["commit_from"] == "direct_url.json"
    assert facts["install"] == "wheel" and facts["file"] == str(file)
    assert build.describe(facts) == f"kdump-fake-sgl-line 0.2.5 (commit {sha[:12]})"
    attr = build.module_build(_fake_module("kdump_fake_dg", file, __commit__="abc1234"))
    assert attr["commit"] == "abc1234" and attr["commit_from"].endswith("__commit__")
    assert build.commit_in_version("0.1.5.post3+nv.g9f8e7d6") == "9f8e7d6"
    assert build.commit_in_version("0.1.5.post3") is None
    assert build.commit_in_version("2.8.2+cu128") is None
    assert build.same(facts, dict(facts, commit="ffffffffffff")) is False
    assert build.same(facts, dict(facts)) is True and build.same({}, facts) is None


def test_a_checkout_reports_its_head(tmp_path) -> None:
    repo = tmp_path / "DeepGEMM"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    sha = "0123456789abcdef0123456789abcdef01234567"
    (repo / ".git" / "refs" / "heads" / "main").write_text(sha + "\n")
    (repo / "deep_gemm").mkdir()
    file = repo / "deep_gemm" / "__init__.py"
    file.write_text("")
    facts = build.module_build(_fake_module("kdump_no_such_dist_dg", file))
    assert facts["install"] == "checkout" and facts["commit"] == sha
    assert facts["commit_from"] == f"git checkout {repo.resolve()}"
