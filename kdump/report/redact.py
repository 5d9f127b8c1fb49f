"""`--redact`: take host names, user names, paths and environment values out of a report."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

HOST = "<host>"
USER = "<user>"
VALUE = "<redacted>"
_HOME = re.compile(r"/(?:home|Users)/([^/\s'\"]+)")
_PATH = re.compile(r"(?<![\w.<>-])(?:~|\.{1,2})?(?:/[^\s/'\",;:=]+)+/?")
_USER_VARS = ("USER", "LOGNAME", "USERNAME")
# Keys that name a host or a user anywhere in a call's meta (flight-recorder bundles keep
# meta["process"]["host"]; a plug-in or a later recorder may add others).
_HOST_KEYS = frozenset({"host", "hostname", "node", "nodename"})
_USER_KEYS = frozenset({"user", "username", "login", "logname"})
_MIN_SECRET = 8


def _named(tree: Any, keys: frozenset[str]) -> Iterable[str]:
    """Every non-empty string value under one of `keys` (lower case; the tree's keys are
    compared in lower case), at any depth."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            if str(k).lower() in keys and isinstance(v, str) and v:
                yield v
            else:
                yield from _named(v, keys)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _named(v, keys)


def _strings(tree: Any) -> Iterable[str]:
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _strings(v)


@dataclass(frozen=True)
class Redactor:
    """Identity when disabled; else replaces what `from_env` learnt is private."""

    enabled: bool = False
    hosts: tuple[str, ...] = ()
    users: tuple[str, ...] = ()
    extra: tuple[str, ...] = field(default=())  # literal strings to hide (env values)

    @classmethod
    def from_env(
        cls,
        envs: Iterable[Mapping[str, Any]],
        enabled: bool,
        metas: Iterable[Mapping[str, Any]] = (),
    ) -> Redactor:
        """What to hide, learnt from the bundle's environments and its calls' meta."""
        if not enabled:
            return cls()
        hosts: set[str] = set()
        users: set[str] = set()
        values: set[str] = set()
        for meta in metas:
            for host in _named(meta, _HOST_KEYS):
                hosts.update((host, host.split(".")[0]))
            users.update(_named(meta, _USER_KEYS))
            for s in _strings(meta):
                users.update(m.group(1) for m in _HOME.finditer(s))
        for env in envs:
            host = env.get("hostname")
            if isinstance(host, str) and host:
                hosts.add(host)
                hosts.add(host.split(".")[0])
            env_vars = env.get("env_vars") or {}
            if isinstance(env_vars, Mapping):
                for k, v in env_vars.items():
                    if k in _USER_VARS and isinstance(v, str) and v:
                        users.add(v)
                    # Short values ("1", "false") would blank unrelated words of the report;
                    # they are hidden in the environment table only.
                    if isinstance(v, str) and len(v) >= _MIN_SECRET:
                        values.add(v)
            for s in _strings(env):
                users.update(m.group(1) for m in _HOME.finditer(s))
        return cls(
            True,
            tuple(sorted(hosts, key=len, reverse=True)),
            tuple(sorted(users, key=len, reverse=True)),
            tuple(sorted(values, key=len, reverse=True)),
        )

    def text(self, value: Any) -> str:
        s = str(value)
        if not self.enabled:
            return s
        for v in self.extra:
            s = s.replace(v, VALUE)
        s = _PATH.sub(lambda m: f"<path>/{PurePath(m.group(0)).name}", s)
        for h in self.hosts:
            s = re.sub(rf"(?<![\w-]){re.escape(h)}(?![\w-])", HOST, s)
        for u in self.users:
            s = re.sub(rf"(?<![\w-]){re.escape(u)}(?![\w-])", USER, s)
        return s

    def env_value(self, key: str, value: str) -> str:
        """Environment variable values are hidden whole: they may hold tokens or paths."""
        if self.enabled and key.startswith("env_vars."):
            return VALUE
        return self.text(value)

    def path(self, path: str) -> str:
        return PurePath(path).name if self.enabled else path
