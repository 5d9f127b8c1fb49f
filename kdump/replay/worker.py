"""The child process that runs one replay request: `python -m kdump.replay.worker REQ RESULT
PROGRESS`. A crash here becomes a verdict in the parent, which reads the progress file to know the
step that was running."""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import asdict, is_dataclass
from pathlib import Path

from kdump.replay.verdict import Finding, Verdict


def _apply_recorded_env(bundle_path: str) -> None:
    """Set the recorded DG_* variables before any kernel library is imported."""
    try:
        from kdump.bundle import load_bundle

        env = load_bundle(bundle_path).env.get("env_vars", {})
    except Exception:
        return  # the replay itself reports an unreadable bundle
    for name, value in env.items():
        if name.startswith("DG_") and name not in os.environ and value != "<redacted>":
            os.environ[name] = value


def run_request(req_dict: dict, progress_path: str | None) -> Verdict:
    from kdump.errors import KdumpError
    from kdump.replay.session import Request

    req = Request(**req_dict)
    progress_file = open(progress_path, "a", buffering=1) if progress_path else None  # noqa: SIM115

    def progress(kind: str, payload: object) -> None:
        if progress_file:
            value = asdict(payload) if is_dataclass(payload) else payload
            progress_file.write(json.dumps({kind: value}, default=str) + "\n")
            progress_file.flush()

    try:
        _apply_recorded_env(req.bundle)
        if req.mode == "eager":
            from kdump.replay.eager import run_eager

            return run_eager(req, progress)
        if req.mode == "graph":
            from kdump.replay.graph import run_graph

            return run_graph(req, progress)
        raise KdumpError(f"unknown replay mode {req.mode!r}")
    except KdumpError as exc:
        kind = {2: "usage", 125: "cannot_run", 5: "contract"}.get(int(exc.exit_code), "internal")
        v = Verdict(req.bundle, req.call, "", req.mode)
        v.findings.append(Finding(kind, f"{req.mode}/setup", str(exc)))
        return v
    except Exception as exc:
        v = Verdict(req.bundle, req.call, "", req.mode)
        v.findings.append(
            Finding(
                "internal",
                f"{req.mode}/setup",
                f"{type(exc).__name__}: {exc}",
                {"traceback": traceback.format_exc()[-4000:]},
            )
        )
        return v


def main(argv: list[str]) -> int:
    req_path, result_path, progress_path = argv
    req = json.loads(Path(req_path).read_text())
    verdict = run_request(req, progress_path)
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(verdict.to_json(), f, default=str)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    # Skip interpreter teardown: after a sticky CUDA error torch aborts at exit, which would hide
    # nothing (the verdict is written) but pollutes stderr.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
