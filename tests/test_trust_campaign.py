"""Hostile bundles, end to end: an allowed glob that would walk into modules the target's module
merely imported, a broadcast view over a huge logical size, re-created tensors of every dtype,
rich emoji codes in bundle strings, and symlinked bundles given to `kdump pack`."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdump.bundle import capture_call, save_calls
from kdump.cli import main
from kdump.errors import CannotRunError, ExitCode, UntrustedTargetError
from kdump.kernels import registry
from kdump.report.script import render_script

MOD = "kd_campaign_mod"
HELPERS = "kd_campaign_helpers"
# The target's module imports os, subprocess and torch, a helper's function and a partial of it.
MOD_SOURCE = f"""\
import functools
import os
import subprocess

import torch

from {HELPERS} import Wrapper, touch

part = functools.partial(touch)
holder = type("Holder", (), {{"os": os}})


def fn(path):
    open(path, "w").close()


wrapped = Wrapper(fn)
"""
HELPERS_SOURCE = """\
def touch(path):
    open(path, "w").close()


class Wrapper:
    def __init__(self, fn):
        self.__wrapped__ = fn

    def __call__(self, *args):
        return self.__wrapped__(*args)
"""
# Targets that reach a function through a module the target's module imported.
THROUGH_MODULES = (
    f"{MOD}:os.system",
    f"{MOD}:subprocess.run",
    f"{MOD}:torch.serialization.os.system",
    f"{MOD}:holder.os.system",
)


@pytest.fixture
def lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding the target's module, the current folder elsewhere, no user config."""
    folder = tmp_path / "lib"
    folder.mkdir()
    (folder / f"{MOD}.py").write_text(MOD_SOURCE)
    (folder / f"{HELPERS}.py").write_text(HELPERS_SOURCE)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "no-config.toml"))
    for name in (MOD, HELPERS):
        sys.modules.pop(name, None)
    return folder


def _args(target: str, canary: Path) -> list[object]:
    if target.endswith(".system"):
        return [f"touch {canary}"]
    if target.endswith(".run"):
        return [["touch", str(canary)]]
    return [str(canary)]


def _bundle(path: Path, target: str, canary: Path) -> Path:
    return save_calls(path, [capture_call(target, _args(target, canary), {}, names=["a"])])


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


REPLAY = ("--device", "cpu", "--backend", "library", "--repeat", "1")


def _flat(text: str) -> str:
    """Printed text with rich's line wrapping undone."""
    return " ".join(text.split())


@pytest.mark.parametrize(
    ("target", "pattern"),
    [(t, f"{MOD}:*") for t in THROUGH_MODULES]
    + [(THROUGH_MODULES[0], "*")]
    + [(THROUGH_MODULES[2], "exact")],
)
def test_a_walk_through_a_module_never_runs(
    lib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, pattern: str
) -> None:
    canary = tmp_path / "CANARY"
    bundle = _bundle(tmp_path / "b.kdump", target, canary)
    allow = target if pattern == "exact" else pattern
    code, out, err = _cli(
        capsys, "replay", str(bundle), *REPLAY, "--allow-target", allow, "--path", str(lib)
    )
    assert code == ExitCode.USAGE, out + err
    assert "through the module object" in _flat(out + err)
    assert not canary.exists()


@pytest.mark.parametrize("name", ["part", "touch"])
def test_a_glob_allows_only_what_the_module_defines(
    lib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    canary = tmp_path / "CANARY"
    bundle = _bundle(tmp_path / "b.kdump", f"{MOD}:{name}", canary)
    argv = ("replay", str(bundle), *REPLAY, "--path", str(lib), "--allow-target")
    code, out, err = _cli(capsys, *argv, f"{MOD}:*")
    assert code == ExitCode.USAGE, out + err
    assert "does not define" in _flat(out + err)
    assert f"--allow-target '{MOD}:{name}'" in _flat(out + err)
    assert not canary.exists()
    # Named exactly, the same attribute runs (a partial, a function imported from elsewhere).
    code, out, err = _cli(capsys, *argv, f"{MOD}:{name}")
    assert code == 0, out + err
    assert canary.exists()


@pytest.mark.parametrize("name", ["fn", "wrapped"])
def test_a_glob_runs_what_the_module_defines(
    lib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    canary = tmp_path / "CANARY"
    bundle = _bundle(tmp_path / "b.kdump", f"{MOD}:{name}", canary)
    code, out, err = _cli(
        capsys, "replay", str(bundle), *REPLAY, "--path", str(lib), "--allow-target", f"{MOD}:*"
    )
    assert code == 0, out + err
    assert canary.exists()


def test_resolve_allowed_rules(lib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(lib))
    for target in THROUGH_MODULES:
        for patterns in ((f"{MOD}:*",), (target,), ("*",)):
            assert registry.target_allowed(target, patterns)  # the name alone passes
            with pytest.raises(UntrustedTargetError, match="through the module object"):
                registry.resolve_allowed(target, patterns)
    assert registry.resolve_allowed(f"{MOD}:fn", (f"{MOD}:*",)).__name__ == "fn"
    part = registry.resolve_allowed(f"{MOD}:part", (f"{MOD}:part",))
    assert isinstance(part, functools.partial)
    with pytest.raises(UntrustedTargetError):
        registry.resolve_allowed(f"{MOD}:fn", ("other:*",))
    # A glob of another module's name does not reach os either.
    with pytest.raises(UntrustedTargetError, match="does not define"):
        registry.resolve_allowed("os:system", ("os:*",))
    assert registry.resolve_allowed("os:system", ("os:system",)) is __import__("os").system
    # check_target keeps the patterns for the replay child's resolution.
    registry.check_target(f"{MOD}:part", (f"{MOD}:p*",))
    with pytest.raises(UntrustedTargetError, match="does not define"):
        registry.resolve_allowed(f"{MOD}:part")
    registry.check_target(f"{MOD}:part", (f"{MOD}:part",))
    assert isinstance(registry.resolve_allowed(f"{MOD}:part"), functools.partial)


def test_an_import_failure_names_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "none.toml"))
    with pytest.raises(CannotRunError, match="--path DIR"):
        registry.resolve_allowed("kd_no_such_module_anywhere:fn", ("kd_no_such_module_anywhere:*",))


def test_torch_ops_targets_resolve_under_a_glob(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "none.toml"))
    op = registry.resolve_allowed("torch.ops.aten:add", ("torch.ops.aten:*",))
    assert op is torch.ops.aten.add


def _run_script(tmp_path: Path, bundle: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "repro.py"
    script.write_text(render_script(str(bundle)), encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-I", str(script), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_the_repro_script_applies_the_same_rule(lib: Path, tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    for target in THROUGH_MODULES[:2]:
        bundle = _bundle(tmp_path / "b.kdump", target, canary)
        for allow in (f"{MOD}:*", target):
            proc = _run_script(tmp_path, bundle, "--path", str(lib), "--allow-target", allow)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert "through the module object" in proc.stderr and "Traceback" not in proc.stderr
            assert not canary.exists()
    bundle = _bundle(tmp_path / "b.kdump", f"{MOD}:touch", canary)
    proc = _run_script(tmp_path, bundle, "--path", str(lib), "--allow-target", f"{MOD}:*")
    assert proc.returncode == 2 and "does not define" in proc.stderr, proc.stderr
    assert not canary.exists()
    proc = _run_script(tmp_path, bundle, "--path", str(lib), "--allow-target", f"{MOD}:touch")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # it ran (no outputs to match)
    assert canary.exists()


# --- allocations a bundle can cause -------------------------------------------------------------
def _rewrite(path: Path, edit: object) -> Path:
    """Apply `edit(manifest)` to a bundle's manifest in place (the blobs stay as they are)."""
    import json

    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    manifest = json.loads(header["__metadata__"]["kdump.manifest"])
    edit(manifest)  # type: ignore[operator]
    header["__metadata__"]["kdump.manifest"] = json.dumps(manifest)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    return path


def _bomb(path: Path, elements: int) -> Path:
    """A small bundle whose recorded output is a stride-0 view of `elements` float32 elements."""
    from kdump.bundle import attach_outputs, input_tensors

    x = torch.zeros(1).expand(elements)
    out = torch.zeros(4)
    rec = capture_call(f"{MOD}:fn", [out, x], {}, names=["out", "x"])
    attach_outputs(rec, input_tensors(rec, [out, x], {}), [0, 1])
    return save_calls(path, [rec])


def test_a_broadcast_bomb_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "none.toml"))
    bundle = _bomb(tmp_path / "bomb.kdump", 1 << 40)  # 4 TiB as a dense tensor
    assert bundle.stat().st_size < 64 << 10
    for argv in (
        ("replay", str(bundle), *REPLAY, "--allow-target", f"{MOD}:fn"),
        ("info", str(bundle)),
    ):
        code, out, err = _cli(capsys, *argv)
        assert code == ExitCode.USAGE, out + err
        assert len(err.strip().splitlines()) == 1 and "load limit" in err, err
    # Within the limit, a broadcast view is re-created over its span and copied as such.
    from kdump.bundle import load_bundle
    from kdump.bundle.tensors import clone_layout

    small = load_bundle(_bomb(tmp_path / "small.kdump", 1 << 30))
    x = small.calls[0].args[1]
    assert x.stride() == (0,) and x.untyped_storage().nbytes() < 4096
    copy = clone_layout(x)
    assert copy.stride() == (0,) and copy.untyped_storage().nbytes() == 4
    assert copy.data_ptr() != x.data_ptr()


def _all_dtypes_by_reference(path: Path, stats: dict) -> Path:
    from kdump.bundle.tensors import DTYPES

    tensors = [torch.zeros(4096, dtype=torch.uint8).view(d) for d in DTYPES.values()]
    save_calls(path, [capture_call(f"{MOD}:fn", tensors, {}, names=list(DTYPES))])

    def edit(m: dict) -> None:
        for st, name in zip(m["calls"][0]["storages"], DTYPES):
            st.update(source="by-reference", blob="")
            st["stats"] = {"dtype": name, **stats}

    return _rewrite(path, edit)


def test_recreated_tensors_of_every_dtype(tmp_path: Path) -> None:
    from kdump.bundle import load_bundle
    from kdump.bundle.tensors import DTYPES

    stats = {"min": -3.0, "max": 3.0, "mean": 0.5, "std": 1.0}
    bundle = load_bundle(_all_dtypes_by_reference(tmp_path / "all.kdump", stats))
    call = bundle.calls[0]
    assert call.synthesized == list(DTYPES)
    args = call.args
    assert [a.dtype for a in args] == list(DTYPES.values())
    assert all(a.view(torch.uint8).numel() == 4096 for a in args)
    # Values within the recorded range where torch can read them back.
    for name, a in zip(DTYPES, args):
        if name in ("float4_e2m1fn_x2", "float8_e8m0fnu", "bool") or name.startswith("uint"):
            continue
        v = (torch.view_as_real(a) if a.is_complex() else a).to(torch.float64)
        assert float(v.min()) >= -3.0 and float(v.max()) <= 3.0, name
        assert float(v.std()) > 0.1, name
    fp4 = args[list(DTYPES).index("float4_e2m1fn_x2")].view(torch.uint8)
    assert len(set(fp4.tolist())) > 20  # two random codes per byte
    # The standalone script re-creates the same bytes.
    ns: dict = {"__name__": "repro"}
    exec(compile(render_script("x.kdump"), "repro", "exec"), ns)
    for j, (st, a) in enumerate(zip(call.storages, args)):
        raw = {"span_nbytes": st.span_nbytes, "stats": {"dtype": st.stats.dtype, **stats}}
        assert torch.equal(ns["synthesize"](torch, raw, j), a.view(torch.uint8)), st.stats.dtype


RSS_PROBE = """\
import sys
import torch
import kdump.bundle.tensors
from kdump.bundle import load_bundle
torch.randn(1 << 18).to(torch.bool)  # the kernels' first use allocates their own pools
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
call = load_bundle(sys.argv[1]).calls[0]
before = peak()
x = call.args[0]
assert x.numel() == int(sys.argv[2])
print(peak() - before)
"""


def test_a_recreated_span_costs_its_size(tmp_path: Path) -> None:
    """A 32 MiB bool span re-created from statistics: about 32 MiB, not 20 times that."""
    span = 32 << 20
    t = torch.zeros(span, dtype=torch.bool)
    path = save_calls(tmp_path / "b.kdump", [capture_call(f"{MOD}:fn", [t], {}, names=["m"])])

    def edit(m: dict) -> None:
        st = m["calls"][0]["storages"][0]
        st.pop("pieces", None)  # a span over the piece size is written in pieces
        st.update(source="by-reference", blob="")
        st["stats"] = {"dtype": "bool", "min": 0.0, "max": 1.0, "mean": 0.5, "std": 0.5}

    _rewrite(path, edit)
    proc = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(path), str(span)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    grew = int(proc.stdout.strip())
    assert grew < span + (24 << 20), f"peak grew {grew >> 20} MiB for a {span >> 20} MiB span"


# --- rich emoji codes ----------------------------------------------------------------------------
def test_emoji_codes_in_bundle_strings_print_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "none.toml"))
    target = "kd_no_such_module:boom:fn"
    rec = capture_call(target, [torch.ones(2)], {}, names=[":fire:"], meta={"note": ":skull:"})
    env = {"hostname": "gpu-:skull:-7", "libraries": {":snake:": {"version": ":boom:"}}}
    bundle = save_calls(tmp_path / "emoji.kdump", [rec], env=env)
    code, out, err = _cli(capsys, "info", str(bundle))
    assert code == 0, err
    assert "gpu-\\x3askull:-7" in out and "\\x3asnake:" in out
    code, out, err = _cli(capsys, "replay", str(bundle), *REPLAY, "--allow-target", "*")
    assert code != 0 and "verdict:" in out, out + err
    assert "kd_no_such_module\\x3aboom:fn" in _flat(out)
    for shown in (out, err):
        assert not any(ch in shown for ch in "\U0001f480\U0001f4a5\U0001f525\U0001f40d")


# --- symlinked bundles and kdump pack ------------------------------------------------------------
@pytest.fixture
def linked(tmp_path: Path) -> tuple[Path, Path, torch.Tensor]:
    """A capture folder with a shared store, and a folder elsewhere holding a symlink to one of
    its bundles: (the link, the real bundle, the tensor recorded)."""
    from kdump.bundle import BlobStore

    cap = tmp_path / "dumps"
    x = torch.arange(64, dtype=torch.float32)
    real = save_calls(cap / "p1" / "a.kdump", [capture_call("m:f", [x], {})], store=BlobStore(cap))
    share = tmp_path / "share"
    share.mkdir()
    link = share / "link.kdump"
    link.symlink_to(real)
    return link, real, x


def _packed_holds(path: Path, x: torch.Tensor) -> None:
    from kdump.bundle import load_bundle

    b = load_bundle(path)
    assert {info.where.value for info in b.blobs.values()} == {"inline"}
    assert torch.equal(b.calls[0].args[0], x)


def test_pack_a_folder_holding_a_symlinked_bundle(
    linked: tuple[Path, Path, torch.Tensor], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link, _, x = linked
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = _cli(capsys, "pack", str(link.parent), "-o", str(out))
    assert code == 0, err
    _packed_holds(out / "link.kdump", x)
    code, _, err = _cli(capsys, "pack", str(link.parent))
    assert code == 0, err
    _packed_holds(tmp_path / "share.packed" / "link.kdump", x)


def test_pack_a_link_writes_beside_the_link(
    linked: tuple[Path, Path, torch.Tensor], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link, real, x = linked
    code, out, err = _cli(capsys, "pack", str(link))
    assert code == 0, err
    beside = tmp_path / "share.packed" / "link.kdump"
    assert f"wrote {beside}" in out
    _packed_holds(beside, x)
    assert not (tmp_path / "dumps.packed").exists()
    # -o naming the link itself (or its target) would overwrite the bundle.
    for target in (link, real):
        code, _, err = _cli(capsys, "pack", str(link), "-o", str(target))
        assert code == ExitCode.USAGE and "overwrite the bundle" in err, err


def test_pack_never_overwrites_another_file_silently(
    linked: tuple[Path, Path, torch.Tensor], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link, _, x = linked
    dst = tmp_path / "issue.kdump"
    dst.write_bytes(b"my notes, not a bundle")
    code, _, err = _cli(capsys, "pack", str(link), "-o", str(dst))
    assert code == ExitCode.USAGE and "--force" in err and len(err.strip().splitlines()) == 1
    assert dst.read_bytes() == b"my notes, not a bundle"
    assert [p.name for p in tmp_path.iterdir() if "pack-tmp" in p.name] == []
    code, _, err = _cli(capsys, "pack", str(link), "-o", str(dst), "--force")
    assert code == 0, err
    _packed_holds(dst, x)
    packed = dst.read_bytes()
    code, _, err = _cli(capsys, "pack", str(link), "-o", str(dst))  # the same bytes: fine
    assert code == 0, err
    assert dst.read_bytes() == packed
