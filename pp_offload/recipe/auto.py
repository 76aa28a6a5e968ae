"""``pipeline.schedule: auto``: measure the real costs with a probe step, then pick schedule and offload.

Why in the recipe: which schedule is fastest within a memory limit depends on measured pass times, saved
bytes and copy times (`pp_offload.plan.auto`), and the recipe is where the model, the data and the
hardware meet. The probe runs before any weight changes:

1. the probe pipeline (`PROBE_SCHEDULE` with `PROBE_OFFLOAD`, unsharded even when ``dp > 1``) runs
   ``pipeline.auto_probe_steps`` steps on the first batch, timing every action; the random number state
   is restored and the gradients dropped afterwards, so the run that follows is exactly the run the chosen
   schedule would have made from the start (tested: same losses as that fixed schedule);
2. global rank 0 chooses (`choose`: the fastest candidate whose predicted per-rank activation peak fits
   ``pipeline.memory_limit`` and ``pipeline.activation_budget_gib``) and broadcasts the decision, so every
   rank of every replica builds the same schedule; when nothing fits, every rank raises the same error;
3. the real pipeline is built once with the chosen schedule, offload policy and the measured costs, and
   with the chosen activation recompute (``train.activation_checkpointing``) when the user left it off;
   when the pick offloads, the runtime plans with the figures ``choose`` judged it by
   (``AutoDecision.offload_inputs``: per-stage costs, layers, copy times and bytes), so it places the
   predicted plan.

Offload candidates: `choose`'s defaults, or the list given as ``pipeline.offload`` (e.g. ``[none, budget,
budget:sublayer]``). The probe measures what budget offload would move per decoder layer and per sub-layer
unit; the units' compute shares come from the planner's FLOPs for the model's config (`unit_shares_for`).

Activation recompute: unless ``train.activation_checkpointing`` is already set (the probe then measures
with it), ``choose`` also judges recompute of the decoder layers (`DEFAULT_RECOMPUTE`), from the probe's
measurement rescaled: the share of a layer's saved bytes that stays comes from the planner's model of
this model's layers (`recompute_options`), and the time from the probe itself, which times one of the
model's decoder layers on its real microbatch, on the run's device, plain and under each mode the
candidates use (`measure_step`'s ``recompute_modes``, `pp_offload.plan.recompute_calibration`: the
checkpointing's cost in the forward and each recomputation's in I, W and a full backward). Only where
that measurement failed (it is noted in the probe's table) does the time fall back to the planner's
traffic model on the GPU preset named by the device (H100 where it names none). A recompute mode wins
only where it lets a faster candidate fit.

Rank 0 logs the ranked candidates and writes them, with the measurement, to ``<output.dir>/auto.json``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_offload.fsutil import write_text_atomic
from pp_offload.recipe.checkpoint import rng_state, set_rng_state
from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.pipeline import Pipeline, build_pipeline
from pp_offload.recipe.topology import Topology, machine_preset

__all__ = [
    "AUTO",
    "choose_schedule",
    "choose_within",
    "chosen_config",
    "is_auto",
    "machine_preset",
    "probe_config",
    "recompute_candidates",
    "recompute_modes",
]

AUTO = "auto"
_SHOWN = 8  # candidates printed; auto.json has them all


def is_auto(config: RecipeConfig) -> bool:
    return str(config.pipeline.schedule).lower() == AUTO


def probe_config(config: RecipeConfig) -> RecipeConfig:
    from pp_offload.plan.auto import PROBE_OFFLOAD, PROBE_SCHEDULE

    pipeline = dataclasses.replace(
        config.pipeline, schedule=PROBE_SCHEDULE, offload=PROBE_OFFLOAD, memory_limit=None, costs=None
    )
    return dataclasses.replace(config, pipeline=pipeline)


def chosen_config(config: RecipeConfig, decision: Any) -> RecipeConfig:
    """``config`` with the decision's schedule, offload policy, adaptive limit, measured costs and
    activation recompute (a decision made without recompute candidates keeps the user's setting)."""
    pipeline = dataclasses.replace(
        config.pipeline,
        schedule=decision.schedule,
        offload=decision.offload,
        memory_limit=decision.memory_limit,  # set for ScheduleVAdaptive only
        costs=dict(decision.costs),  # torch's schedules use them for their offload plan
    )
    train = config.train
    if decision.recompute != "none":
        train = dataclasses.replace(train, activation_checkpointing=decision.recompute)
    return dataclasses.replace(config, pipeline=pipeline, train=train)


def recompute_candidates(config: RecipeConfig, model: nn.Module, device: torch.device) -> list[Any]:
    """The recompute options ``choose`` judges for this run: none when ``train.activation_checkpointing``
    is set (the probe measured with it) or when the planner cannot model the model's layers (then auto
    picks among schedules and offload only, as before)."""
    from pp_offload.models.lora import unwrap_peft
    from pp_offload.parallel import checkpointing_mode
    from pp_offload.plan.auto import recompute_options

    if checkpointing_mode(config.train.activation_checkpointing) is not None:
        return []
    spec = config.pipeline
    microbatch = config.train.global_batch_size // (spec.microbatches * spec.dp)  # exact: preflight checked
    try:
        return recompute_options(
            unwrap_peft(model).config,
            seq_len=config.data.seq_len,
            microbatch_size=microbatch,
            machine=machine_preset(device),
            dtype=config.train.precision,
        )
    except ValueError:  # a config the planner does not model (MoE, an unknown layout)
        return []


def recompute_modes(options: list[Any]) -> tuple[str, ...]:
    """The recompute modes ``options`` use (either mode of a two-mode plan), least recompute first: what
    the probe measures the cost of (`measure_step`'s ``recompute_modes``)."""
    from pp_offload.recompute_plan import MODES

    used = {mode for o in options for mode in (o.mode, o.rest)}
    return tuple(m for m in MODES if m in used and m != "none")


def choose_within(config: RecipeConfig, measurement: Any, options: list[Any]) -> Any:
    """`pp_offload.plan.auto.choose` on ``measurement`` within the config's limits (``pipeline.memory_limit``,
    ``pipeline.activation_budget_gib``), among its offload candidates and the recompute ``options``: the
    ranks' choice on their probe's measurement, and ``--check``'s on the planner's
    (`pp_offload.recipe.dry_build`)."""
    from pp_offload.plan.auto import choose

    spec = config.pipeline
    budget = None if spec.activation_budget_gib is None else int(spec.activation_budget_gib * 2**30)
    return choose(
        measurement,
        num_microbatches=spec.microbatches,
        memory_limit=spec.memory_limit,
        activation_budget_bytes=budget,
        offload=spec.offload if isinstance(spec.offload, list) else None,
        recompute=options,
    )


def choose_schedule(
    config: RecipeConfig,
    model: nn.Module,
    topo: Topology,
    device: torch.device,
    mesh: DeviceMesh,
    probe_step: Callable[[Pipeline], Any],
    out: Path,
    *,
    reuse: bool = False,
) -> tuple[RecipeConfig, Any]:
    """Probe, choose on rank 0, broadcast; returns (the config to build the real pipeline from, decision).

    ``probe_step(pipeline)`` runs one step of the probe pipeline (the caller's step function, on the run's
    first batch). ``reuse``: a resumed run takes the decision recorded in ``out/auto.json`` by the run it
    continues (a new probe could choose otherwise, and the resumed run would differ from an uninterrupted
    one). A collective over every rank."""
    from pp_offload.models.lora import unwrap_peft
    from pp_offload.plan.auto import AutoDecision, AutoError, measure_step, unit_shares_for

    recorded = out / "auto.json"
    layout = {"pp": topo.pp, "dp": topo.dp}
    if reuse:
        message: list[Any] = [None]
        if topo.rank == 0:
            message = [_recorded_decision(recorded, layout)]
        dist.broadcast_object_list(message, src=0)
        if message[0] is not None:
            decision = AutoDecision.from_dict(message[0])
            if topo.rank == 0:
                print(
                    f"auto: resuming with the recorded choice ({recorded}):\n{decision.table(limit=_SHOWN)}",
                    flush=True,
                )
            return chosen_config(config, decision), decision
    spec = config.pipeline
    options = recompute_candidates(config, model, device)  # pure: the same on every rank
    rng = rng_state()
    probe = build_pipeline(probe_config(config), model, topo, device, mesh, shard=False)
    measurement = measure_step(
        probe.schedule,
        lambda: probe_step(probe),
        steps=int(spec.auto_probe_steps),
        group=probe.pp_group,
        unit_shares=unit_shares_for(unwrap_peft(model).config, seq_len=config.data.seq_len),
        recompute_modes=recompute_modes(options),
    )
    for param in model.parameters():
        param.grad = None
    probe.split.module.to("cpu")  # the real split moves what it holds back; nothing stays behind on a GPU
    set_rng_state(rng)

    message = [None]
    if topo.rank == 0:
        try:
            decision = choose_within(config, measurement, options)
            message = [{"decision": decision.to_dict()}]
        except (AutoError, ValueError) as error:
            message = [{"error": str(error)}]
    dist.broadcast_object_list(message, src=0)
    if "error" in message[0]:
        unit = "" if spec.activation_budget_gib is None else " (bytes: activation_budget_gib x 2**30)"
        raise ConfigError(f"pipeline.schedule=auto: {message[0]['error']}{unit}")
    decision = AutoDecision.from_dict(message[0]["decision"])
    if topo.rank == 0:
        report = {"decision": decision.to_dict(), "layout": layout, "measurement": measurement.to_dict()}
        write_text_atomic(recorded, json.dumps(report, indent=2, default=str) + "\n")
        print(f"{measurement.table()}\n{decision.table(limit=_SHOWN)}\n(all in {recorded})", flush=True)
    return chosen_config(config, decision), decision


def _recorded_decision(recorded: Path, layout: dict[str, int]) -> dict[str, Any] | None:
    """The decision ``auto.json`` records, when it was made for ``layout`` (pipeline ranks x replicas);
    else None, with a line saying why auto probes again. The file is JSON, read as data only: a corrupt
    one is named and ignored (a new probe replaces it), never trusted half."""
    from pp_offload.plan.auto import AutoDecision

    if not recorded.is_file():
        return None
    try:
        report = json.loads(recorded.read_text())
        decision = report["decision"]
        AutoDecision.from_dict(decision)  # every field it needs is there
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        print(
            f"auto: warning: ignoring {recorded} ({type(error).__name__}: {error}); probing again", flush=True
        )
        return None
    before = report.get("layout")
    if isinstance(before, dict) and before != layout:
        print(
            f"auto: the checkpoint's choice was made at pp {before.get('pp')} x dp {before.get('dp')}, this "
            f"run is pp {layout['pp']} x dp {layout['dp']}: probing again for the new layout",
            flush=True,
        )
        return None
    return decision
