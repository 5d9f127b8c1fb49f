"""kdump's startup hook. `kdump record` prepends this folder to PYTHONPATH, so every Python
process the recorded command starts (spawned workers included) imports it at interpreter start.

It is inert unless KDUMP_RECORD=1: it first runs the sitecustomize that this one shadows (the
next one on sys.path, if any), then activates recording. It never raises into the program.
"""

from __future__ import annotations


def _chain_and_activate() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    # Our folder has done its job; take it off sys.path so nothing else resolves from it.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
    except Exception as exc:  # the shadowed sitecustomize failed: say so, as Python would
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{exc!r}\n")
    try:
        from kdump import config

        if config.get_flag("KDUMP_RECORD"):
            from kdump.record.startup import activate

            activate()
    except Exception as exc:
        sys.stderr.write(f"kdump: recording not activated in this process: {exc!r}\n")


_chain_and_activate()
