"""`kdump report --script`: the standalone repro script, run without kdump importable.

The script is run as `python -I` through a launcher that makes `import kdump` fail, so what it
does it does with torch (and the kernel library) alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, load_bundle, save_calls
from kdump.cli import main
from kdump.errors import UntrustedTargetError
from kdump.report.script import check_targets, render_script

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "tests" / "targets"
STANDINS = ROOT / "tests" / "standins"
CAPTURES = ROOT / "captures"
HOSTILE = "x'\"\"\"\n__import__('os').system('touch PWNED')\\x00\x1b[31m{}%s\r\n#"
LAUNCHER = """\
import runpy, sys
sys.modules["kdump"] = None  # `import kdump` (and any kdump.x) now raises ImportError
try:
    import kdump
except ImportError:
    pass
else:
    raise SystemExit("kdump is importable")
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def _call(target: str, fn: Any, labels: list[int], device: str, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    rows = len(labels)
    base = torch.randn(rows + 1, 6, generator=g).to(device)
    x = base[1:]  # a view at a storage offset
    table = torch.tensor([7, *labels], dtype=torch.int32, device=device)
    lab = table[1:]
    out = torch.full((6, rows), float("nan"), device=device).t()  # column-major output
    args = [x, lab, out, 2.0]
    rec = capture_call(target, args, {}, names=["x", "labels", "out", "factor"])
    live = input_tensors(rec, args, {})
    fn(*args)
    attach_outputs(rec, live, [2])
    return rec


def make_bundle(
    path: Path,
    target: str,
    fn: Any = None,
    device: str = "cpu",
    calls: tuple[list[int], ...] = ([0, -1, 1, 1], [1, 1, -1, 0]),
    **kw: Any,
) -> Path:
    from targets import repro_targets

    fn = fn or repro_targets.scale_rows
    recs = [_call(target, fn, labels, device, seed) for seed, labels in enumerate(calls)]
    return save_calls(path, recs, **kw)


def generate(tmp_path: Path, bundle: Path, *allowed: str, name: str = "repro.py") -> Path:
    out = tmp_path / name
    out.write_text(render_script(str(bundle), allowed), encoding="utf-8")
    return out


def run_script(
    tmp_path: Path, script: Path, *argv: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    launcher = tmp_path / "nokdump.py"
    launcher.write_text(LAUNCHER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        [sys.executable, "-I", str(launcher), str(script), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env=env,
    )


def _lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return proc.stdout.splitlines()


def test_script_source_has_no_kdump_import(tmp_path: Path) -> None:
    src = render_script("b.kdump")
    assert "import kdump" not in src and "from kdump" not in src
    compile(src, "repro.py", "exec")


def test_clean_call_exit_0(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "clean.kdump", "repro_targets:scale_rows")
    script = generate(tmp_path, bundle, "repro_targets:*")
    # --device cpu: the same lines on a GPU machine (the CUDA leg has its own gpu test)
    proc = run_script(tmp_path, script, "--path", str(TARGETS), "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _lines(proc) == [
        f"bundle {bundle}: 2 call(s); running on cpu",
        "eager call 0: ok (outputs match the recorded ones)",
        "eager call 1: ok (outputs match the recorded ones)",
        "graph: skipped (CUDA graphs need a GPU)",
        "verdict: clean (exit 0)",
    ]
    assert proc.stderr == ""


def test_planted_mismatch_exit_1(tmp_path: Path) -> None:
    # Outputs recorded from the correct kernel; the bundle's target is a regressed build.
    bundle = make_bundle(tmp_path / "bad.kdump", "repro_targets:scale_rows_regressed")
    script = generate(tmp_path, bundle, "repro_targets:scale_rows_regressed")
    proc = run_script(tmp_path, script, "--path", str(TARGETS), "--no-graph")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = _lines(proc)
    assert lines[1].startswith("eager call 0: DIFFERS: out: 4 of 24 elements outside rtol=0.0001")
    assert lines[-2:] == ["graph: skipped (--no-graph)", "verdict: outputs differ (exit 1)"]


def test_kernel_error_exit_3(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "fault.kdump", "repro_targets:scale_rows_fault")
    script = generate(tmp_path, bundle, "repro_targets:*")
    proc = run_script(tmp_path, script, "--path", str(TARGETS))
    assert proc.returncode == 3
    assert proc.stderr == "repro: kernel error: RuntimeError: planted kernel fault\n"


def test_layout_offsets_alignment_and_aliasing_are_kept(tmp_path: Path) -> None:
    from targets import repro_targets

    base = torch.arange(300, dtype=torch.float32)[44:]  # a storage whose start is not aligned
    x = base[5:65].view(6, 10)[1:, 3:]
    y = base.view(16, 16).t()[::3]  # the same storage, transposed and strided
    out = torch.zeros(9, dtype=torch.int64)
    args = [x, y, out]
    rec = capture_call("repro_targets:layout_probe", args, {}, names=["x", "y", "out"])
    live = input_tensors(rec, args, {})
    repro_targets.layout_probe(*args)
    attach_outputs(rec, live, [2])
    assert out[-1] == 1 and out[1] == x.data_ptr() % 1024
    bundle = save_calls(tmp_path / "layout.kdump", [rec])
    script = generate(tmp_path, bundle, "repro_targets:layout_probe")
    proc = run_script(tmp_path, script, "--path", str(TARGETS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_deepgemm_standin_reproduces_a_capture(tmp_path: Path) -> None:
    """A DeepGEMM bundle through the plug-in's entry-point table (no --allow-target), with the
    CPU stand-in of DeepGEMM as the kernel library."""
    script = generate(tmp_path, CAPTURES / "contiguous_fp32.kdump")
    proc = run_script(tmp_path, script, "--path", str(STANDINS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "eager call 0: ok (outputs match the recorded ones)" in _lines(proc)


def test_unknown_target_is_refused_and_never_imported(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    marker = tmp_path / "imported"
    (lib / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef f(*a): pass\n")
    bundle = make_bundle(tmp_path / "evil.kdump", "evilmod:f")
    with pytest.raises(UntrustedTargetError):
        check_targets(["evilmod:f"], [])
    script = generate(tmp_path, bundle)  # written by hand, as if the check were skipped
    proc = run_script(tmp_path, script, "--path", str(lib))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("repro: refused: the bundle asks to run evilmod:f,")
    assert proc.stderr.count("\n") == 1 and not marker.exists()
    allowed = run_script(tmp_path, script, "--path", str(lib), "--allow-target", "evilmod:f")
    # What the user allows does run (this f writes nothing: the outputs differ).
    assert allowed.returncode == 1 and marker.exists()


def _hostile_bundle(path: Path, target: str) -> Path:
    from targets import repro_targets

    x = torch.randn(3, 6)
    out = torch.zeros(3, 6)
    labels = torch.tensor([0, 1, -1], dtype=torch.int32)
    rec = capture_call(
        target, [x, labels, out, 2.0], {}, names=["x", HOSTILE, "out", "f"], meta={"m": HOSTILE}
    )
    live = input_tensors(rec, [x, labels, out, 2.0], {})
    repro_targets.scale_rows(x, labels, out, 2.0)
    attach_outputs(rec, live, [2])
    env = {"hostname": HOSTILE, "argv": [HOSTILE], "libraries": {HOSTILE: {"k": HOSTILE}}}
    return save_calls(path, [rec], env=env, info={HOSTILE: HOSTILE})


def test_script_source_does_not_depend_on_the_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "b.kdump"
    sources = []
    for target in ("repro_targets:scale_rows", "mod" + HOSTILE, HOSTILE):
        _hostile_bundle(path, target)
        with pytest.raises(SystemExit) as exc:
            main(["report", str(path), "--script", str(tmp_path / "s.py"), "--allow-target", "*"])
        assert exc.value.code in (0, None), capsys.readouterr()
        sources.append((tmp_path / "s.py").read_bytes())
    benign = render_script(str(path), ["*"]).encode()
    assert sources == [benign] * 3
    assert b"PWNED" not in benign and b"\x1b" not in benign
    # Only the user's path and allow list change the source, on their own lines.
    other = render_script("other/path.kdump", ["a:*"]).splitlines()
    diff = [(a, b) for a, b in zip(benign.decode().splitlines(), other) if a != b]
    assert [a.split(" = ")[0] for a, _ in diff] == ["BUNDLE", "ALLOWED"]


def test_hostile_bundle_runs_nothing_of_its_own(tmp_path: Path) -> None:
    path = _hostile_bundle(tmp_path / "h.kdump", "os:system")
    script = generate(tmp_path, path)
    proc = run_script(tmp_path, script)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "\x1b" not in proc.stderr
    # Hostile strings in names, meta, env and info, with an allowed target: it runs the call.
    _hostile_bundle(path, "repro_targets:scale_rows")
    proc = run_script(tmp_path, script, "--path", str(TARGETS), "--allow-target", "repro_*:*")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not any(tmp_path.rglob("PWNED")) and not (ROOT / "PWNED").exists()


def test_by_reference_storage_is_recreated_and_said(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "ref.kdump", "repro_targets:scale_rows", calls=([0, 1],))
    raw = bundle.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    manifest = json.loads(header["__metadata__"]["kdump.manifest"])
    st = manifest["calls"][0]["storages"][0]
    st.update(source="by-reference", blob="")
    st["stats"] = {"dtype": "float32", "min": -3.0, "max": 3.0, "mean": 0.0, "std": 1.0}
    header["__metadata__"]["kdump.manifest"] = json.dumps(manifest)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    bundle.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    script = generate(tmp_path, bundle, "repro_targets:*")
    proc = run_script(tmp_path, script, "--path", str(TARGETS))
    lines = _lines(proc)
    note = "eager call 0: note: storage 0 (by-reference) re-created from its recorded statistics"
    assert f"{note}, seed 0" in lines
    assert proc.returncode == 1  # other values than recorded: the outputs differ, and it says so


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x01\x00",
        (200_000_000).to_bytes(8, "little") + b"{}",
        (16).to_bytes(8, "little") + b'{"a": 1}        ',
        (8).to_bytes(8, "little") + b"[" * 8,
    ],
)
def test_malformed_files_are_refused_in_one_line(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.kdump"
    bad.write_bytes(content)
    proc = run_script(tmp_path, generate(tmp_path, bad), timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("repro: refused: ") and proc.stderr.count("\n") == 1


def test_fifo_and_byte_cap_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.kdump"
    os.mkfifo(fifo)
    proc = run_script(tmp_path, generate(tmp_path, fifo), timeout=60)
    assert proc.returncode == 2 and "is not a regular file" in proc.stderr
    bundle = make_bundle(tmp_path / "ok.kdump", "repro_targets:scale_rows")
    script = generate(tmp_path, bundle, "repro_targets:*")
    proc = run_script(tmp_path, script, "--path", str(TARGETS), "--max-bytes", "2048")
    assert proc.returncode == 2 and "over --max-bytes 2048" in proc.stderr


def test_cli_refuses_an_unknown_target_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = make_bundle(tmp_path / "b.kdump", "repro_targets:scale_rows")
    out = tmp_path / "s.py"
    with pytest.raises(SystemExit) as exc:
        main(["report", str(bundle), "--script", str(out)])
    assert exc.value.code == 2 and not out.exists()
    assert "--allow-target 'repro_targets:scale_rows'" in capsys.readouterr().err


def test_store_bundle(tmp_path: Path) -> None:
    from kdump.bundle import BlobStore

    folder = tmp_path / "dumps"
    make_bundle(folder / "p1" / "c.kdump", "repro_targets:scale_rows", store=BlobStore(folder))
    moved = tmp_path / "copy"
    shutil.copytree(folder, moved)
    assert load_bundle(moved / "p1" / "c.kdump").calls
    script = generate(tmp_path, moved / "p1" / "c.kdump", "repro_targets:*")
    proc = run_script(tmp_path, script, "--path", str(TARGETS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- GPU -----------------------------------------------------------------------------------------
def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
def test_gpu_graph_capture_then_replay_with_the_next_calls_values(tmp_path: Path) -> None:
    _need_cuda()
    from targets import repro_targets

    clean = make_bundle(tmp_path / "g.kdump", "repro_targets:scale_rows", device="cuda")
    script = generate(tmp_path, clean, "repro_targets:*")
    proc = run_script(tmp_path, script, "--path", str(TARGETS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _lines(proc)[3:] == [
        "graph: captured call 0",
        "graph replay with call 0's values: ok (outputs match the recorded ones)",
        "graph replay with call 1's values: ok (outputs match the recorded ones)",
        "verdict: clean (exit 0)",
    ]
    # Eagerly correct, but the graph bakes in the capture-time routing: call 1's replay differs.
    unsafe = make_bundle(
        tmp_path / "u.kdump",
        "repro_targets:scale_rows_capture_unsafe",
        fn=repro_targets.scale_rows,
        device="cuda",
    )
    proc = run_script(
        tmp_path, generate(tmp_path, unsafe, "repro_targets:*"), "--path", str(TARGETS)
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = _lines(proc)
    assert lines[1:3] == [
        "eager call 0: ok (outputs match the recorded ones)",
        "eager call 1: ok (outputs match the recorded ones)",
    ]
    assert lines[5].startswith("graph replay with call 1's values: DIFFERS: out:")


@pytest.mark.gpu
def test_gpu_deepgemm_bundle_reproduces_without_kdump(tmp_path: Path) -> None:
    """The packaged kernel's recorded verdict (clean against the reference-recorded captures)
    reproduced through the installed DeepGEMM, with kdump not importable."""
    _need_cuda()
    probe = subprocess.run([sys.executable, "-I", "-c", "import deep_gemm"], capture_output=True)
    if probe.returncode:
        pytest.skip("DeepGEMM is not installed")
    major = torch.cuda.get_device_capability()[0]
    name = "contiguous_fp32.kdump" if major == 9 else "contiguous_ue8m0.kdump"
    script = generate(tmp_path, CAPTURES / name)
    proc = run_script(tmp_path, script, "--no-graph", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "eager call 0: ok (outputs match the recorded ones)" in _lines(proc)


def _packaged_bundle(path: Path, kernel: Any) -> Path:
    """Two calls recorded through `kernel` on the GPU, as a serving loop makes them: the same
    buffers, the routing rewritten in place between the calls (the experts rotated)."""
    c = load_bundle(CAPTURES / "contiguous_fp32.kdump").calls[0]
    mc = c.materialize("cuda")
    args, kwargs = list(mc.args), dict(mc.kwargs)
    d, labels = args[2], args[3]
    groups = args[1][0].shape[0]
    recs = []
    for step in range(2):
        if step:
            labels.copy_(torch.where(labels >= 0, (labels + 1) % groups, labels))
        d.fill_(float("nan"))
        rec = capture_call(c.target, args, kwargs, names=c.names)
        live = input_tensors(rec, args, kwargs)
        kernel(*args, **kwargs)
        torch.cuda.synchronize()
        attach_outputs(rec, live, [i for i, t in enumerate(live) if t is d])
        recs.append(rec)
    return save_calls(path, recs)


@pytest.mark.gpu
def test_gpu_packaged_kernel_verdicts_reproduce_without_kdump(tmp_path: Path) -> None:
    """Bundles recorded through kdump's packaged kernel (clean) and its planted stale-schedule
    variant (the second call is wrong) on the GPU; the script, with the pure-torch DeepGEMM
    stand-in as the kernel library and kdump not importable, says clean and differs."""
    _need_cuda()
    from kdump.kernels.sm120 import api, faulty

    ok, why = api.is_available()
    if not ok:
        pytest.skip(why)
    good = _packaged_bundle(tmp_path / "packaged.kdump", api.m_grouped_fp8_gemm_nt_contiguous)
    bad = _packaged_bundle(tmp_path / "faulty.kdump", faulty.m_grouped_fp8_gemm_nt_contiguous)
    argv = ("--path", str(STANDINS), "--device", "cuda", "--no-graph")
    proc = run_script(tmp_path, generate(tmp_path, good), *argv, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_script(tmp_path, generate(tmp_path, bad), *argv, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = _lines(proc)
    assert lines[1] == "eager call 0: ok (outputs match the recorded ones)"
    assert lines[2].startswith("eager call 1: DIFFERS: d:")
