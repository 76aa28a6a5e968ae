"""Every candidate of a plan evaluated: each schedule's orders built once and replayed under every offload
policy, for every recompute plan, schedules spread over worker processes.

Why a module of its own: this is where the planner spends its time (order construction and offload replays,
pure Python), and how that work is shared out (the process pool, the V schedules whose orders coincide, the
candidates skipped because a plainer one already fits) is independent of how the candidates are then
ranked and explained (`pp_offload.plan.ranking`).
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from typing import Any

from pp_offload.plan.evaluate import (
    Setup,
    build_orders,
    choose_adaptive_limit,
    predict,
    setup_schedule,
    simulation_sizes,
)
from pp_offload.plan.result import Candidate

SINGLE_STAGE = ("Schedule1F1B", "ScheduleGPipe")
"""torch's single-stage schedules: they run on torch's older executor, which cannot take OFFLOAD/RELOAD."""


def _evaluate_all(names, policies, common, limit_bytes, mode, progress, jobs, evaluate_dominated, modes):
    """Candidates of every schedule (in ``names`` order) and recompute mode, and per-schedule details;
    schedules run in ``jobs`` worker processes (orders and offload plans are pure-Python work).

    Recompute modes other than ``"none"`` run after it: a schedule that fits with neither offload nor
    recompute gets its recompute candidates listed as skipped (never faster) unless ``evaluate_dominated``.
    """
    from tqdm import tqdm

    bar = tqdm(
        total=len(names) * len(policies) * len(modes),
        desc="plan",
        unit="candidate",
        disable=None if progress else True,  # None: tqdm draws only when stderr is a terminal
        file=sys.stderr,
        leave=False,
    )
    candidates: list[Candidate] = []
    details: dict[str, dict[str, Any]] = {}
    fits_plain: set[str] = set()
    # one worker pool for every recompute mode, started when first needed: each worker imports torch's
    # pipelining and warms its caches once, not once per mode (16 worker starts for the README example's
    # 8 modes cost ~16 s of CPU, a third of its planning)
    pool: list[ProcessPoolExecutor] = []
    try:
        for recompute in modes:
            skip = set() if (recompute == "none" or evaluate_dominated) else fits_plain
            found, info = _evaluate_mode(
                names,
                policies,
                {**common, "recompute": recompute},
                limit_bytes,
                mode,
                jobs,
                evaluate_dominated,
                skip,
                bar,
                pool,
            )
            candidates += found
            for name, entry in info.items():
                details.setdefault(name, entry)
                if recompute != "none":
                    details[name].setdefault("recompute", {})[recompute] = {
                        k: entry[k] for k in ("chunk_costs_s", "stage_activation_bytes", "stage_times_s")
                    }
            if recompute == "none":
                fits_plain = {c.schedule for c in found if c.offload == "none" and c.evaluated and c.fits}
    finally:
        bar.close()
        for workers in pool:
            workers.shutdown()
    return candidates, details


def _evaluate_mode(names, policies, common, limit_bytes, mode, jobs, evaluate_dominated, skip, bar, pool):
    """`_evaluate_all` for one recompute mode (``common["recompute"]``); schedules in ``skip`` are listed
    as skipped (they fit without offload or recompute). ``pool``: the worker pool of `_evaluate_all` (a
    list holding it once started)."""
    recompute = common["recompute"]
    setups = {name: setup_schedule(name, **common) for name in names}
    if "ScheduleVAdaptive" in setups:
        choose_adaptive_limit(
            setups["ScheduleVAdaptive"], limit_bytes=limit_bytes, num_microbatches=common["num_microbatches"]
        )
    # V schedules with equal caps get the same orders: the adaptive schedule at V-Half's cap is V-Half
    alias: dict[str, str] = {}
    keys = {name: _order_key(setups[name], common) for name in names}
    if keys.get("ScheduleVAdaptive") is not None:
        for other in ("ScheduleVMin", "ScheduleVHalf", "ScheduleVZB"):
            if keys.get(other) == keys["ScheduleVAdaptive"]:
                alias["ScheduleVAdaptive"] = other
                break
    results: dict[str, tuple[list[Candidate], dict[str, Any]]] = {}
    for name in names:
        if name in skip and name not in alias:
            results[name] = (
                [
                    Candidate(
                        name,
                        label,
                        memory_limit=setups[name].memory_limit,
                        recompute=recompute,
                        skipped="fits without offload or recompute, which are never faster",
                    )
                    for label, _ in policies
                ],
                _details(
                    setups[name], None, simulation_sizes(common["pp"], common["num_microbatches"], name)
                ),
            )
            bar.update(len(policies))
    tasks = [n for n in names if n not in alias and n not in results]
    tasks.sort(key=lambda n: (not n.startswith("ScheduleV"), names.index(n)))  # slowest first
    args = (
        policies,
        common["num_microbatches"],
        limit_bytes,
        mode,
        common["virtual_stages"],
        evaluate_dominated,
    )
    workers = min(jobs or os.cpu_count() or 1, len(tasks))
    if workers <= 1:
        for name in tasks:
            bar.set_postfix_str(name)
            results[name] = _evaluate_schedule(setups[name], *args)
            bar.update(len(policies) * (1 + sum(1 for a in alias.values() if a == name)))
    else:
        if not pool:
            pool.append(ProcessPoolExecutor(max_workers=min(jobs or os.cpu_count() or 1, len(names))))
        futures = {pool[0].submit(_evaluate_schedule, setups[n], *args): n for n in tasks}
        for future in as_completed(futures):
            name = futures[future]
            results[name] = future.result()
            bar.set_postfix_str(name)
            bar.update(len(policies) * (1 + sum(1 for a in alias.values() if a == name)))
    candidates: list[Candidate] = []
    details: dict[str, dict[str, Any]] = {}
    for name in names:
        if name in alias:
            source, info = results[alias[name]]
            setup = setups[name]
            for c in source:
                copy = replace(c, schedule=name, memory_limit=setup.memory_limit)
                copy.peak_units, copy.activation = list(c.peak_units), list(c.activation)
                copy.memory, copy.breakdown = list(c.memory), [dict(b) for b in c.breakdown]
                candidates.append(copy)
            details[name] = {
                **_details(setup, None, info["simulated_microbatches"]),
                "same_orders_as": alias[name],
            }
        else:
            found, info = results[name]
            candidates += found
            details[name] = info
    return candidates, details


def _evaluate_schedule(
    setup: Setup,
    policies,
    num_microbatches: int,
    limit_bytes: int,
    mode: str,
    virtual_stages: int,
    evaluate_dominated: bool,
) -> tuple[list[Candidate], dict[str, Any]]:
    """One schedule: build its orders once, replay them under every offload policy (after the first that
    fits without offload, only with ``evaluate_dominated``: offload never makes an order faster)."""
    sizes = simulation_sizes(setup.layout.num_ranks, num_microbatches, setup.schedule)
    orders = None
    if setup.problem is None:
        orders = build_orders(setup, sizes, search=mode, virtual_stages=virtual_stages)
    error = setup.problem or (orders.error if orders else None)
    out = []
    fits_plain = False
    for label, policy in sorted(policies, key=lambda p: p[0] != "none"):
        cand = Candidate(setup.schedule, label, memory_limit=setup.memory_limit, recompute=setup.recompute)
        if error is not None:
            cand.error = error
        elif label != "none" and setup.schedule in SINGLE_STAGE:
            cand.skipped = "single-stage torch schedule: its executor cannot run OFFLOAD/RELOAD actions"
        elif fits_plain and not evaluate_dominated:
            cand.skipped = "fits without offload, which is never slower"
        else:
            try:
                summary, _ = predict(setup, orders, policy, num_microbatches)
                _fill(cand, setup, summary, limit_bytes)
            except Exception as e:  # one failing replay must not sink the plan
                cand.error = f"{type(e).__name__}: {e}"
            fits_plain = fits_plain or (label == "none" and cand.error is None and cand.fits)
        out.append(cand)
    return out, _details(setup, orders, sizes)


def _order_key(setup: Setup, common: dict[str, Any]) -> tuple | None:
    """Orders of V schedules depend only on (cap, sizes, costs): V-Adaptive at V-Half's cap is V-Half."""
    from pp_offload.order import vshape

    if not setup.schedule.startswith("ScheduleV") or setup.problem is not None:
        return None
    d = setup.layout.num_ranks
    caps = {"ScheduleVMin": vshape.v_min_cap(d), "ScheduleVHalf": vshape.v_half_cap(d), "ScheduleVZB": 2 * d}
    cap = caps.get(setup.schedule, setup.memory_cap)
    sizes = simulation_sizes(d, common["num_microbatches"], setup.schedule)
    return (float(cap), setup.costs, tuple(sizes), setup.recompute)


def _fill(cand: Candidate, setup: Setup, summary: dict[str, Any], limit_bytes: int) -> None:
    cand.pipeline_time = summary["makespan"]
    cand.bubble = summary["bubble"]
    cand.peak_units = summary["peak_units"]
    cand.activation = summary["activation"]
    cand.reload_wait = summary["reload_wait"]
    cand.offloaded_share = summary["offloaded_share"]
    cand.moved_share = summary["moved_share"]
    cand.pulled_w = summary["pulled_w"]
    cand.extrapolated = summary["extrapolated"]
    for rank, act in enumerate(cand.activation):
        state = setup.state[rank]
        parts = {
            "params": state.params,
            "grads": state.grads,
            "optimizer": state.optimizer,
            "recv_buffers": setup.recv[rank],
            "activations": act,
            "transient": setup.transient[rank],
            "reserve": setup.reserve,
        }
        cand.breakdown.append(parts)
        cand.memory.append(sum(parts.values()))
    cand.over_bytes = max(0, cand.peak_bytes - limit_bytes)
    cand.fits = cand.over_bytes == 0


def _details(setup: Setup, orders, sizes: list[int]) -> dict[str, Any]:
    return {
        "num_stages": setup.layout.num_stages,
        "placement": setup.layout.placement,
        "layers_per_stage": setup.layers,
        "chunk_costs_s": {k: getattr(setup.costs, k) for k in ("F", "I", "W", "comm", "transfer")},
        "stage_activation_bytes": [asdict(st.activation) for st in setup.stages],
        "stage_times_s": [asdict(st.times) for st in setup.stages],
        "memory_cap_units": setup.memory_cap,
        "memory_limit": setup.memory_limit,
        "simulated_microbatches": sizes + ([orders.exact.sizes[0]] if orders and orders.exact else []),
        "order_seconds": orders.build_seconds if orders else 0.0,
        "problem": setup.problem or (orders.error if orders else None),
    }
