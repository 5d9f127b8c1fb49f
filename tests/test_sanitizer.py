from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls
from kdump.cli import main
from kdump.errors import CannotRunError, ExitCode
from kdump.replay.addresses import PlacedTensor, locate
from kdump.replay.sanitizer import find_sanitizer, parse_report

DATA = Path(__file__).parent / "data"

SAMPLE = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 2 bytes
=========     at kd_gemm_labels_fp32_stale+0x1a30 in /tmp/kd/grouped_gemm.cu:312
=========     by thread (5,0,0) in block (3,0,0)
=========     Address 0x7f0c2e041000 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f0c2e000000 of size 266240 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cuLaunchKernel [0x2a5b1] in libcuda.so.1
=========
========= Invalid __global__ read of size 16 bytes
=========     at void at::native::vectorized_elementwise_kernel<4>(int)+0x90
=========     by thread (1,0,0) in block (0,0,0)
=========     Access to 0x7f0c2f000000 is out of bounds
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure"
=========
========= ERROR SUMMARY: 1,024 errors
"""


def test_parse_records_and_summary() -> None:
    rep = parse_report(SAMPLE)
    assert rep.errors == 1024
    assert len(rep.records) == 2
    w = rep.records[0]
    assert (w.access, w.size, w.kernel, w.pc) == ("write", 2, "kd_gemm_labels_fp32_stale", "0x1a30")
    assert w.source.endswith("grouped_gemm.cu:312")
    assert (w.thread, w.block) == ("5,0,0", "3,0,0")
    assert w.address == 0x7F0C2E041000
    assert w.nearest == {
        "distance": 1,
        "direction": "after",
        "allocation": 0x7F0C2E000000,
        "allocation_size": 266240,
    }
    r = rep.records[1]
    assert r.access == "read" and r.size == 16 and r.address == 0x7F0C2F000000


INLINED = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at void kd::store_row<(int)4>(__nv_bfloat16 *, const unsigned int (&)[T1], bool)+0x1c0 in grouped_gemm.cu:426
=========     by thread (256,0,0) in block (8,0,0)
=========     Access to 0x7f48e5b17c10 is out of bounds
=========     and is 98,321 bytes after the nearest allocation at 0x7f48e5a00000 of size 1,048,576 bytes
=========         Device Frame: void kd::epilogue<(int)4>(int)+0x80 in grouped_gemm.cu:511
=========         Device Frame: kd_gemm_labels_ue8m0_stale+0x4c80 in grouped_gemm.cu:702
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cudaGraphLaunch [0x76211] in libcudart.so.13
=========
========= ERROR SUMMARY: 1 error
"""  # noqa: E501


def test_parse_names_the_kernel_an_access_was_inlined_into() -> None:
    """With line info, "at" names the inlined device function and the device frames its callers:
    the record's kernel is the outermost frame, the launched kernel."""
    [r] = parse_report(INLINED).records
    assert r.kernel == "kd_gemm_labels_ue8m0_stale"
    assert r.function.startswith("void kd::store_row<(int)4>")
    assert r.source == "grouped_gemm.cu:426" and r.pc == "0x1c0"
    assert r.nearest["distance"] == 98321
    assert " in void kd::store_row<(int)4>(" in r.describe()
    assert "(inlined into kd_gemm_labels_ue8m0_stale) (grouped_gemm.cu:426)" in r.describe()


def test_parse_clean_and_empty_reports() -> None:
    assert (
        parse_report("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n").errors == 0
    )
    rep = parse_report("")
    assert rep.errors is None and rep.records == []


def test_locate_maps_addresses_to_elements() -> None:
    d = PlacedTensor("d", 0x10000, 2, (128, 256), (256, 1))
    a = PlacedTensor("a[0]", 0x80000, 1, (128, 512), (512, 1))
    assert locate(0x10000 + 2 * (3 * 256 + 7), [d, a]) == "d[3, 7]"
    end = 0x10000 + 128 * 256 * 2
    assert locate(end + 16, [d, a]) == "17 bytes past the end of d"
    assert locate(0x80000 - 4, [d, a]) == "4 bytes before a[0]"  # allocation unknown
    # with its allocation known: before the view inside it, or before the allocation itself
    v = PlacedTensor("v", 0x20040, 4, (4, 4), (4, 1), alloc_ptr=0x20000, alloc_nbytes=0x80)
    assert locate(0x20040 - 8, [v]) == "8 bytes before v"
    assert locate(0x20000 - 120, [v]) == (
        "120 bytes before v's allocation: not an argument — an allocation of the library itself"
    )
    assert locate(0x20080 + 3, [v]) == "4 bytes past the end of v"
    t = PlacedTensor("t", 0x1000, 4, (8, 4), (1, 8))  # column-major
    assert locate(0x1000 + 4 * (2 * 8 + 5), [t]) == "t[5, 2]"


def test_missing_sanitizer_is_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CannotRunError):
        find_sanitizer(str(tmp_path / "nope"))


@pytest.mark.parametrize("log", sorted(DATA.glob("*.log")), ids=lambda p: p.name)
def test_parse_real_reports(log: Path) -> None:
    """Reports captured on the H200 (see tests/data/README.md)."""
    text = log.read_text()
    rep = parse_report(text)
    assert rep.errors is not None
    if rep.errors:
        assert rep.records and all(r.kind for r in rep.records)
        assert any(r.address is not None for r in rep.records)
    else:
        assert rep.records == []


def test_real_fault_report_fields() -> None:
    rep = parse_report((DATA / "memcheck-sm120-faulty.log").read_text())
    assert rep.errors == 1340 and len(rep.records) == 4
    r = rep.records[0]
    assert (r.access, r.size, r.kernel) == ("write", 4, "kd_gemm_labels_fp32_stale")
    assert (r.thread, r.block) == ("64,0,0", "17,0,0")
    assert r.address == 0x7F6F4ED00190
    assert r.nearest == {
        "distance": 401,
        "direction": "after",
        "allocation": 0x7F6F4EC00000,
        "allocation_size": 1048576,
    }
    # D of the script: 2048 x 256 bf16 = 1 MiB at the nearest allocation's address
    d = PlacedTensor("d", 0x7F6F4EC00000, 2, (2048, 256), (256, 1))
    assert locate(r.address, [d]) == "401 bytes past the end of d"


# --- sanitizer mode end to end, with a stand-in compute-sanitizer ------------------------------

FAKE = Path(__file__).parent / "standins" / "fake_sanitizer.py"
TESTS = Path(__file__).parent


@pytest.fixture
def targets_importable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    # The replays these tests make name this repository's test targets: allowed in the
    # user's config (the tests passing ALLOW show the command-line way).
    (tmp_path / "kdump.toml").write_text('allow-targets = ["targets.*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))


ALLOW = ("--allow-target", "targets.replay_targets:*")  # this repository's test targets


def _record(path: Path, fn_name: str) -> Path:
    from targets import replay_targets

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(16, 8, generator=gen)
    out = torch.empty(16, 8)
    call = capture_call(f"targets.replay_targets:{fn_name}", [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    replay_targets.scale_into(x, out)
    attach_outputs(call, live, [1])
    save_calls(path, [call])
    return path


def _replay_json(
    capsys: pytest.CaptureFixture[str], bundle: Path, sanitizer: Path | str
) -> tuple[int, dict]:
    argv = ["replay", str(bundle), "--mode", "sanitizer", "--sanitizer", str(sanitizer)]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--device", "cpu", "--backend", "library", "--json", *ALLOW])
    return int(exc.value.code or 0), json.loads(capsys.readouterr().out)


def test_sanitizer_clean_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], targets_importable: None
) -> None:
    code, out = _replay_json(capsys, _record(tmp_path / "s.kdump", "scale_into"), FAKE)
    assert code == 0, out["verdicts"][0]["headline"]
    names = [s["name"] for s in out["verdicts"][0]["steps"]]
    assert "sanitizer/memcheck/eager/run 1" in names and "sanitizer/memcheck" in names


def test_sanitizer_on_a_sample_capture_with_the_reference(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = TESTS.parent / "captures" / "contiguous_fp32.kdump"
    argv = ["replay", str(bundle), "--mode", "sanitizer", "--sanitizer", str(FAKE)]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--device", "cpu", "--backend", "reference", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert exc.value.code == 0, out["verdicts"][0]["headline"]
    steps = {s["name"]: s for s in out["verdicts"][0]["steps"]}
    assert steps["sanitizer/memcheck"]["message"].startswith("0 error(s)")


def test_sanitizer_replay_that_dies_is_kernel_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], targets_importable: None
) -> None:
    code, out = _replay_json(capsys, _record(tmp_path / "c.kdump", "crash"), FAKE)
    assert code == ExitCode.KERNEL_ERROR
    [f] = out["verdicts"][0]["findings"]
    assert f["kind"] == "kernel_error"
    # the first run on the recorded values finds the outputs of a target without a spec
    assert f["step"] == "sanitizer/memcheck/eager/discover outputs (recorded values)"
    assert "SIGABRT" in f["message"] and "crash" in f["message"]


@pytest.mark.parametrize("sanitizer", ["stand-in", "/bin/true"])
def test_sanitizer_that_never_runs_the_replay_is_internal_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    targets_importable: None,
    sanitizer: str,
) -> None:
    monkeypatch.setenv("FAKE_SANITIZER", "noop")
    binary = FAKE if sanitizer == "stand-in" else Path(sanitizer)
    if not binary.is_file():
        pytest.skip(f"{binary} is not on this machine")
    code, out = _replay_json(capsys, _record(tmp_path / "s.kdump", "scale_into"), binary)
    assert code == ExitCode.INTERNAL
    [f] = out["verdicts"][0]["findings"]
    assert f["kind"] == "internal"
    assert "never ran" in f["message"] and str(binary) in f["message"]
    assert "exit status 0" in f["message"]


def test_sanitizer_report_errors_are_memory_findings(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    targets_importable: None,
) -> None:
    monkeypatch.setenv("FAKE_SANITIZER", "report")
    monkeypatch.setenv("FAKE_SANITIZER_REPORT", str(DATA / "memcheck-sm120-faulty.log"))
    code, out = _replay_json(capsys, _record(tmp_path / "s.kdump", "scale_into"), FAKE)
    assert code == ExitCode.MEMORY_FINDING
    mem = [f for f in out["verdicts"][0]["findings"] if f["kind"] == "memory"]
    assert len(mem) == 4
    assert mem[0]["details"]["kernel"] == "kd_gemm_labels_fp32_stale"
    assert mem[0]["details"]["address"] == 0x7F6F4ED00190
    assert mem[0]["message"].startswith("memcheck: Invalid __global__ write of size 4 bytes")
    assert "kd_gemm_labels_fp32_stale" in mem[0]["message"]
    assert "thread (64,0,0) block (17,0,0)" in mem[0]["message"]
    # 1340 errors in the report, 4 printed: the rest are counted, not dropped silently
    step = next(s for s in out["verdicts"][0]["steps"] if s["name"] == "sanitizer/memcheck")
    assert step["metrics"]["not_shown"] == 1336
    assert "first: memcheck: Invalid __global__ write" in step["message"]


def _record_view(path: Path, fn_name: str) -> Path:
    """x is a view 8 floats into its storage (room before it inside its allocation)."""
    from targets import replay_targets

    gen = torch.Generator().manual_seed(12)
    base = torch.randn(17 * 8, generator=gen)
    x = base[8:].view(16, 8)
    out = torch.randn(16, 8, generator=gen)
    call = capture_call(f"targets.replay_targets:{fn_name}", [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    replay_targets.scale_into(x, out)
    attach_outputs(call, live, [1])
    save_calls(path, [call])
    return path


def _memcheck(access: str, addr: str, nearest: str = "", count: int = 1) -> str:
    one = (
        f"========= Invalid __global__ {access} of size 4 bytes\n"
        "=========     at kd_scale_kernel+0x4c80 in /tmp/kd/scale.cu:77\n"
        "=========     by thread (3,0,0) in block (5,0,0)\n"
        f"=========     Access to {addr} is out of bounds\n"
        + (f"=========     and is {nearest}\n" if nearest else "")
        + "=========     Saved host backtrace up to driver entry point at kernel launch time\n"
        "=========         Host Frame: cuLaunchKernel [0x2a5b1] in libcuda.so.1\n"
        "========= \n"
    )
    return (
        "========= COMPUTE-SANITIZER\n"
        + one * count
        + f"========= ERROR SUMMARY: {count} error{'s' if count > 1 else ''}\n"
    )


RACE = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at kd_reduce(float *)+0x1f0 in /tmp/kd/r.cu:41
=========     and Read access at kd_reduce(float *)+0x230 in /tmp/kd/r.cu:44 [248 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""

CASES = {
    "in-argument": (_memcheck("write", "@{out:ptr+36}"), "out[1, 1]"),
    "past-the-end": (
        _memcheck(
            "write",
            "@{out:end+15}",
            "16 bytes after the nearest allocation at @{out:alloc} of size @{out:alloc_size} bytes",
        ),
        "16 bytes past the end of out",
    ),
    "before-the-start": (_memcheck("read", "@{x:ptr-8}"), "8 bytes before x"),
    "in-no-argument": (
        _memcheck(
            "atomic",
            "@{out:alloc-120}",
            "120 bytes before the nearest allocation at @{out:alloc} of size "
            "@{out:alloc_size} bytes",
        ),
        "120 bytes before out's allocation: not an argument — an allocation of the library itself",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sanitizer_finding_names_access_site_and_argument(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    targets_importable: None,
    case: str,
) -> None:
    report, where = CASES[case]
    (tmp_path / "report.log").write_text(report)
    monkeypatch.setenv("FAKE_SANITIZER", "report")
    monkeypatch.setenv("FAKE_SANITIZER_REPORT", str(tmp_path / "report.log"))
    code, out = _replay_json(capsys, _record_view(tmp_path / "s.kdump", "scale_into"), FAKE)
    assert code == ExitCode.MEMORY_FINDING
    v = out["verdicts"][0]
    [f] = [f for f in v["findings"] if f["kind"] == "memory"]
    assert "memcheck: Invalid __global__" in f["message"]
    assert "of size 4 bytes in kd_scale_kernel (/tmp/kd/scale.cu:77)" in f["message"]
    assert "thread (3,0,0) block (5,0,0)" in f["message"]
    assert f["message"].endswith(": " + where), f["message"]
    assert f["details"]["location"]["text"] == where
    assert v["headline"].startswith("memory: memcheck: Invalid __global__")


def test_racecheck_names_the_hazard(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    targets_importable: None,
) -> None:
    (tmp_path / "race.log").write_text(RACE)
    monkeypatch.setenv("FAKE_SANITIZER", "report")
    monkeypatch.setenv("FAKE_SANITIZER_REPORT", str(tmp_path / "race.log"))
    bundle = _record(tmp_path / "s.kdump", "scale_into")
    argv = ["replay", str(bundle), "--mode", "sanitizer", "--sanitizer", str(FAKE)]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--tool", "racecheck", "--device", "cpu", "--backend", "library", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert exc.value.code == ExitCode.MEMORY_FINDING
    [f] = out["verdicts"][0]["findings"]
    assert f["message"].startswith(
        "racecheck: Race reported between Write access and Read access (248 hazards) "
        "in kd_reduce(float *) (/tmp/kd/r.cu:41)"
    )
    assert f["details"]["hazard"] == "Write/Read race (248 hazards)"


def test_crash_with_findings_names_the_cause(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    targets_importable: None,
) -> None:
    """The replay raised 'illegal memory access' and memcheck saw the bad access: the crash is
    the symptom, the access the cause; the exit code stays a kernel error's."""
    report, where = CASES["in-no-argument"]
    (tmp_path / "report.log").write_text(report.replace("1 error", "408 errors"))
    monkeypatch.setenv("FAKE_SANITIZER", "report")
    monkeypatch.setenv("FAKE_SANITIZER_REPORT", str(tmp_path / "report.log"))
    code, out = _replay_json(capsys, _record_view(tmp_path / "r.kdump", "raises"), FAKE)
    assert code == ExitCode.KERNEL_ERROR
    v = out["verdicts"][0]
    headline = v["headline"]
    assert headline.startswith(
        "kernel error: caused by memcheck: Invalid __global__ atomic of size 4 bytes in "
        "kd_scale_kernel (/tmp/kd/scale.cu:77)"
    ), headline
    assert where in headline and "(first of 408)" in headline
    assert "symptom: " in headline and "illegal memory access" in headline
    kinds = sorted(f["kind"] for f in v["findings"])
    assert kinds == ["kernel_error", "memory"]


def test_findings_are_capped_and_the_rest_counted(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    targets_importable: None,
) -> None:
    (tmp_path / "many.log").write_text(_memcheck("write", "@{out:ptr+4}", count=25))
    monkeypatch.setenv("FAKE_SANITIZER", "report")
    monkeypatch.setenv("FAKE_SANITIZER_REPORT", str(tmp_path / "many.log"))
    code, out = _replay_json(capsys, _record_view(tmp_path / "s.kdump", "scale_into"), FAKE)
    assert code == ExitCode.MEMORY_FINDING
    v = out["verdicts"][0]
    assert len([f for f in v["findings"] if f["kind"] == "memory"]) == 20
    step = next(s for s in v["steps"] if s["name"] == "sanitizer/memcheck")
    assert step["metrics"]["not_shown"] == 5 and step["metrics"]["records"] == 25
    assert any("5 more error(s) not listed" in n for n in v["notes"])
