"""`kdump report --script`: a standalone repro script (torch and the kernel library only).

The script is the template `repro.py.tmpl` with five values filled in, none of them from the
bundle: the bundle path and the allow list the user gave, the kernel entry points of kdump's
plug-ins (their preset tables), the exit codes (kdump.errors), and the source of kdump's
synthetic-data generator (kdump.format.synthetic, for slimmed bundles). Everything else the script
reads from the bundle as data when it runs, so a bundle string can never become code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from importlib import resources
from pathlib import Path

from kdump.errors import ExitCode, UntrustedTargetError

TEMPLATE = "repro.py.tmpl"
_SLOTS = ('"@BUNDLE@"', '"@ALLOWED@"', '"@KNOWN_TARGETS@"', '"@EXIT_CODES@"', '"@GENERATOR@"')


def known_targets() -> dict[str, tuple[tuple[str, str], ...]]:
    """Target id -> the (module, function) pairs it may be imported as, from every plug-in's
    presets (recorded calls of any alias or binding module replay through these)."""
    from kdump.kernels.registry import plugins

    table: dict[str, list[tuple[str, str]]] = {}
    for p in plugins():
        for specs in p.presets().values():
            for ts in specs:
                if ts.kind != "call":
                    continue
                where = table.setdefault(ts.id, [])
                if (ts.module, ts.qualname) not in where:
                    where.append((ts.module, ts.qualname))
        # Calls recorded under an alias name (m_grouped_fp8_fp4_... for m_grouped_fp8_...) are
        # the same entry point.
        for spec in p.specs():
            for alias in spec.aliases:
                if spec.id in table:
                    table.setdefault(f"{p.name}:{alias}", table[spec.id])
    return {k: tuple(v) for k, v in sorted(table.items())}


def _literal_table(table: Mapping[str, Sequence[tuple[str, str]]]) -> str:
    lines = ["{"]
    for target, places in table.items():
        lines.append(f"    {target!a}: (")
        lines.extend(f"        ({m!a}, {f!a})," for m, f in places)
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def render_script(bundle_path: str, allowed: Sequence[str] = ()) -> str:
    """The script's source: the template with the user's bundle path and allow list filled in."""
    text = resources.files("kdump.report").joinpath(TEMPLATE).read_text(encoding="utf-8")
    codes = (ExitCode.CLEAN, ExitCode.MISMATCH, ExitCode.USAGE, ExitCode.KERNEL_ERROR)
    values = (
        ascii(str(bundle_path)),
        "(" + "".join(f"{str(a)!a}, " for a in allowed) + ")",
        _literal_table(known_targets()),
        ", ".join(str(int(c)) for c in codes),
        # kdump's own generator module (never bundle data): the bytes of synthetic storages
        ascii(resources.files("kdump.format").joinpath("synthetic.py").read_text(encoding="utf-8")),
    )
    for slot, value in zip(_SLOTS, values):
        if text.count(slot) != 1:
            raise RuntimeError(f"the repro template must hold {slot} exactly once")
        text = text.replace(slot, value)
    return text


def check_targets(targets: Sequence[str], allowed: Sequence[str]) -> None:
    """Refuse (UntrustedTargetError) a target the script would refuse to run: neither a plug-in
    entry point nor allowed by the user."""
    from kdump.text import visible

    known = known_targets()
    for target in targets:
        if target in known or any(fnmatchcase(target, p) for p in allowed):
            continue
        shown = visible(target, 200)
        raise UntrustedTargetError(
            f"the bundle asks to run {shown}, which is no kernel plug-in's entry point; if you "
            f"trust the bundle, pass --allow-target '{shown}' (it is written into the script)"
        )


def write_script(
    dst: str | os.PathLike[str], bundle_path: str, targets: Sequence[str], allowed: Sequence[str]
) -> Path:
    """Write the repro script for a bundle whose calls run `targets` (checked first)."""
    from kdump.bundle.store import atomic_write

    check_targets(targets, allowed)
    out = Path(dst)
    atomic_write(out, render_script(bundle_path, allowed).encode("utf-8"))
    out.chmod(0o755)
    return out
