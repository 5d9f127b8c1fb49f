"""Which build of a library ran: distribution, version, commit, file, and how it is bound.

DeepGEMM's lines number their versions independently (upstream 2.8.x, tokenspeed-deepgemm 2.8.2,
sgl-deep-gemm 0.2.5, deepinfer-gemm, nv_dev wheels numbered 0.1.5.post3, vLLM's vendored copy
under vLLM's own version), so a version alone does not say which code ran. The manifest keeps:

* `distribution` and `version`: the installed distribution whose files include the module (two
  lines can both install a `deep_gemm` package; the one that owns the imported file counts);
* `commit` and where it came from: an attribute the package carries (`__commit__`,
  `__git_version__`, `git_version`, a `version` submodule's `git_version`), the VCS commit pip
  recorded (direct_url.json of the dist-info), a git hash in the version's local part
  (`+g1a2b3c4`), or the checkout the module was imported from (its .git HEAD, read as files);
* `file`: the module's path, and `install`: wheel, editable, checkout or vendored.

Everything here reads metadata and small files only, never imports anything, and never raises:
a fact it cannot find is left out. Results are cached per module object.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

_COMMIT_ATTRS = ("__commit__", "__git_commit__", "__git_hash__", "__git_version__", "git_version")
_HEX = re.compile(r"^g?([0-9a-f]{7,40})$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
_CACHE: dict[str, dict[str, Any]] = {}  # per extension folder: the JIT line
_BUILDS: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(module) -> (module, its facts)
_LOCK = threading.Lock()


def commit_in_version(version: str | None) -> str | None:
    """A git hash in a version's local part ('2.1.1+g1a2b3c4', '0.2.5+cu128.abcdef12'), or None."""
    if not isinstance(version, str) or "+" not in version:
        return None
    for token in re.split(r"[.+_-]", version.partition("+")[2]):
        m = _HEX.match(token.lower())
        if m and any(c.isdigit() for c in m.group(1)) and any(c.isalpha() for c in m.group(1)):
            return m.group(1)
    return None


def _attr_commit(module: Any) -> tuple[str, str] | None:
    holders = [module]
    for sub in ("version", "_version"):
        loaded = sys.modules.get(f"{getattr(module, '__name__', '')}.{sub}")
        if loaded is not None:
            holders.append(loaded)
    for holder in holders:
        for attr in _COMMIT_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, str) and value.strip():
                return value.strip()[:64], f"{getattr(holder, '__name__', '?')}.{attr}"
    return None


def _owning_distribution(module_name: str, file: Path) -> metadata.Distribution | None:
    """The installed distribution whose files include `file` (or that installs the module's top
    package when only one does)."""
    top = module_name.partition(".")[0]
    try:
        candidates = metadata.packages_distributions().get(top, [])
    except Exception:
        return None
    found = []
    for name in dict.fromkeys(candidates):
        try:
            dist = metadata.distribution(name)
        except Exception:
            continue
        if _owns(dist, file):
            return dist
        found.append(dist)
    return found[0] if len(found) == 1 else None


def _owns(dist: metadata.Distribution, file: Path) -> bool:
    try:
        files = dist.files or []
    except Exception:
        return False
    want = file.resolve()
    for f in files:
        if f.name == file.name:
            try:
                if Path(dist.locate_file(f)).resolve() == want:
                    return True
            except Exception:
                continue
    editable = _direct_url(dist).get("dir_info", {}).get("editable")
    url = str(_direct_url(dist).get("url", ""))
    return bool(editable) and url.startswith("file://") and str(want).startswith(url[7:])


def _direct_url(dist: metadata.Distribution) -> dict[str, Any]:
    try:
        text = dist.read_text("direct_url.json")
        data = json.loads(text) if text and len(text) < 65536 else {}
    except Exception:
        return {}
    return data if isinstance(data, dict) else {}


def _read_small(path: Path, limit: int = 4096) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace").strip()
    except OSError:
        return None


def checkout_commit(file: Path, levels: int = 8) -> tuple[str, str] | None:
    """The HEAD commit of the git checkout that contains `file` (read from .git, no git run)."""
    folder = file.resolve().parent
    for _ in range(levels):
        git = folder / ".git"
        if git.is_file():  # a worktree or submodule: "gitdir: <path>"
            text = _read_small(git) or ""
            if text.startswith("gitdir:"):
                git = (folder / text[7:].strip()).resolve()
        if git.is_dir():
            return _head(git), str(folder)
        if folder.parent == folder:
            return None
        folder = folder.parent
    return None


def _head(git: Path) -> str:
    head = _read_small(git / "HEAD") or ""
    if not head.startswith("ref:"):
        return head[:40]
    ref = head[4:].strip()
    common = git
    common_dir = _read_small(git / "commondir")
    if common_dir:
        common = (git / common_dir).resolve()
    for base in (git, common):
        value = _read_small(base / ref)
        if value and _SHA.match(value[:40]):
            return value[:40]
    packed = _read_small(common / "packed-refs", 1 << 20) or ""
    for line in packed.splitlines():
        sha, _, name = line.partition(" ")
        if name.strip() == ref and _SHA.match(sha):
            return sha
    return f"unresolved {ref}"[:80]


def module_build(module: Any) -> dict[str, Any]:
    """The build facts of an imported module (see the module docstring); {} if it has no file."""
    file = getattr(module, "__file__", None)
    name = getattr(module, "__name__", None)
    if not isinstance(file, str) or not isinstance(name, str):
        return {}
    with _LOCK:
        hit = _BUILDS.get(id(module))
    if hit is not None and hit[0] is module:  # the module is held: its id is not reused
        return dict(hit[1])
    try:
        facts = _collect(module, name, Path(file))
    except Exception as exc:  # never break recording
        facts = {"module": name, "file": file, "error": f"{type(exc).__name__}: {exc}"[:200]}
    with _LOCK:
        _BUILDS[id(module)] = (module, facts)
    return dict(facts)


def _collect(module: Any, name: str, file: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"module": name, "file": str(file)}
    mod_version = getattr(module, "__version__", None)
    if isinstance(mod_version, str):
        out["module_version"] = mod_version
    dist = _owning_distribution(name, file)
    direct: dict[str, Any] = {}
    if dist is not None:
        out["distribution"] = str(dist.metadata.get("Name") or "")
        out["version"] = str(dist.version)
        direct = _direct_url(dist)
    # a library module inside another package (vllm.third_party.deep_gemm) ships with it
    out["install"] = _install_kind(direct, "." in name, dist is None)
    commit = _commit(module, out, direct, file)
    if commit is not None:
        out["commit"], out["commit_from"] = commit
    return out


def _install_kind(direct: dict[str, Any], vendored: bool, no_dist: bool) -> str:
    if vendored:
        return "vendored"
    if no_dist:
        return "checkout"
    if direct.get("dir_info", {}).get("editable"):
        return "editable"
    return "wheel"


def _commit(
    module: Any, out: dict[str, Any], direct: dict[str, Any], file: Path
) -> tuple[str, str] | None:
    found = _attr_commit(module)
    if found is not None:
        return found
    vcs = direct.get("vcs_info")
    if isinstance(vcs, dict) and isinstance(vcs.get("commit_id"), str):
        return vcs["commit_id"][:64], "direct_url.json"
    for key in ("version", "module_version"):
        commit = commit_in_version(out.get(key))
        if commit is not None:
            return commit, f"{key} {out[key]}"
    if out.get("install") in ("checkout", "editable"):
        head = checkout_commit(file)
        if head is not None:
            return head[0], f"git checkout {head[1]}"
    return None


def describe(build: dict[str, Any] | None) -> str:
    """'sgl-deep-gemm 0.2.5 (commit 1a2b3c4)' for notes and `kdump doctor`."""
    if not isinstance(build, dict) or not build:
        return "unknown build"
    who = build.get("distribution") or build.get("module") or "?"
    ver = build.get("version") or build.get("module_version") or "?"
    commit = build.get("commit")
    extra = f" (commit {str(commit)[:12]})" if commit else ""
    return f"{who} {ver}{extra}"


def same(recorded: dict[str, Any] | None, here: dict[str, Any] | None) -> bool | None:
    """Whether two builds are the same code: distribution and version agree, and commits where
    both know one. None when the recording has no build facts (an older bundle)."""
    if not isinstance(recorded, dict) or not recorded.get("version"):
        return None
    if not isinstance(here, dict):
        return False
    for key in ("distribution", "version"):
        if recorded.get(key) != here.get(key):
            return False
    rc, hc = recorded.get("commit"), here.get("commit")
    return not (rc and hc and str(rc)[:12] != str(hc)[:12])


# What a DeepJIT-based build's extension holds: DeepJIT composes DJ_JIT_<X> at run time from
# its prefix, so the names themselves are not in the binary, but its namespace (in mangled
# symbols) and its assertion texts are. An older build's JIT holds its own cache default.
_DEEPJIT_MARKS = (b"8deep_jit", b"DJ is reserved for global environment variables", b"DJ_JIT_")
_LEGACY_MARKS = (b".deep_gemm",)
_EXTENSION_GLOBS = ("_C*.so", "_C_extension*.so", "deep_gemm_cpp*.so", "*.so")
_MAX_SCAN = 1 << 30


def jit_line(module: Any) -> str:
    """ "deepjit" when the module's extension is built on DeepJIT (DG_JIT_* settings fall back
    to DJ_JIT_*, cache in $HOME/.dj), "legacy" when it is DeepGEMM's own older JIT (cache in
    $HOME/.deep_gemm), "unknown" when no extension says which (a Python-only module)."""
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return "unknown"
    folder = Path(file).parent
    key = f"jit\0{folder}"
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return str(hit["line"])
    line = _scan_extensions(folder)
    with _LOCK:
        _CACHE[key] = {"line": line}
    return line


def _scan_extensions(folder: Path) -> str:
    import mmap

    for pattern in _EXTENSION_GLOBS:
        for path in sorted(folder.glob(pattern)):
            try:
                size = path.stat().st_size
                if not 0 < size <= _MAX_SCAN:
                    continue
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    if any(m.find(mark) >= 0 for mark in _DEEPJIT_MARKS):
                        return "deepjit"
                    if any(m.find(mark) >= 0 for mark in _LEGACY_MARKS):
                        return "legacy"
            except (OSError, ValueError):
                continue
    return "unknown"
