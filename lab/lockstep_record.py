"""Two kdump trees recording small sync calls in lockstep, for before/after numbers on a loaded
machine: one live process per tree, alternating rounds of `--calls` recorded calls (the order
flips every round), so both see the same load minute by minute.

    python lab/lockstep_record.py OLD_TREE NEW_TREE                # recorder's own work
    python lab/lockstep_record.py OLD_TREE NEW_TREE --write        # with the bundle files

Without --write the bundle files are built but not written (kdump.bundle.writer's atomic_write
replaced, and os.stat answered for them, for trees whose index asks the file system for the
size): the recorder's own CPU time per call. Prints the median CPU µs per call of each tree over
all rounds, and in how many rounds the new tree was faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path


def worker(write: bool) -> None:
    """Record on each stdin line 'N' N small calls; print their CPU times (ns) as one line."""
    import shutil
    import tempfile
    import time
    import types

    import torch

    import kdump
    from kdump.bundle import writer

    if not write:
        sizes: dict[str, int] = {}
        real_stat = os.stat

        def built(path: object, content: object) -> object:
            sizes[os.fspath(path)] = len(bytes(content))  # type: ignore[arg-type, call-overload]
            return path

        class Stat:
            def __init__(self, n: int) -> None:
                self.st_size = n

        def stat(p: object, *a: object, **k: object) -> object:
            n = sizes.get(os.fspath(p)) if isinstance(p, (str, os.PathLike)) else None
            return Stat(n) if n is not None else real_stat(p, *a, **k)  # type: ignore[arg-type]

        writer.atomic_write = built  # type: ignore[assignment]
        os.stat = stat  # type: ignore[assignment]
    mod = types.ModuleType("kdump_lockstep_target")

    def scale(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x * 2)

    scale.__module__ = mod.__name__
    mod.scale = scale  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    x, out = torch.randn(256), torch.empty(256)
    work = Path(tempfile.mkdtemp(prefix="kdump-lockstep-"))
    try:
        with kdump.recording(f"{mod.__name__}:scale", out=work):
            for _ in range(200):  # warm: templates made, folder created
                mod.scale(x, out)
            print("ready", flush=True)
            for line in sys.stdin:
                times = []
                for _ in range(int(line)):
                    c0 = time.thread_time_ns()
                    mod.scale(x, out)
                    times.append(time.thread_time_ns() - c0)
                print(" ".join(map(str, times)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="root of the tree measured first (before)")
    ap.add_argument("new", help="root of the tree measured against it (after)")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per tree (default 30)")
    ap.add_argument("--calls", type=int, default=200, help="recorded calls a round (default 200)")
    ap.add_argument("--write", action="store_true", help="write the bundle files too")
    args = ap.parse_args(argv)
    procs = {}
    for name, root in (("old", args.old), ("new", args.new)):
        env = {**os.environ, "PYTHONPATH": str(Path(root).resolve())}
        cmd = [sys.executable, __file__, "--worker", "write" if args.write else "own"]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        procs[name] = p
    times: dict[str, list[int]] = {k: [] for k in procs}
    rounds: dict[str, list[float]] = {k: [] for k in procs}
    for r in range(args.rounds):
        for name in list(procs) if r % 2 == 0 else list(procs)[::-1]:
            p = procs[name]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(f"{args.calls}\n")
            p.stdin.flush()
            got = [int(t) for t in p.stdout.readline().split()]
            times[name] += got
            rounds[name].append(statistics.median(got))
    for p in procs.values():
        assert p.stdin is not None
        p.stdin.close()
        p.wait()
    old, new = (statistics.median(times[k]) / 1e3 for k in ("old", "new"))
    wins = sum(n < o for o, n in zip(rounds["old"], rounds["new"]))
    what = "recorded call, bundle written" if args.write else "recorder's own work"
    print(
        f"{what}: old {old:.0f} µs, new {new:.0f} µs CPU per call (new/old {new / old:.3f}; "
        f"new faster in {wins} of {args.rounds} rounds of {args.calls} calls)"
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2] == "write")
    else:
        sys.exit(main())
