"""What every replay mode shares inside the child process: loading the call, choosing spec,
backend and device, checking the contract, re-applying library settings, and comparing outputs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kdump.bundle import Bundle, Call, MaterializedCall, load_bundle
from kdump.bundle.materialize import Placement
from kdump.errors import CannotRunError, KdumpError, UsageError, error_line
from kdump.format.records import HELD_SOURCES
from kdump.kernels import registry
from kdump.kernels.generic import GenericSpec
from kdump.kernels.plugin import Backend, KernelSpec, Tolerance
from kdump.kernels.registry import choose_backend
from kdump.kernels.triton import replay as triton_replay
from kdump.replay import halo, triton_setup
from kdump.replay.compare import (
    Agreement,
    Comparison,
    _expand_mask,
    agree,
    compare_to_reference,
    interpreter_tolerance,
    poison,
    unwritten,
)
from kdump.replay.discover import Discovery, ProbeFailed, discover, elements_unchanged, tensor_view
from kdump.replay.options import ReplayOptions
from kdump.replay.verdict import Finding, Step, Verdict

# Reports events to the parent as they happen: ("begin", step name), ("step", Step),
# ("finding", Finding), ("note", str), ("meta", dict). A crash loses nothing already reported.
Progress = Callable[[str, Any], None]


@dataclass(frozen=True)
class Request:
    """One replay of one call (what the parent sends to a child process)."""

    bundle: str
    call: int
    options: ReplayOptions = field(default_factory=ReplayOptions)

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def backend(self) -> str:
        return self.options.backend

    @property
    def device(self) -> str:
        return self.options.device

    @property
    def repeat(self) -> int:
        return self.options.repeat

    @property
    def force(self) -> bool:
        return self.options.force

    def to_dict(self) -> dict[str, Any]:
        return {"bundle": self.bundle, "call": self.call, "options": self.options.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Request:
        unknown = sorted(set(d) - {"bundle", "call", "options"})
        if unknown:
            raise UsageError(f"unknown replay request key(s) {', '.join(unknown)}")
        return cls(str(d["bundle"]), int(d["call"]), ReplayOptions.from_dict(d["options"]))


def resolve_device(name: str, call: Call, generic: bool) -> torch.device:
    """`auto`: a GPU when there is one, except for a target without a spec recorded on the CPU
    (a user's own function gets the tensors it was called with, on the device it saw). A Triton
    kernel is a GPU kernel wherever it was recorded (on the CPU it ran in the interpreter): a GPU
    when there is one, else the CPU, where it runs in Triton's interpreter."""
    if name == "auto" and triton_replay.is_triton_launch(call.launch):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "auto":
        ran_on = call.meta.get("device")  # set where the stored tensors are copies
        recorded_on_gpu = (isinstance(ran_on, str) and ran_on.startswith("cuda")) or any(
            st.device.startswith("cuda") for st in call.storages
        )
        use_gpu = torch.cuda.is_available() and (recorded_on_gpu or not generic)
        return torch.device("cuda" if use_gpu else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use auto, cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        if triton_replay.is_triton_launch(call.launch):
            raise CannotRunError(
                "no CUDA GPU is available here; replay with --device cpu (the Triton kernel runs "
                "in Triton's interpreter)"
            )
        raise CannotRunError(
            "no CUDA GPU is available here; replay with --device cpu --backend reference"
        )
    return dev


def runs_interpreted(call: Call, device: str) -> bool:
    """Whether replaying `call` with --device `device` runs a Triton kernel in Triton's
    interpreter (its process then imports the kernel's module with TRITON_INTERPRET=1 set, and
    cannot also run a compiled one: a worker process is reused only between replays that agree
    on this)."""
    if not triton_replay.is_triton_launch(call.launch):
        return False
    try:
        return resolve_device(device, call, True).type == "cpu"
    except KdumpError:
        return False


def refuse_by_spec(spec: KernelSpec, call: Call) -> None:
    """The spec's own one-line reason a call cannot be replayed (a callable epilogue, another
    rank's memory), asked of the recorded argument trees before anything is materialised."""
    try:
        bound = spec.bind(call.encoded_args, call.encoded_kwargs)
    except KdumpError:
        return  # the contract check names what is wrong with the arguments
    why = spec.refusal(bound)
    if why:
        raise CannotRunError(why)


def refuse_pointers(call: Call) -> None:
    """A call given raw device addresses cannot run: the memory behind them is not recorded."""
    from kdump.format.argtree import pointer_paths

    found = pointer_paths(call.names, call.encoded_args, call.encoded_kwargs)
    if found:
        path, address = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise CannotRunError(
            f"{call.target}: argument {path} is a raw device address ({address:#x}){more} into "
            "memory the bundle does not hold (another rank's symmetric memory, or a pointer "
            "passed as an integer); kdump cannot replay this call"
        )


def spec_for(call: Call) -> KernelSpec:
    if triton_replay.is_triton_launch(call.launch):  # a user's kernel: launched as recorded
        return GenericSpec(call.target, call.names, launch=call.launch)
    return registry.spec_for(call.target, call.names)


class Session:
    """A call being replayed in this process."""

    def __init__(self, req: Request, progress: Progress) -> None:
        self.req = req
        self.progress = progress
        self.bundle: Bundle = load_bundle(req.bundle)
        self.call: Call = self.bundle.call(req.call)
        spec = spec_for(self.call)
        # The recorded library settings (e.g. DeepGEMM's mk alignment) shape the contract.
        self.plugin = registry.plugin_for(self.call.target)
        self.library_state = (
            registry.recorded_state(self.plugin, self.bundle.env, self.call.meta)
            if self.plugin is not None
            else None
        )
        if self.plugin is not None:
            spec = spec.with_settings(self.plugin.settings(self.library_state))
        self.spec = spec
        refuse_by_spec(spec, self.call)
        refuse_pointers(self.call)
        self.device = resolve_device(req.device, self.call, isinstance(spec, GenericSpec))
        self.verdict = Verdict(
            bundle=req.bundle,
            call=self.call.index,
            target=self.call.target,
            mode=req.mode,
            device=str(self.device),
        )
        # A Triton kernel: the installed one, compiled on a GPU, interpreted on the CPU
        self.kernel: Any = triton_setup.prepare_kernel(
            self.call, self.device, req.options.allow_targets, self.note
        )
        self.backend: Backend = choose_backend(req.backend, self.spec, self.device)
        # (storage, side) of the halo reads already reported (kdump.replay.overreads)
        self.overreads_named: set[tuple[int, str]] = set()
        # Outputs found by running (targets whose spec names none), and the spans from before
        # the run being judged (what "left unwritten, as in production" is judged by)
        self.discovery: Discovery | None = None
        self.pristine: list[torch.Tensor] = []
        self.mc: MaterializedCall | None = None
        self.verdict.backend = self.backend.name
        progress(
            "meta",
            {"target": self.call.target, "backend": self.backend.name, "device": str(self.device)},
        )

    # --- steps ---------------------------------------------------------------------------------
    def step(
        self, name: str, status: str = "ok", message: str = "", seconds: float = 0.0, **metrics: Any
    ) -> Step:
        s = Step(name, status, message, seconds, metrics)
        self.verdict.steps.append(s)
        self.progress("step", s)
        return s

    def finding(
        self, kind: str, step: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        f = Finding(kind, step, message, dict(details or {}))
        self.verdict.findings.append(f)
        self.progress("finding", f)

    def note(self, text: str) -> None:
        self.verdict.notes.append(text)
        self.progress("note", text)

    def placement(self) -> Placement:
        """Halos around every storage (eager/graph), or flush ends (sanitizer)."""
        if self.req.options.placement == "flush_end":
            return Placement(flush_end=True, halo=0)
        return Placement(halo=self.req.options.halo)

    def materialize(self) -> MaterializedCall:
        self.progress("begin", f"{self.req.mode}/materialize")
        mc = self.call.materialize(self.device, self.placement())
        self.mc = mc
        if changed := mc.materialized.offset_changes:
            self.note(
                "storage offsets not kept (the bytes before the recorded spans exceed the load "
                "budget): " + "; ".join(c.describe(mc.tensor_names[c.tensor]) for c in changed)
            )
        allocs = mc.materialized.allocations
        if self.placement().halo:
            halo.fill(allocs, self.call.tensors)
        self.guards = halo.snapshot(allocs)
        by_storage = {a.storage: a.buffer for a in allocs}
        placed = []
        for i, t in enumerate(mc.tensors):
            buf = by_storage.get(self.call.tensors[i].storage)
            placed.append(
                {
                    "name": mc.tensor_names[i],
                    "data_ptr": t.data_ptr(),
                    "itemsize": t.element_size(),
                    "shape": list(t.shape),
                    "stride": list(t.stride()),
                    # the whole allocation, for sanitizer addresses outside the view
                    "alloc_ptr": buf.data_ptr() if buf is not None else None,
                    "alloc_nbytes": buf.numel() if buf is not None else None,
                }
            )
        self.progress("placed", placed)
        return mc

    def check_halos(self, mc: MaterializedCall, step: str) -> None:
        """Report guard bytes that changed (out-of-bounds writes), then re-arm the guards."""
        allocs = mc.materialized.allocations
        if not self.placement().halo:
            return
        for v in halo.check(allocs, self.guards, self.call.tensors, mc.tensor_names):
            self.step(f"{step} guards", "fail", v.describe())
            self.finding(
                "memory",
                step,
                v.describe(),
                {"storage": v.storage, "side": v.side, "offset": v.offset, "changed": v.changed},
            )
        halo.fill(allocs, self.call.tensors)

    def wants_reference(self) -> bool:
        return (
            self.spec.has_reference()
            and self.backend.name != "reference"
            and self.req.options.reference
        )

    def snapshot(self, mc: MaterializedCall) -> list[torch.Tensor]:
        """Copies of every materialised span, to restore inputs between runs (same pointers)."""
        return [a.span.clone() for a in mc.materialized.allocations]

    @staticmethod
    def restore(mc: MaterializedCall, saved: list[torch.Tensor]) -> None:
        for alloc, data in zip(mc.materialized.allocations, saved):
            alloc.span.copy_(data)

    def check_contract(self, bound: dict[str, Any]) -> bool:
        """Contract check before anything launches. False when the replay must stop."""
        violations = self.spec.validate(bound)
        if not violations:
            self.step("contract", "ok", "the call satisfies the kernel's contract")
            return True
        msg = "; ".join(str(v) for v in violations[:5])
        self.step("contract", "fail", msg)
        self.finding(
            "contract",
            "contract",
            f"the recorded call violates the contract: {msg}",
            {"violations": [str(v) for v in violations]},
        )
        if not self.req.force:
            self.note("nothing was launched (use --force to run it anyway)")
            return False
        return True

    def apply_library_settings(self) -> None:
        env = self.bundle.env
        here = torch.cuda.get_device_properties(self.device) if self.device.type == "cuda" else None
        rec_sms = env.get("sm_count")
        if here is not None and rec_sms and rec_sms != here.multi_processor_count:
            self.note(f"SM count differs: recorded {rec_sms}, here {here.multi_processor_count}")
        rec_cc = env.get("compute_capability")
        if here is not None and rec_cc and rec_cc != f"{here.major}.{here.minor}":
            self.note(
                f"GPU architecture differs: recorded cc {rec_cc} ({env.get('gpu_name')}), "
                f"here cc {here.major}.{here.minor} ({here.name})"
            )
        if self.plugin is not None:
            for text in self.plugin.apply_state(self.library_state, self.device):
                self.note(text)

    def finds_outputs(self, bound: dict[str, Any]) -> bool:
        """True when the spec names no outputs: the replay finds them by running."""
        return isinstance(self.spec, GenericSpec) or not self.spec.output_names(bound)

    def find_outputs(
        self,
        mc: MaterializedCall,
        bound: dict[str, Any],
        fn: Callable[..., Any],
        pristine: list[torch.Tensor],
        prefix: str,
    ) -> dict[str, int] | None:
        """Output name -> tensor index: the spec's outputs, or for a call whose spec names none,
        the tensors a few runs find it writes (kdump.replay.discover) together with those the
        bundle recorded. None when the call failed on its recorded values (the finding says
        how)."""
        if not self.finds_outputs(bound):
            return self.output_indices(mc, bound)
        step = f"{prefix}/discover outputs"
        self.pristine = pristine

        def run(label: str) -> None:
            self.progress("begin", f"{step} {label}")
            self.returned = None
            self.returned = fn(*mc.args, **mc.kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        t0 = time.perf_counter()
        recorded = [inp for inp, _ in self.call.inplace]
        try:
            found = discover(
                mc,
                [rec.storage for rec in self.call.tensors],
                pristine,
                lambda: self.restore(mc, pristine),
                _first_fails(run, self, mc, step),
                recorded,
            )
        except ProbeFailed:
            return None
        finally:
            if self.placement().halo:  # probes may have written guards: the runs check them
                halo.fill(mc.materialized.allocations, self.call.tensors)
        self.discovery = found
        self.step(step, "ok", found.describe(), time.perf_counter() - t0, runs=found.runs)
        self.note(found.describe())
        self.progress("meta", {"outputs": found.to_json()})
        self.verdict.outputs = found.to_json()
        return dict(found.outputs)

    def output_indices(self, mc: MaterializedCall, bound: dict[str, Any]) -> dict[str, int]:
        """Output name -> index in the call's tensor table (the spec's, or the recorded ones)."""
        out: dict[str, int] = {}
        if self.finds_outputs(bound):
            for inp, _ in self.call.inplace:
                out[mc.tensor_names[inp]] = inp
            return out
        for name in self.spec.output_names(bound):
            t = bound.get(name)
            for i, cand in enumerate(mc.tensors):
                if cand is t:
                    out[name] = i
        return out

    def aliases_input(self, mc: MaterializedCall, idx: int) -> bool:
        """True when output tensor idx shares its storage with another argument tensor."""
        storage = self.call.tensors[idx].storage
        return any(rec.storage == storage for j, rec in enumerate(self.call.tensors) if j != idx)

    def same_setup_as_recording(self) -> bool:
        """Bitwise equality with the recorded output is only expected on the same backend,
        library version and GPU architecture."""
        meta = self.call.meta
        env = self.bundle.env
        rec_backend = meta.get("backend") or (
            (self.plugin.library_backend if self.plugin else None) or "library"
        )
        if rec_backend != self.backend.name:
            return False
        if self.plugin is not None and not self.plugin.same_build(self.library_state, self.backend):
            return False
        if self.kernel is not None and not triton_setup.same_setup(
            self.call, self.kernel, self.device
        ):
            return False
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(self.device)
            return env.get("compute_capability") == f"{p.major}.{p.minor}"
        return not env.get("cuda_available") or meta.get("device", "cpu") == "cpu"

    def run_kernel(self, fn: Callable[..., Any], mc: MaterializedCall, step: str) -> float | None:
        """Call once and synchronise; a raised error becomes a kernel_error finding."""
        self.progress("begin", step)
        t0 = time.perf_counter()
        self.returned = None
        try:
            self.returned = fn(*mc.args, **mc.kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            self.failed(step, exc, time.perf_counter() - t0)
            return None
        dt = time.perf_counter() - t0
        return dt

    def failed(self, step: str, exc: Exception, seconds: float = 0.0, why: str = "") -> None:
        """A run that raised: its step and finding. A backend's typed error (cannot run here,
        contract, kdump bug) keeps its kind (and with it its exit code); anything else is the
        kernel's error."""
        text = error_line(exc)
        self.step(step, "error", text, seconds)
        if isinstance(exc, KdumpError):
            kind = exc.finding_kind.value
            self.finding(kind, step, text.split(": ", 1)[1] or text, {"error": text})
        else:
            self.finding("kernel_error", step, _describe_error(text) + why, {"error": text})

    def tolerance_for(self, bound: dict[str, Any], rec: torch.Tensor) -> Tolerance | None:
        """Tolerance against the recorded output `rec` on another setup: the spec's, or for a
        target without one the dtype default (None); a Triton kernel run in the interpreter
        against a compiled recording (or the other way round) gets the interpreter's
        (TF32 dots)."""
        if triton_setup.other_engine(self.call, self.kernel, self.device):
            return interpreter_tolerance(rec)
        if isinstance(self.spec, GenericSpec):
            return None
        return self.spec.tolerance(bound)

    def compare_runs(
        self,
        step: str,
        bound: dict[str, Any],
        actual: dict[str, torch.Tensor],
        baseline: dict[str, torch.Tensor],
        label: str,
        explained: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, Agreement]:
        """Every output against `baseline` (another run of the same inputs) under the tolerance
        policy; returns the agreements (the caller decides what a disagreement means). Outputs
        that disagree only at `explained` elements (read from a halo) agree, said in the step."""
        out: dict[str, Agreement] = {}
        for name, got in actual.items():
            mask = self.spec.meaningful(bound, name)
            ag = agree(got, baseline[name], mask, bitwise=self.req.options.bitwise)
            text = f"{name}: {ag.message}"
            if not ag.ok and (rest := _outside(explained, name, mask, got)) is not None:
                ok = agree(got, baseline[name], rest, bitwise=self.req.options.bitwise)
                if ok.ok:
                    text = f"{name} differs {SYMPTOM}: {ag.message}"
                    ag = Agreement(True, False, ag.metrics, ag.message)
            out[name] = ag
            self.step(
                f"{step} vs {label}",
                "ok" if ag.ok else "fail",
                text,
                **_plain(ag.metrics),
            )
            if ag.note:
                self.note(f"{name}: {ag.note}")
        return out

    def compare_outputs(
        self,
        step: str,
        bound: dict[str, Any],
        outputs: dict[str, int],
        actual: dict[str, torch.Tensor],
        expected: dict[str, torch.Tensor] | None,
        recorded: dict[int, torch.Tensor],
        explained: dict[str, torch.Tensor] | None = None,
        symptoms: list[str] | None = None,
    ) -> dict[str, bool]:
        """Outputs against the reference (spec tolerance) and the recorded output (the tolerance
        policy on the recording's setup, the spec's tolerance on another). Returns, per output
        compared with its recording, whether it reproduces production. A failure only at
        `explained` elements (read from a halo) is no finding: it goes to `symptoms`."""
        tol = self.spec.tolerance(bound)
        same_setup = self.same_setup_as_recording()
        reproduced: dict[str, bool] = {}
        for name, idx in outputs.items():
            mask = self.spec.meaningful(bound, name)
            got = actual[name]
            if expected is not None and name in expected and self.backend.name != "reference":
                cmp = compare_to_reference(got, expected[name], mask, tol)
                symptom = not cmp.ok and _only_at(
                    explained,
                    name,
                    mask,
                    got,
                    lambda m, g=got, e=expected[name]: compare_to_reference(g, e, m, tol),
                )
                self.step(
                    f"{step} vs reference",
                    "ok" if cmp.ok else "fail",
                    f"{name} differs {SYMPTOM}: {cmp.message}"
                    if symptom
                    else f"{name}: {cmp.message}",
                    **cmp.metrics,
                )
                if symptom and symptoms is not None:
                    symptoms.append(f"{name} differs from the reference only there")
                elif not cmp.ok:
                    self.finding(
                        "mismatch",
                        step,
                        f"{name} differs from the reference: {cmp.message}",
                        {"output": name, "oracle": "reference", **cmp.metrics},
                    )
            if idx not in recorded:
                continue
            rec = recorded[idx]

            got, left = self._unwritten_as_recorded(name, idx, got, rec)
            if left:
                self.note(f"{name}: {left}")

            def against(
                m: torch.Tensor | None, got: torch.Tensor = got, rec: torch.Tensor = rec
            ) -> Agreement:
                if same_setup:
                    return agree(got, rec, m, bitwise=self.req.options.bitwise)
                return agree(got, rec, m, tol=self.tolerance_for(bound, rec))

            ag = against(mask)
            reproduced[name] = ag.ok
            symptom = not ag.ok and _only_at(explained, name, mask, got, against)
            setup = "" if same_setup else " (setup differs from the recording)"
            verb = "reproduces production" if ag.ok else "differs from production"
            self.step(
                f"{step} vs recorded",
                "ok" if ag.ok else "fail",
                f"{name} {verb}{f' {SYMPTOM}' * symptom}: {ag.message}{setup}",
                bitwise=ag.exact,
                **_plain(ag.metrics),
            )
            if ag.note:
                self.note(f"{name}: {ag.note}")
            if symptom and symptoms is not None:
                symptoms.append(f"{name} differs from the recorded output (production) only there")
            elif not ag.ok:
                self.finding(
                    "mismatch",
                    step,
                    f"{name} differs from the recorded output (production): {ag.message}",
                    {"output": name, "oracle": "recorded", **_plain(ag.metrics)},
                )
        return reproduced

    def _unwritten_as_recorded(
        self, name: str, idx: int, got: torch.Tensor, rec: torch.Tensor
    ) -> tuple[torch.Tensor, str]:
        """A found write-only output's elements the replay left unwritten (poison kept): where
        the recorded call did not change them either (its bytes before and after the call are
        equal) they count as the recording's ("left unwritten, as in production"); where it
        changed them they stay poison, so the comparison fails there. Returns the output to
        compare and what to say."""
        found = self.discovery
        if found is None or name not in found.write_only or not self.pristine:
            return got, ""
        left = unwritten(got)
        count = int(left.sum())
        if not count:
            return got, ""
        rec_storage = self.call.storages[self.call.tensors[idx].storage]
        if rec_storage.source not in HELD_SOURCES:
            keep = left
            said = (
                f"{count} elements left unwritten; their bytes from before the call were not "
                "recorded, so they are not compared"
            )
        else:
            mc = self.mc
            assert mc is not None
            allocs = [
                (j, a)
                for j, a in enumerate(mc.materialized.allocations)
                if a.storage == self.call.tensors[idx].storage
            ]
            if not allocs:
                return got, ""
            j, a = allocs[0]
            before = tensor_view(mc.tensors[idx], a, self.pristine[j])
            keep = left & elements_unchanged(before, rec.to(before.device)).to(left.device)
            kept = int(keep.sum())
            if not kept:
                return got, ""
            said = f"{kept} elements left unwritten, as in production"
            if kept < count:
                said += f"; {count - kept} more left unwritten where the recorded call wrote them"
        return torch.where(keep, rec.to(got.device), got), said

    def note_recorded_exception(self, raised: bool) -> None:
        """Say whether a call that raised in production (meta `exception`) raised again."""
        recorded = self.call.meta.get("exception")
        if not recorded:
            return
        if raised:
            self.note(f"production raised too: {recorded}")
        else:
            self.note(
                f"production raised {recorded}; this replay ran without raising (the failure "
                "does not reproduce here)"
            )

    def compare_returned(self, step: str) -> None:
        """The run's return value against the recorded one: the same structure, the same plain
        values (NaN equal to NaN) and, tensor by tensor, the tolerance policy of outputs."""
        if not self.call.has_returned or self.kernel is not None:
            return  # a launch returns a handle (the compiled kernel), not a result
        recorded = self.call.materialize_returned(self.device)
        problems: list[str] = []
        exact = _same_tree(self.returned, recorded, "return value", problems, self.req.options)
        if not problems:
            how = "bit-identical" if exact else "equal within tolerance"
            self.step(f"{step} vs recorded", "ok", f"return value reproduces production: {how}")
            return
        msg = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" * (len(problems) > 3))
        self.step(f"{step} vs recorded", "fail", msg)
        self.finding(
            "mismatch",
            step,
            f"the return value differs from the recorded one (production): {msg}",
            {"output": "return value", "oracle": "recorded", "problems": problems},
        )


def _same_tree(got: Any, rec: Any, path: str, problems: list[str], options: Any) -> bool:
    """Compare a live return value with the decoded recorded one, appending what differs to
    `problems`; True when everything is bit-identical."""
    from kdump.format.argtree import Opaque, RecordedEnum

    if isinstance(rec, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            problems.append(f"{path}: got {type(got).__name__}, recorded a tensor")
            return False
        ag = agree(got.detach(), rec, bitwise=options.bitwise)
        if not ag.ok:
            problems.append(f"{path}: {ag.message}")
        return ag.exact
    if isinstance(rec, (list, tuple)):
        if type(got) is not type(rec) or len(got) != len(rec):
            problems.append(f"{path}: got {_short(got)}, recorded {_short(rec)}")
            return False
        return all([_same_tree(g, r, f"{path}[{i}]", problems, options)
                    for i, (g, r) in enumerate(zip(got, rec))])  # fmt: skip
    if isinstance(rec, dict):
        if not isinstance(got, dict) or list(got) != list(rec):
            problems.append(f"{path}: got {_short(got)}, recorded {_short(rec)}")
            return False
        return all([_same_tree(got[k], rec[k], f"{path}[{k!r}]", problems, options)
                    for k in rec])  # fmt: skip
    if isinstance(rec, RecordedEnum):
        same = getattr(got, "name", None) == rec.name
    elif isinstance(rec, Opaque):  # only its type is comparable (a repr may hold an address)
        same = f"{type(got).__module__}.{type(got).__qualname__}" == rec.cls
    elif isinstance(rec, float) and rec != rec:
        same = isinstance(got, float) and got != got
    else:
        same = type(got) is type(rec) and got == rec
    if not same:
        problems.append(f"{path}: got {_short(got)}, recorded {_short(rec)}")
    return same


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


SYMPTOM = "only where a halo was read (a symptom of the over-read)"


def _outside(
    explained: dict[str, torch.Tensor] | None,
    name: str,
    mask: torch.Tensor | None,
    like: torch.Tensor,
) -> torch.Tensor | None:
    """The meaningful elements of output `name` not read from a halo (None: none were)."""
    if not explained or name not in explained:
        return None
    return _expand_mask(mask, like) & ~explained[name].to(like.device)


def _only_at(
    explained: dict[str, torch.Tensor] | None,
    name: str,
    mask: torch.Tensor | None,
    like: torch.Tensor,
    check: Callable[[torch.Tensor], Agreement | Comparison],
) -> bool:
    """True when a failing comparison passes without the elements read from a halo."""
    rest = _outside(explained, name, mask, like)
    return rest is not None and check(rest).ok


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics without the keys that would clash with Step's own fields."""
    return {k: v for k, v in metrics.items() if k not in ("message", "name", "status")}


def _describe_error(text: str) -> str:
    low = text.lower()
    if "illegal memory access" in low or "illegal address" in low:
        return f"illegal memory access ({text})"
    if "misaligned" in low:
        return f"misaligned address ({text})"
    return text


def _first_fails(
    run: Callable[[str], None], s: Session, mc: MaterializedCall, step: str
) -> Callable[[str], None]:
    """The discovery's runner: a failure on the recorded values is the call's own (a finding,
    then ProbeFailed ends the replay); a failure with a probed argument only says the call
    reads it, unless it left the GPU unusable (then ProbeFailed with its finding too)."""

    def runner(label: str) -> None:
        try:
            run(label)
        except Exception as exc:
            if label == "(recorded values)":
                s.failed(f"{step} {label}", exc)
                s.note_recorded_exception(raised=True)
                raise ProbeFailed(error_line(exc)) from None
            if isinstance(exc, KdumpError) or (
                s.device.type == "cuda" and not _cuda_usable(s.device)
            ):
                why = (
                    " (while probing which arguments the call writes: the probed argument held NaN)"
                )
                s.failed(f"{step} {label}", exc, why=why)
                raise ProbeFailed(error_line(exc)) from None
            raise

    return runner


def _cuda_usable(device: torch.device) -> bool:
    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
        return True
    except Exception:
        return False


def poison_outputs(session: Session, mc: MaterializedCall, outputs: dict[str, int]) -> list[str]:
    """Poison every output that does not alias an input; return the names poisoned."""
    if isinstance(session.spec, GenericSpec) or session.discovery is not None:
        # Without argument roles only outputs found to be written and never read are poisoned
        # (a recorded output is also an input).
        found = session.discovery
        names = sorted(found.write_only & set(outputs)) if found is not None else []
        for name in names:
            poison(mc.tensors[outputs[name]])
        return names
    done = []
    for name, idx in outputs.items():
        if session.aliases_input(mc, idx):
            continue
        poison(mc.tensors[idx])
        done.append(name)
    return done
