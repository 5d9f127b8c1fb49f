"""The device copy plan of a recorded CUDA call: which rows of its tensors the device tier
gathers into its ring (kdump.record.flight.gather), from the spec's touch declaration, cached per
call signature; what the slot's `extra` says of it (the tiers, the device facts, the plan).

A call whose rows exceed the device ring, or whose gathered storages hold tensors the plan does
not gather, gets no plan: its storages take the slot's own copies (or keep their layouts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kdump.log import log_once

if TYPE_CHECKING:
    from kdump.record.flight.devcopy import DeviceCopies
    from kdump.record.flight.layout import Layout
    from kdump.record.hooks import HookState

PLANS_MAX = 256  # signatures whose plan is kept (the cache is cleared beyond)


def device_plan(
    cuda: DeviceCopies,
    plans: dict[Any, Any],
    st: HookState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    key: Any,
    tensors: list[Any],
    layout: Layout,
    want: list[bool],
    extra: dict[str, Any],
) -> tuple[Any, Any, Any]:
    """(plan, rule tensor, whole layout) of a CUDA call on the device tier's device, each None
    where there is none. The storages whose rows go to the device ring leave `want`; `extra`
    gets the tiers and the device facts (with the plan, or the whole layout copied without a row
    rule where the snapshot kernel is not there)."""
    plan, rule = cached_plan(cuda, plans, st, args, kwargs, key, tensors)
    if plan is not None:
        plan, rule = fit_plan(cuda, plan, rule, layout.records, layout.storages)
    whole = None
    if plan is not None and cuda.kernel is None:
        whole = cuda.whole_layout(plan, layout.storages)
        if whole is None:
            plan = rule = None
    if plan is not None:
        for i in plan.storages:
            want[i] = False  # their touched rows go to the device ring
    extra["tiers"] = cuda.tiers(plan is not None)
    device = extra["device"] = cuda.facts()
    if whole is not None:
        device["whole"] = whole  # copied whole: no row rule applied
    if plan is not None:
        device["plan"] = layout.plan_json(plan)
        # the device ring's depth for this call: worst case, every row touched
        device["ring_slots_worst_case"] = device["ring_bytes"] // plan.worst
    return plan, rule, whole


def cached_plan(
    cuda: DeviceCopies,
    plans: dict[Any, Any],
    st: HookState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    key: Any,
    tensors: list[Any],
) -> tuple[Any, Any]:
    """The row-gather plan of this call and its rule tensor (None, None: nothing gathered),
    cached in `plans` per call signature (kdump.record.flight.layout.signature)."""
    if not cuda.gathers:
        return None, None
    if key in plans:
        plan = plans[key]
    else:
        plan = None
        try:
            plan = plan_for(st, args, kwargs, tensors)[0]
        except Exception as exc:  # a spec that cannot bind: no gather, the call still records
            log_once(f"ringplan:{st.id}", f"flight recorder: no row gather for {st.id}: {exc}")
        if len(plans) > PLANS_MAX:
            plans.clear()
        plans[key] = plan
    if plan is None:
        return None, None
    # the rule's values are this call's tensor (the cache keeps no tensor alive)
    return plan, tensors[plan.rule_tensor] if plan.rule_tensor is not None else None


def fit_plan(
    cuda: DeviceCopies, plan: Any, rule: Any, records: list[Any], storages: list[Any]
) -> tuple[Any, Any]:
    """The plan if the device ring holds its worst case and each gathered storage holds only
    gathered tensors; else (None, None)."""
    assert cuda.tier is not None
    if plan.worst > cuda.tier.layout.ring_bytes:
        log_once(
            "ringfit",
            f"flight recorder: a call's rows ({plan.worst} bytes) exceed the device ring "
            f"({cuda.tier.layout.ring_bytes} bytes): raise KDUMP_DEVICE_BYTES",
        )
        return None, None
    gathered = {g.tensor for g in plan.gathers}
    for i, r in enumerate(records):  # a gathered storage holds only gathered tensors
        if r.storage in plan.storages and i not in gathered:
            return None, None
    return plan, rule


def plan_for(
    st: HookState, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[Any]
) -> tuple[Any, Any]:
    """The spec's touch declaration turned into a gather plan (kdump.record.flight.gather)."""
    from kdump.bundle.tensors import group_storages
    from kdump.format import argtree
    from kdump.kernels import registry
    from kdump.record.flight import gather

    spec = registry.spec_for(st.id, st.names())
    bound = spec.bind(args, kwargs)
    touches = spec.touches(bound)
    if not touches:
        return None, None
    t = touches[0]  # one row rule per snapshot
    by_id = {id(x): i for i, x in enumerate(tensors)}
    idx = [by_id[id(x)] for x in argtree.tensors_in(bound.get(t.param)) if id(x) in by_id]
    rule_t = bound.get(t.by) if t.by else None
    if not idx or (t.rule != "all" and id(rule_t) not in by_id):
        return None, None
    if t.rule != "all":
        import torch

        if not isinstance(rule_t, torch.Tensor) or rule_t.dtype != torch.int32:
            return None, None
        if not rule_t.is_contiguous() or rule_t.device != tensors[idx[0]].device:
            return None, None
    storages, records = group_storages(tensors)
    plan = gather.make_plan(
        tensors,
        records,
        storages,
        idx,
        t.rule,
        by_id.get(id(rule_t)) if rule_t is not None else None,
        t.row_dims,
        t.alignment,
    )
    return (plan, rule_t) if plan is not None else (None, None)
