"""The interpreter oracle's process: `python -m kdump.replay.interpret JOB.json`.

Started by kdump.replay.triton_oracle with TRITON_INTERPRET=1 and no GPU visible, so that the
kernel's module, imported here for the first time, gets interpreted kernels. The job names the
bundle, the call, the trust decision the replay made (allowed target patterns, --path folders),
the halo, the outputs to poison and those to keep, and where to write them. The kernel is the
installed one, resolved under the same trust rule (source is never taken from a bundle); the
kept outputs are written as a one-call kdump bundle (never a pickle). A failure is written as
one line to error.json beside the job.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from kdump.errors import error_line
from kdump.kernels.triton import replay as triton_replay
from kdump.replay import procs

ERROR = "error.json"  # kdump.replay.triton_oracle.ERROR


def run(job: dict[str, Any]) -> None:
    """Launch the call's kernel in the interpreter on its recorded inputs; write the outputs."""
    triton_replay.want_interpreter()  # before the kernel's module is imported
    from kdump.bundle import capture_call, load_bundle, save_calls
    from kdump.bundle.materialize import Placement
    from kdump.kernels import registry
    from kdump.replay import halo
    from kdump.replay.child import confine_imports
    from kdump.replay.compare import poison

    confine_imports(tuple(str(p) for p in job["paths"]))
    allowed = tuple(str(p) for p in job["allow_targets"])
    call = load_bundle(str(job["bundle"])).call(int(job["call"]))
    launch = call.launch
    if not triton_replay.is_triton_launch(launch):
        raise ValueError(f"call {call.index} of the bundle is no Triton launch")
    assert launch is not None
    registry.check_target(call.target, allowed)
    kernel = triton_replay.kernel_for(
        call.target, registry.resolve_allowed(call.target, allowed), "cpu"
    )
    size = int(job["halo"])
    mc = call.materialize("cpu", Placement(halo=size))
    if size:
        halo.fill(mc.materialized.allocations, call.tensors)
    for i in job["poison"]:
        poison(mc.tensors[int(i)])
    triton_replay.runner(kernel, launch)(*mc.args, **mc.kwargs)
    keep = [int(i) for i in job["outputs"]]
    names = [mc.tensor_names[i] for i in keep]
    record = capture_call(
        call.target,
        [mc.tensors[i] for i in keep],
        names=names,
        meta={"oracle": "interpreter", "tensor_indices": keep},
    )
    save_calls(str(job["out"]), [record])


def main(argv: list[str]) -> int:
    job_path, parent = argv  # the replay process that started this one: end with it
    procs.die_with_parent(int(parent))
    folder = Path(job_path).parent
    try:
        run(json.loads(Path(job_path).read_text()))
    except Exception as exc:  # the oracle's failure is a note of the replay, never a crash
        (folder / ERROR).write_text(json.dumps({"error": error_line(exc)}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
