"""The one place that reads kdump's environment variables.

Every variable is declared here with its meaning; `kdump record --help` lists them and bundles
record their values (see `envinfo`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kdump.errors import UsageError


@dataclass(frozen=True)
class EnvVar:
    name: str
    help: str
    default: str | None = None


# Sorted by topic (recording, kdump's own log, tools and builds); add a variable to its topic.
ENV_VARS: tuple[EnvVar, ...] = (
    # -- recording (`kdump record` sets these in CMD's processes)
    EnvVar("KDUMP_RECORD", "set to 1 by `kdump record`: activates recording at interpreter start"),
    EnvVar(
        "KDUMP_TARGETS", "comma-separated targets (module:qualname or a preset such as deep_gemm)"
    ),
    EnvVar("KDUMP_OUT", "output directory for bundles", "kdump-out"),
    EnvVar(
        "KDUMP_MODE",
        "recording mode: ring (flight recorder, `kdump record`'s default) or sync "
        "(`kdump.recording()`'s default)",
    ),
    EnvVar("KDUMP_CALLS", "call index ranges to dump, e.g. '0-9,100,200-'"),
    EnvVar("KDUMP_EVERY", "dump every N-th call"),
    EnvVar(
        "KDUMP_FIRST_PER_SIGNATURE", "dump the first K calls per (shape, dtype, layout) signature"
    ),
    EnvVar("KDUMP_RANKS", "ranks to record, e.g. '0' or '0-3' (others record nothing)"),
    EnvVar("KDUMP_PREDICATE", "module:function called with the call's arguments; truthy = dump"),
    EnvVar("KDUMP_MAX_BUNDLES", "at most this many bundles per process"),
    EnvVar("KDUMP_MAX_BYTES", "at most this many bytes of bundles per process (suffixes K, M, G)"),
    EnvVar("KDUMP_KEEP", "which bundles survive the limits: oldest or newest", "oldest"),
    EnvVar(
        "KDUMP_ON_EXCEPTION",
        "1: dump the arguments of every call that raised (snapshots every call: costly)",
        "0",
    ),
    EnvVar(
        "KDUMP_OUTPUTS",
        "outputs snapshot after the call (sync mode): default (the spec's, e.g. DeepGEMM's d; "
        "every tensor argument of a generic target), none, all (every tensor argument), or "
        "comma-separated parameter names / positions",
        "default",
    ),
    EnvVar("KDUMP_FLUSH_SIGNAL", "signal name that flushes pending bundles, e.g. USR1"),
    # -- writing bundles
    EnvVar(
        "KDUMP_PIECE_BYTES",
        "storages larger than this are written as pieces of this size, each a blob hashed by "
        "its own pool worker (a multiple of 1M, at least 1M; suffixes K, M, G)",
        "16M",
    ),
    # -- replay
    EnvVar(
        "KDUMP_CONFIG",
        "the user's kdump config file (allow-targets = [...]: targets replay may run)",
        "~/.config/kdump/config.toml",
    ),
    # -- reading bundles
    EnvVar(
        "KDUMP_MAX_LOAD_BYTES",
        "most bytes loading one call of a bundle may allocate, and its blobs may declare "
        "(suffixes K, M, G, T; default 64G); --max-load-bytes on info/replay sets it",
    ),
    # -- the flight recorder (mode ring)
    EnvVar("KDUMP_RING_SLOTS", "journal slots: the last calls kept per process", "64"),
    EnvVar("KDUMP_SLOT_BYTES", "bytes per journal slot (suffixes K, M, G)", "1M"),
    EnvVar(
        "KDUMP_STATIC_BYTES",
        "bytes of the static region: weights copied once per version (suffixes K, M, G; 0: off)",
        "1G",
    ),
    EnvVar(
        "KDUMP_DEVICE_BYTES",
        "device memory of the flight recorder per GPU: the journal's twin and the ring of "
        "gathered rows (suffixes K, M, G; 0 turns the device tier off)",
        "1G",
    ),
    EnvVar(
        "KDUMP_JOURNAL_DIR",
        "folder of the journals; it must be in shared memory (tmpfs), where CUDA can pin "
        "file-backed pages; `kdump record` sets one per run",
        "/dev/shm",
    ),
    EnvVar(
        "KDUMP_SALVAGER",
        "Unix socket of the salvage process that `kdump record` starts; recorded processes "
        "announce their device-tier memory there (set by `kdump record`)",
    ),
    # -- kdump's own log
    EnvVar("KDUMP_LOG", "file that kdump's own log lines go to (default: stderr)"),
    # -- tools and builds
    EnvVar("KDUMP_CACHE_DIR", "cache for compiled kernels", "~/.cache/kdump"),
    EnvVar("KDUMP_SANITIZER", "path of the compute-sanitizer binary to use"),
    EnvVar("CUDA_HOME", "CUDA toolkit root searched first for CUDA tools and headers"),
    EnvVar("CUDA_PATH", "CUDA toolkit root searched after CUDA_HOME"),
    # -- kernel libraries' own variables (read into a bundle's manifest; kdump never sets them)
    EnvVar(
        "DG_JIT_CACHE_DIR",
        "DeepGEMM's JIT cache (':'-separated folders, misses compiled into the first); unset: "
        "DJ_JIT_CACHE_DIR on DeepJIT builds (2.8+), then $HOME/.dj ($HOME/.deep_gemm before)",
    ),
    EnvVar(
        "DJ_JIT_CACHE_DIR",
        "DeepJIT's process-wide JIT cache: DG_JIT_CACHE_DIR's fallback (each DG_JIT_* setting "
        "falls back to its DJ_JIT_* twin)",
    ),
)

_BY_NAME = {v.name: v for v in ENV_VARS}

# Prefixes of variables that bundles record because they change what kernels do.
RECORDED_PREFIXES = (
    "DG_",
    "DJ_",  # DeepJIT: the fallback of DeepGEMM's DG_JIT_* settings
    "KDUMP_",
    "CUDA_",
    "PYTORCH_",
    "NCCL_",
    "TORCH_CUDA",
    "SGLANG_",
    "VLLM_",
)
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def environ() -> dict[str, str]:
    """A copy of the process environment: what children are given, and a seam for tests."""
    return dict(os.environ)


_ENCODED_KEYS: dict[str, object] = {}


def peek(name: str) -> str | None:
    """os.environ.get(name), without the KeyError a miss raises inside os.environ (a per-call
    path that looks for variables which are usually unset, such as the rank variables). The
    environment is read live every time, so a variable set or changed later is seen."""
    env = os.environ
    data = getattr(env, "_data", None)
    if type(env) is not os._Environ or not isinstance(data, dict):  # replaced by a caller
        return env.get(name)
    key = _ENCODED_KEYS.get(name)
    if key is None:
        key = _ENCODED_KEYS[name] = env.encodekey(name)  # type: ignore[attr-defined]
    raw = data.get(key)
    return None if raw is None else env.decodevalue(raw)  # type: ignore[attr-defined]


def peek_set(names: tuple[str, ...]) -> dict[str, str]:
    """The variables of `names` that are set, with their values: `peek` for a group of names
    that are usually all unset (one look at the environment when none is)."""
    env = os.environ
    data = getattr(env, "_data", None)
    if type(env) is not os._Environ or not isinstance(data, dict):
        return {n: env[n] for n in names if n in env}
    keys = _KEY_SETS.get(names)
    if keys is None:
        keys = _KEY_SETS[names] = frozenset(env.encodekey(n) for n in names)  # type: ignore[attr-defined]
    if keys.isdisjoint(data):
        return {}
    return {n: v for n in names if (v := peek(n)) is not None}


_KEY_SETS: dict[tuple[str, ...], frozenset[object]] = {}


def get(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """Value of a declared kdump variable, or its default."""
    var = _BY_NAME[name]  # KeyError on undeclared names: every variable must be declared above
    value = (env if env is not None else os.environ).get(name)
    return value if value not in (None, "") else var.default


def get_flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    value = get(name, env)
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


# --- units: what the variables and the command line give as sizes -----------------------------
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """'512', '10K', '1.5G', '2GiB' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _BYTES_RE.match(text)
    if not m:
        raise UsageError(f"bad byte count {text!r}: use e.g. 500M or 2G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


# Values that carry secrets whatever the variable or argument is called.
_SECRET_VALUE_PATTERNS = (
    re.compile(r"(?i)(--?[\w-]*(?:token|key|secret|password|passwd|credential|auth)[\w-]*[=:])\S+"),
    re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)[^@\s]+(@)"),
)


def redact_value(value: str) -> str:
    """`value` with secrets that patterns recognise replaced (`--api-key=...`, URLs with a
    password)."""
    out = _SECRET_VALUE_PATTERNS[0].sub(r"\1<redacted>", value)
    return _SECRET_VALUE_PATTERNS[1].sub(r"\1<redacted>\2", out)


def redact_argv(argv: list[str]) -> list[str]:
    """argv with secret values redacted, also the one after a bare secret flag (`--token X`)."""
    out: list[str] = []
    hide = False
    for a in argv:
        out.append("<redacted>" if hide else redact_value(a))
        hide = a.startswith("-") and "=" not in a and is_secret(a.lstrip("-").replace("-", "_"))
    return out


def recorded_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables that bundles record; values of secret-looking names are redacted."""
    source = env if env is not None else os.environ
    out: dict[str, str] = {}
    for name in sorted(source):
        if name.startswith(RECORDED_PREFIXES):
            out[name] = "<redacted>" if is_secret(name) else redact_value(source[name])
    return out


# DeepGEMM's JIT settings: DG_JIT_<X>, falling back to DeepJIT's DJ_JIT_<X> on builds whose JIT
# is DeepJIT (2.8 and later lines); the cache folder has a default of its own.
DEEPGEMM_JIT_PREFIX = "DG_JIT_"
DEEPJIT_PREFIX = "DJ_JIT_"


def deepgemm_jit_settings(
    deepjit: bool, env: Mapping[str, str] | None = None
) -> dict[str, dict[str, str]]:
    """Each JIT setting DeepGEMM runs with, by suffix: {"value", "from"} where "from" is the
    variable that gave it (DG_JIT_X, else DJ_JIT_X when `deepjit`) or "default" (CACHE_DIR
    only: $HOME/.dj with DeepJIT, $HOME/.deep_gemm before). Secret-looking values redacted."""
    source = env if env is not None else os.environ
    prefixes = (DEEPGEMM_JIT_PREFIX, DEEPJIT_PREFIX) if deepjit else (DEEPGEMM_JIT_PREFIX,)
    suffixes = {k[len(p) :] for k in source for p in prefixes if k.startswith(p)} | {"CACHE_DIR"}
    out: dict[str, dict[str, str]] = {}
    for suffix in sorted(suffixes):
        for var in (p + suffix for p in prefixes):
            value = source.get(var)
            if value:
                shown = "<redacted>" if is_secret(var) else redact_value(value)
                out[suffix] = {"value": shown, "from": var}
                break
        else:
            if suffix == "CACHE_DIR":
                home = source.get("HOME") or str(Path.home())
                folder = ".dj" if deepjit else ".deep_gemm"
                out[suffix] = {"value": f"{home}/{folder}", "from": "default"}
    return out


def config_path(env: Mapping[str, str] | None = None) -> Path:
    """The user's config file. Only this one is read: a config in the current folder could have
    arrived with the bundle, and a bundle never chooses what replay trusts."""
    return Path(get("KDUMP_CONFIG", env) or "").expanduser()


def user_config(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The user's config file as a table ({} when there is none)."""
    path = config_path(env)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise UsageError(f"cannot read the kdump config {path}: {exc}; fix or remove it") from None
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise UsageError(
                f"reading the kdump config {path} needs Python 3.11+ or `pip install tomli`"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"kdump config {path} is not valid TOML ({exc}); fix it") from None


def allowed_targets(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """`allow-targets` of the user's config file: 'module:function' names or globs ('mod:*')."""
    value = user_config(env).get("allow-targets", [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(
            f'allow-targets in {config_path(env)} must be a list of strings like "mod:fn"'
        )
    return tuple(value)


def help_table() -> str:
    """Text listing of every variable, for `--help` epilogs."""
    width = max(len(v.name) for v in ENV_VARS)
    lines = []
    for v in ENV_VARS:
        default = f" (default: {v.default})" if v.default is not None else ""
        lines.append(f"{v.name.ljust(width)}  {v.help}{default}")
    return "\n".join(lines)
