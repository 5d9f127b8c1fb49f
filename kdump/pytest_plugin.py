"""pytest plugin: recorded bundles as regression tests.

    pytest --kdump captures/ --kdump-mode eager --kdump-backend reference -n 4

Each .kdump file under a --kdump path becomes one test item (named by its path, the mode in
brackets) that replays every call of the bundle: verdict exit 0 passes, 125 (cannot run here)
skips with the reason, anything else fails with the verdict's headline and findings. Items are
independent, so pytest-xdist spreads them over workers; with several GPUs, worker gwN replays on
GPU N mod count. Installed, the plugin loads itself (entry point `pytest11`); from a source
checkout add `-p kdump.pytest_plugin` (the entry point has the module's name, so passing it when
kdump is installed too is harmless).

Tests can also replay a bundle themselves through the `kdump_replay` fixture:

    @pytest.mark.kdump("bug123.kdump")  # relative to the test file's folder
    def test_bug123(kdump_replay):
        assert kdump_replay().exit_code == 0

A bundle runs only targets of a registered kernel plug-in; allow others explicitly, for bundles
you trust, with `--kdump-allow-target mod:fn` or the ini option `kdump_allow_targets`. Their
modules are imported from the environment pytest runs in and the folders of `--kdump-path DIR`
(or the ini option `kdump_path`); a bundle whose allowed target cannot be imported fails (a
DeepGEMM missing on this machine skips: another machine could replay it).

This module imports neither torch nor the rest of kdump until a bundle is replayed, so loading
the plugin costs nothing in test runs that do not use it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# Folder of a capture directory's shared blob store (kdump.bundle.STORE_DIRNAME; not imported so
# that collecting needs no torch).
_STORE_DIRNAME = "blobs"
_SETTINGS = {"mode": "eager", "backend": "auto", "device": "auto"}
_CANNOT_RUN = 125
_ROOTS = pytest.StashKey[list[Path]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kdump", "replay recorded kdump bundles as tests")
    group.addoption(
        "--kdump",
        action="append",
        default=[],
        dest="kdump_paths",
        metavar="PATH",
        help="Bundle file or folder of bundles to replay, one test per bundle (repeatable).",
    )
    group.addoption(
        "--kdump-mode", dest="kdump_mode", help="eager, graph, sanitizer or all (default eager)."
    )
    group.addoption(
        "--kdump-backend",
        dest="kdump_backend",
        help="auto, reference, deep_gemm, packaged or library (default auto).",
    )
    group.addoption(
        "--kdump-device", dest="kdump_device", help="auto, cpu, cuda or cuda:N (default auto)."
    )
    group.addoption(
        "--kdump-allow-target",
        action="append",
        default=[],
        dest="kdump_allow_targets",
        metavar="MOD:FN",
        help="Replay this target although no kernel plug-in knows it (repeatable; globs).",
    )
    group.addoption(
        "--kdump-path",
        action="append",
        default=[],
        dest="kdump_import_paths",
        metavar="DIR",
        help="Folder the replays import allowed targets from (repeatable).",
    )
    parser.addini("kdump_paths", "Bundles or folders to replay as tests.", type="paths")
    parser.addini(
        "kdump_path",
        "Folders the replays import allowed targets from (relative to the ini file).",
        type="paths",
    )
    parser.addini(
        "kdump_allow_targets",
        "Targets (globs) replayed although no kernel plug-in knows them.",
        type="linelist",
    )
    for name, default in _SETTINGS.items():
        parser.addini(f"kdump_{name}", f"Replay {name} of kdump items.", default=default)


def setting(config: pytest.Config, name: str) -> str:
    """A replay setting: command line, else ini file, else the default."""
    value = config.getoption(f"kdump_{name}")
    return str(value) if value else str(config.getini(f"kdump_{name}") or _SETTINGS[name])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kdump(path): the bundle that the kdump_replay fixture replays"
    )
    base = config.invocation_params.dir
    given = [Path(p) for p in config.getoption("kdump_paths")]
    roots = [p if p.is_absolute() else base / p for p in given]
    if not roots:
        roots = list(config.getini("kdump_paths"))  # ini paths are relative to the ini file
    config.stash[_ROOTS] = [r.resolve() for r in roots]
    if not roots:
        return
    # `pytest --kdump DIR` collects DIR instead of the project's testpaths (positional paths
    # stay); ini paths are collected along with the testpaths, not when paths were given.
    explicit = config.args_source == pytest.Config.ArgsSource.ARGS
    if not given and explicit:
        return
    if given and not explicit:
        config.args = []
    covered = [(base / a.split("::")[0]).resolve() for a in config.args]
    for root in config.stash[_ROOTS]:
        if not any(root == c or c in root.parents for c in covered):
            config.args.append(str(root))


def _under(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix != ".kdump" or _STORE_DIRNAME in file_path.parts[:-1]:
        return None
    if not _under(file_path.resolve(), parent.config.stash.get(_ROOTS, [])):
        return None
    return KdumpFile.from_parent(parent, path=file_path)


class KdumpFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        yield KdumpItem.from_parent(self, name=f"[{setting(self.config, 'mode')}]")


class ReplayFailed(Exception):
    """A replay verdict other than clean or cannot-run; the message is the report."""


def gpu_for_worker(worker: str | None, visible: Sequence[str]) -> str | None:
    """The GPU an xdist worker (gwN) replays on: visible[N mod len], or None when there is no
    worker id or fewer than two GPUs (then nothing is pinned)."""
    match = re.fullmatch(r"gw(\d+)", worker or "")
    if match is None or len(visible) < 2:
        return None
    return visible[int(match.group(1)) % len(visible)]


def _visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


@contextlib.contextmanager
def _worker_gpu(device: str) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES for the replay children: one GPU per xdist worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    # An explicit cuda:N names its GPU itself; pinning would hide it.
    pin = worker is not None and device in ("auto", "cuda")
    gpu = gpu_for_worker(worker, _visible_gpus()) if pin else None
    if gpu is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def allowed_targets(config: pytest.Config) -> tuple[str, ...]:
    """What the command line and the ini file allow beyond the plug-ins' targets."""
    return (*config.getoption("kdump_allow_targets"), *config.getini("kdump_allow_targets"))


def import_paths(config: pytest.Config) -> tuple[str, ...]:
    """The --kdump-path folders (relative to where pytest was started) and the ini option's
    (relative to the ini file), absolute."""
    base = config.invocation_params.dir
    given = [Path(p) for p in config.getoption("kdump_import_paths")]
    ini = [Path(p) for p in config.getini("kdump_path")]
    return tuple(str(p if p.is_absolute() else base / p) for p in [*given, *ini])


def refusal(path: Path | str, allowed: Sequence[str], paths: Sequence[str]) -> str | None:
    """Why the bundle at `path` cannot be replayed as asked, in the plugin's own options (the
    replay's messages name the CLI's): a target nobody allowed, or an allowed target whose
    module the replay would not find. None when it can go ahead."""
    from kdump.bundle import load_bundle
    from kdump.doctor import importable_at_replay, unclaimed_targets
    from kdump.kernels.registry import target_allowed
    from kdump.text import visible

    targets = [c.target for c in load_bundle(path).calls]
    for t in unclaimed_targets(targets):
        shown = visible(t, 200)
        if not target_allowed(t, allowed):
            return (
                f"the bundle asks to run {shown}, which is no kernel plug-in's; if you trust the "
                f"bundle, pass --kdump-allow-target '{shown}' (or add it to the ini option "
                "kdump_allow_targets)"
            )
        module = t.partition(":")[0]
        if not importable_at_replay(module, paths):  # torch.ops namespaces always are
            return (
                f"cannot import {visible(module, 200)} to replay {shown}: pass --kdump-path DIR "
                "with the folder that holds it (or add it to the ini option kdump_path)"
            )
    return None


def run_replay(path: Path | str, mode: str, backend: str, device: str, **kw: Any) -> list[Any]:
    from kdump.replay import replay
    from kdump.replay.options import ReplayOptions

    # `paths` (the import folders) through the options: replay()'s first argument has that name.
    base = ReplayOptions(paths=tuple(kw.pop("paths", ())))
    with _worker_gpu(device):
        return replay([path], base, mode=mode, backend=backend, device=device, **kw)


def describe(verdicts: Sequence[Any]) -> str:
    """Verdicts as the text of a failure report: headline, findings, notes."""
    lines = []
    for v in verdicts:
        lines.append(f"call {v.call} ({v.target}): exit {v.exit_code}: {v.headline()}")
        lines += [f"  {f.kind} at {f.step}: {f.message}" for f in v.findings]
        lines += [f"  note: {n}" for n in v.notes]
    return "\n".join(lines)


def _unimportable(v: Any) -> bool:
    """A call of an allowed target (no plug-in's) whose module could not be imported: the
    user's own code missing from the path is a failure, not a machine that cannot run it."""
    if v.exit_code != _CANNOT_RUN:
        return False
    from kdump.kernels.registry import claiming_plugin

    cannot_import = any(str(f.message).startswith("cannot import ") for f in v.findings)
    return cannot_import and claiming_plugin(str(v.target)) is None


def outcome(verdicts: Sequence[Any]) -> tuple[str, str]:
    """("passed" | "skipped" | "failed", why). A call that cannot run here does not hide a
    failing call of the same bundle."""
    codes = [v.exit_code for v in verdicts]
    if any(c not in (0, _CANNOT_RUN) for c in codes):
        return "failed", describe(verdicts)
    if any(_unimportable(v) for v in verdicts):
        hint = "pass --kdump-path DIR with the folder that holds it (or the ini option kdump_path)"
        return "failed", f"{describe(verdicts)}\n{hint}"
    if _CANNOT_RUN in codes:
        return "skipped", "; ".join(v.headline() for v in verdicts if v.exit_code == _CANNOT_RUN)
    return "passed", ""


class KdumpItem(pytest.Item):
    def runtest(self) -> None:
        mode, backend, device = (setting(self.config, n) for n in ("mode", "backend", "device"))
        from kdump.cli.common import dumps_strict
        from kdump.errors import BundleError, UsageError

        allowed, paths = allowed_targets(self.config), import_paths(self.config)
        try:
            why = refusal(self.path, allowed, paths)
            if why is not None:
                raise ReplayFailed(why)
            verdicts = run_replay(
                self.path, mode, backend, device, allow_targets=allowed, paths=paths
            )
        except (UsageError, BundleError) as exc:  # an invalid bundle: the message says what to do
            raise ReplayFailed(str(exc)) from None
        self.user_properties.append(
            ("kdump_verdicts", dumps_strict([v.to_json() for v in verdicts], indent=None))
        )
        result, why = outcome(verdicts)
        if result == "skipped":
            pytest.skip(why)
        if result == "failed":
            raise ReplayFailed(why)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, ReplayFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"kdump replay {self.name}"


@pytest.fixture
def kdump_replay(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """A function that replays one call of a bundle and returns its Verdict. The bundle defaults
    to the test's @pytest.mark.kdump(path); mode, backend and device to the kdump settings."""
    marker = request.node.get_closest_marker("kdump")
    default = marker.args[0] if marker is not None and marker.args else None

    def run(
        path: str | Path | None = None,
        *,
        call: int = 0,
        mode: str | None = None,
        backend: str | None = None,
        device: str | None = None,
    ) -> Any:
        chosen = path if path is not None else default
        if chosen is None:
            raise pytest.UsageError("kdump_replay: give a path or mark the test with kdump(path)")
        p = Path(chosen)
        if not p.is_absolute() and not p.exists():
            p = request.path.parent / p
        cfg = request.config
        allowed, paths = allowed_targets(cfg), import_paths(cfg)
        why = refusal(p, allowed, paths)
        if why is not None:
            pytest.fail(f"kdump_replay({p}): {why}", pytrace=False)
        [verdict] = run_replay(
            p,
            mode or setting(cfg, "mode"),
            backend or setting(cfg, "backend"),
            device or setting(cfg, "device"),
            calls=[call],
            allow_targets=allowed,
            paths=paths,
        )
        return verdict

    return run
