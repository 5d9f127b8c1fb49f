"""CPU tests of the packaged grouped GEMM: NVRTC build, SASS, configs, cache, error paths."""

from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kdump.errors import CannotRunError, ContractViolation, ExitCode, InternalError
from kdump.kernels.sm120 import build, configs
from kdump.kernels.sm120.build import BuildRequest, PackagedKernelError


def _compiler_ready() -> str | None:
    try:
        import cuda.core  # noqa: F401

        build.nvrtc_version()
        build.cutlass_include_dir()
        build.cuda_include_dir()
    except (ImportError, PackagedKernelError) as exc:
        return str(exc)
    return None


_why_not = _compiler_ready()
needs_nvrtc = pytest.mark.skipif(_why_not is not None, reason=f"cannot compile: {_why_not}")


def _cuobjdump() -> str | None:
    spec = importlib.util.find_spec("nvidia")
    for loc in spec.submodule_search_locations if spec else []:
        exe = Path(loc) / "cu13" / "bin" / "cuobjdump"
        if exe.is_file():
            return str(exe)
    return shutil.which("cuobjdump")


# The default build of each architecture.
@pytest.fixture(scope="module", params=["sm_90a", "sm_120a"])
def cubin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    if _why_not is not None:
        pytest.skip(f"cannot compile: {_why_not}")
    arch = request.param
    cfg = configs.CONFIGS[90 if arch == "sm_90a" else 120]
    result = build.build_cubin(BuildRequest(arch, cfg), use_cache=False)
    path = tmp_path_factory.mktemp(request.param) / "grouped_gemm.cubin"
    path.write_bytes(result.cubin)
    print(f"{arch}: compiled in {result.seconds:.1f} s, {len(result.cubin)} bytes")
    return arch, path


def _sass(path: Path) -> str:
    exe = _cuobjdump()
    if exe is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    run = subprocess.run([exe, "-sass", str(path)], check=True, capture_output=True, text=True)
    return run.stdout


def _functions(sass: str) -> dict[str, str]:
    parts = re.split(r"\n\s*Function : (\S+)\n", sass)
    return dict(zip(parts[1::2], parts[2::2]))


def test_cubin_has_every_kernel_and_fp8_mma(cubin) -> None:
    arch, path = cubin
    funcs = _functions(_sass(path))
    assert set(build.KERNEL_NAMES) <= set(funcs), sorted(funcs)
    # sm_120a runs FP8 warp MMA natively (QMMA); sm_90a has none: the kernel unpacks the FP8
    # fragments itself and runs FP16 HMMAs that accumulate directly (no emulation FADDs).
    mma = "QMMA.16832.F32.E4M3.E4M3" if arch == "sm_120a" else "HMMA.16816.F32"
    for name in build.KERNEL_NAMES:
        if name.startswith("kd_gemm"):
            assert mma in funcs[name], f"{name} on {arch} lacks {mma}"
            assert "UTMALDG" in funcs[name], f"{name} on {arch} does not use TMA loads"
            assert "HGMMA" not in funcs[name] and "QGMMA" not in funcs[name], "no wgmma allowed"
            if arch == "sm_90a":
                assert "F2FP.F16.E4M3.UNPACK_B" in funcs[name]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_fp8_mma_only_where_native(arch: str) -> None:
    """The PTX asks for FP8 m16n8k32 MMAs only on sm_120a; on sm_90a ptxas would emulate them
    with zero-based FP16 MMAs and FADDs, so the kernel issues FP16 m16n8k16 ones itself."""
    if _why_not is not None:
        pytest.skip(f"cannot compile: {_why_not}")
    from cuda.bindings import nvrtc

    # NVRTC directly: cuda.core checks that the driver could load PTX, and CI has no driver.
    req = BuildRequest(arch, configs.CONFIGS[90 if arch == "sm_90a" else 120])
    opts = build._program_options(req).as_bytes("nvrtc")
    err, prog = nvrtc.nvrtcCreateProgram(build.kernel_source().encode(), b"g.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        buf = b" " * size
        (err,) = nvrtc.nvrtcGetPTX(prog, buf)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    text = buf.decode(errors="replace")
    fp8 = "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in text
    fp16 = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text
    assert (fp8, fp16) == ((False, True) if arch == "sm_90a" else (True, False))


def test_no_local_memory(cubin) -> None:
    arch, path = cubin
    sass = _sass(path)
    spills = re.findall(r"\b(LDL|STL)(\.\w+)*\b", sass)
    assert not spills, f"{len(spills)} local-memory accesses in {arch} SASS"


def test_resource_usage_fits_budget(cubin) -> None:
    arch, path = cubin
    exe = _cuobjdump()
    if exe is None:
        pytest.skip("cuobjdump not found")
    out = subprocess.run([exe, "-res-usage", str(path)], capture_output=True, text=True).stdout
    cfg = configs.CONFIGS[90 if arch == "sm_90a" else 120]
    budget = configs.SMEM_BUDGET[90 if arch == "sm_90a" else 120]
    found = 0
    # setmaxnreg.inc only takes registers that the producer warpgroup gave back, computed in the
    # kernel from the launch-bounds share (LAUNCH_REGS): any other allocation would hang it.
    launch_regs = 65536 // cfg.threads // 8 * 8
    usage = r"Function (\w+):\s*\n\s*REG:(\d+) STACK:\d+ SHARED:(\d+)"
    for name, regs, shared in re.findall(usage, out):
        if name.startswith("kd_gemm"):
            found += 1
            assert int(regs) == launch_regs, (name, regs, launch_regs)
            # The reported figure includes the 1 KiB the hardware reserves per block.
            static = int(shared) - 1024
            assert 0 <= static <= cfg.static_smem, (name, static)
            assert cfg.dynamic_smem + static <= budget, (name, cfg.dynamic_smem + static)
    assert found == sum(n.startswith("kd_gemm") for n in build.KERNEL_NAMES)


@pytest.mark.parametrize("family", sorted(configs.CONFIGS))
def test_tile_configs_fit_shared_memory(family: int) -> None:
    cfg = configs.CONFIGS[family]
    cfg.check()
    assert cfg.total_smem <= configs.SMEM_BUDGET[family]
    assert cfg.threads % 32 == 0 and cfg.threads <= 1024


def test_config_lookup() -> None:
    assert configs.config_for((12, 0)) is configs.CONFIGS[120]
    assert configs.config_for((9, 0)) is configs.CONFIGS[90]
    with pytest.raises(ValueError, match="not supported"):
        configs.config_for((8, 0))


_CTYPE_OF = {
    ctypes.c_void_p: {"const void*", "const int*", "__nv_bfloat16*", "int*"},
    ctypes.c_int64: {"long long"},
    ctypes.c_int32: {"int"},
}


def test_params_struct_fields_match_source() -> None:
    """The ctypes mirror lists kd::Params' fields in the same order with matching types."""
    from kdump.kernels.sm120.launch import KdParams

    src = build.kernel_source()
    body = re.search(r"struct Params \{(.*?)\n\};", src, re.S).group(1)
    declared: list[tuple[str, str]] = []
    for line in body.splitlines():
        code = line.split("//")[0].strip().rstrip(";")
        if not code:
            continue
        m = re.match(r"(const \w+\*|\w+\*|long long|int)\s+(.*)", code)
        assert m, line
        declared += [(m.group(1), name.strip()) for name in m.group(2).split(",")]
    mirror = list(KdParams._fields_)
    assert [n for _, n in declared] == [n for n, _ in mirror]
    for (ctype_decl, name), (_, ctype_py) in zip(declared, mirror):
        assert ctype_decl in _CTYPE_OF[ctype_py], (name, ctype_decl, ctype_py)


@needs_nvrtc
def test_params_struct_size_matches_cuda() -> None:
    """NVRTC agrees with ctypes on sizeof(kd::Params)."""
    from cuda.core import Program

    from kdump.kernels.sm120.launch import KdParams

    check = f'static_assert(sizeof(kd::Params) == {ctypes.sizeof(KdParams)}, "KdParams size");'
    source = build.kernel_source() + "\n" + check + "\n"
    opts = build._program_options(BuildRequest("sm_120a", configs.CONFIGS[120]))
    Program(source, "c++", opts).compile("cubin")


@needs_nvrtc
@pytest.mark.parametrize("family", sorted(configs.CONFIGS))
def test_launch_shape_matches_kernel(family: int) -> None:
    """The block size and shared memory the launcher uses are the ones the kernel was built for."""
    from cuda.core import Program

    cfg = configs.CONFIGS[family]
    checks = [
        f'static_assert(kd::THREADS == {cfg.threads}, "threads per block");',
        f'static_assert(kd::STAGES * kd::STAGE_BYTES + 1024 == {cfg.dynamic_smem}, "smem");',
        f'static_assert(kd::A_BOX == {cfg.a_box}, "A box rows");',
    ]
    source = build.kernel_source() + "\n" + "\n".join(checks) + "\n"
    arch = "sm_90a" if family == 90 else "sm_120a"
    Program(source, "c++", build._program_options(BuildRequest(arch, cfg))).compile("cubin")


@needs_nvrtc
def test_cache_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.CACHE_ENV_VAR, str(tmp_path))
    assert build.cache_dir() == tmp_path / "sm120"
    # A tiny config keeps this compile fast; it only has to be valid for the cache key.
    req = BuildRequest("sm_120a", configs.CONFIGS[120])
    first = build.build_cubin(req)
    assert not first.from_cache and first.path.is_file()
    assert first.path.parent == tmp_path / "sm120"
    second = build.build_cubin(req)
    assert second.from_cache and second.cubin == first.cubin
    assert not list(first.path.parent.glob("*.tmp")), "temporary files left behind"


def test_cache_dir_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(build.CACHE_ENV_VAR, raising=False)
    assert build.cache_dir() == Path.home() / ".cache" / "kdump" / "sm120"


def test_cache_key_depends_on_options() -> None:
    if _why_not is not None:
        pytest.skip(_why_not)
    src = build.kernel_source()
    k120 = build.cache_key(src, BuildRequest("sm_120a", configs.CONFIGS[120]))
    k90 = build.cache_key(src, BuildRequest("sm_90a", configs.CONFIGS[120]))
    k_src = build.cache_key(src + "\n", BuildRequest("sm_120a", configs.CONFIGS[120]))
    assert len({k120, k90, k_src}) == 3


def test_missing_cutlass_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "cutlass_library" else real(n, *a)
    )
    with pytest.raises(PackagedKernelError, match="nvidia-cutlass"):
        build.cutlass_include_dir()


def test_missing_cuda_headers_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "nvidia" else real(n, *a)
    )
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(Path, "is_file", lambda self: False)
    with pytest.raises(PackagedKernelError, match="CUDA headers not found"):
        build.cuda_include_dir()


def test_nvrtc_newer_than_driver_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdump.cuda import nvrtc  # the toolchain check every kdump kernel shares

    monkeypatch.setattr(nvrtc, "driver_version", lambda: (12, 8))
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (13, 0))
    with pytest.raises(PackagedKernelError, match=r"NVRTC 13\.0 is newer than the driver"):
        nvrtc.check_nvrtc_vs_driver()
    monkeypatch.setattr(nvrtc, "driver_version", lambda: (13, 0))
    nvrtc.check_nvrtc_vs_driver()
    monkeypatch.setattr(nvrtc, "driver_version", lambda: None)  # no GPU: compiling is fine
    nvrtc.check_nvrtc_vs_driver()


def test_compile_error_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    if _why_not is not None:
        pytest.skip(_why_not)
    monkeypatch.setattr(build, "kernel_source", lambda: "this is not C++;")
    with pytest.raises(InternalError, match="NVRTC failed to compile") as info:
        build.build_cubin(BuildRequest("sm_120a", configs.CONFIGS[120]), use_cache=False)
    assert info.value.exit_code == ExitCode.INTERNAL
    assert "\n" not in str(info.value)


def test_missing_prerequisites_are_cannot_run() -> None:
    assert issubclass(PackagedKernelError, CannotRunError)
    assert PackagedKernelError("x").exit_code == ExitCode.CANNOT_RUN


PROBES = Path(__file__).parent / "plugin_pkg"


def _replay_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fn: str, args: list) -> int:
    """Record a call of tests/plugin_pkg/sm120_probes.<fn> and replay it in this process."""
    import torch

    from kdump.bundle import capture_call, save_calls
    from kdump.replay import replay

    monkeypatch.syspath_prepend(str(PROBES))
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    assert tensors
    path = tmp_path / f"{fn}.kdump"
    save_calls(path, [capture_call(f"sm120_probes:{fn}", args, {})])
    [v] = replay(
        [path],
        backend="library",
        device="cpu",
        isolate=False,
        repeat=1,
        allow_targets="sm120_probes:*",
    )
    return v.exit_code


def test_broken_kdump_source_replays_as_internal_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if _why_not is not None:
        pytest.skip(_why_not)
    import torch

    monkeypatch.setattr(build, "kernel_source", lambda: "__global__ void k() { undeclared(); }")
    x = torch.randn(4, 3, device="cpu")
    assert _replay_probe(tmp_path, monkeypatch, "compile_packaged", [x]) == ExitCode.INTERNAL


def test_missing_include_dir_replays_as_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "cutlass_library" else real(n, *a)
    )
    monkeypatch.setattr(build, "nvrtc_version", lambda: (13, 0))  # NVRTC itself is not the point
    x = torch.randn(4, 3, device="cpu")
    assert _replay_probe(tmp_path, monkeypatch, "compile_packaged", [x]) == ExitCode.CANNOT_RUN


def test_bad_argument_to_packaged_kernel_replays_as_contract_violation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    g = torch.Generator(device="cpu").manual_seed(5)
    a = (torch.randn(128, 256, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(2, 128, 256, generator=g) * 8).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(128, 2, generator=g) + 0.5, torch.rand(2, 1, 2, generator=g) + 0.5
    d = torch.randn(128, 64, generator=g).to(torch.bfloat16)  # N = 64, b says 128
    labels = torch.randint(0, 2, (128,), generator=g, dtype=torch.int32)
    code = _replay_probe(tmp_path, monkeypatch, "call_packaged", [(a, sa), (b, sb), d, labels])
    assert code == ExitCode.CONTRACT


def test_api_rejects_bad_arguments_on_cpu() -> None:
    torch = pytest.importorskip("torch")
    from kdump.kernels import sm120

    a = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    sa = torch.ones(128, 2)
    b = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn)
    sb = torch.ones(2, 1, 2)
    d = torch.zeros(128, 128, dtype=torch.bfloat16)
    lab = torch.zeros(128, dtype=torch.int32)
    with pytest.raises(ContractViolation, match="CUDA device"):
        sm120.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, lab)
    with pytest.raises(ContractViolation, match="float8_e4m3fn"):
        sm120.m_grouped_fp8_gemm_nt_contiguous((a.float(), sa), (b, sb), d, lab)
    with pytest.raises(ContractViolation, match="expected an int32 tensor"):
        sm120.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, lab.tolist())
    with pytest.raises(ContractViolation, match="pair"):
        sm120.m_grouped_fp8_gemm_nt_masked(a, (b, sb), d, lab, 1)
    assert sm120.m_grouped_fp8_fp4_gemm_nt_contiguous is sm120.m_grouped_fp8_gemm_nt_contiguous
    assert sm120.m_grouped_fp8_fp4_gemm_nt_masked is sm120.m_grouped_fp8_gemm_nt_masked
    ok, why = sm120.is_available()
    assert isinstance(ok, bool) and why
