"""Per-rank activation peak of a pipeline step, deferred weight gradients against torch's split, by
saved-tensor accounting, next to the planner's prediction of the same.

Why: deferred W (`pp_offload.runtime.deferred_w`) frees a chunk's saved tensors when its I ends and holds
its queue (every trainable linear's input and output gradient) until its W, where torch's split holds the
saved tensors until W. With recompute the saved tensors are small and the queue is not, so the peak can
rise; the planner counts the queue (`pp_offload.plan.memory.queued_bytes`), and an offload plan's copies
between a chunk's I and its W move the queue to host memory (`pp_offload.runtime.deferred_w.WeightPass`).
This bench runs real steps (gloo, CPU, a Llama of 8 decoder layers in ``2 * ranks`` stages, hidden 256,
seq 256, fp32) for V-Half and V-ZB, without and with full recompute, each without offload and with full
offload (placed with the planner's figures for that split, `pp_offload.plan.handoff.planner_setup`, H100
preset, as ``schedule: auto`` places it; and, with full recompute, with the schedule's default costs: unit
passes, a chunk's copy at half a forward, the queue the size of a chunk, where the plan has copies between
I and W that the planner's H100 figures do not afford at this size), and records per rank the most bytes
held at any action boundary:

- every distinct storage autograd saved that is still alive (a saved-tensor hook over the step), weights
  left out; storages saved inside a checkpointed layer are seen by the checkpoint's own hooks, not
  these: with full recompute what is counted is what the recompute keeps (layer inputs) and, transiently
  during I, nothing of the recomputation (sampled between actions);
- plus, under deferred W, the queue of every microbatch whose I ran and whose W has not while it is on the
  device, each distinct storage once, the stage output's gradient (torch's receive buffer) left out.

With offload, the device bytes the activation store holds (captured chunks not yet copied out, reloaded
chunks and queues not yet released) are added. Stage outputs and loss tensors (held by torch until I in
both splits) and receive buffers are not counted.
``predicted`` is the planner's peak of the same accounting (`pp_offload.plan.handoff.planner_setup`'s
stage bytes, outputs and loss left out) on the order the runtime ran, replayed by the simulator: the byte
model the planner, ``schedule: auto`` and budget offload use.

    python bench/bench_queue_peak.py               # 2 ranks, 4 microbatches: ~1 min on 2 cores
    python bench/bench_queue_peak.py --ranks 4     # 4 ranks, 8 microbatches: W further from I
Writes ``queue_peak.json`` (``queue_peak_4ranks.json``) to ``bench/results`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from small_llama import llama_config

RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = ("ScheduleVHalf", "ScheduleVZB")
MODES = (
    "none",
    "full",
    "none, offload full",
    "full, offload full",
    "full, offload full, default costs",
)
SPLITS = ("torch split", "deferred W")
CONFIG = {
    "layers": 8,
    "hidden": 256,
    "intermediate": 688,
    "heads": 8,
    "kv_heads": 4,
    "vocab": 512,
    "seq": 256,
}
_MiB = float(1 << 20)


class _Tracker:
    """Bytes held at action boundaries (module doc): saved storages alive plus queues awaiting their W."""

    def __init__(self, params: set[int], store: Any = None) -> None:
        self.params = params
        self.store = store  # with offload: the activation store, whose chunks its own hooks save
        self.saved: dict[int, Any] = {}  # data pointer -> weak reference to the storage
        self.pending: dict[
            int, tuple[Any, set[Any]]
        ] = {}  # id -> (deferred W's WeightPass, storages to skip)
        self.peak = 0

    def pack(self, t: Any) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.saved[storage.data_ptr()] = weakref.ref(storage)
        return t.detach()

    def sample(self) -> None:
        held: dict[Any, int] = {}
        for ptr, ref in list(self.saved.items()):
            storage = ref()
            if storage is None:
                del self.saved[ptr]
            else:
                held[("saved", ptr)] = storage.nbytes()
        for runner, skip in self.pending.values():
            if runner.stored_key is not None:  # in the activation store: counted by its resident bytes
                continue
            for _, x, dy, _ in runner.entries:  # emptied when its W ran
                for t in (x, dy):
                    key = (t.device, t.untyped_storage().data_ptr())
                    if key not in skip:
                        held[("saved", key[1])] = t.untyped_storage().nbytes()
        resident = self.store.resident_bytes() if self.store is not None else 0
        self.peak = max(self.peak, sum(held.values()) + resident)


def _instrument(stages: list[Any], tracker: _Tracker) -> None:
    """Sample after every F, I and W (B) of the rank's stages; note each deferred-W queue from its I to its
    W (the stage's ``dw_builder``, measuring: it notes the stage output's gradient to leave out)."""
    from pp_offload.runtime import deferred_w

    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            method = getattr(stage, name)

            def sampled(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                out = _method(*args, **kwargs)
                tracker.sample()
                return out

            setattr(stage, name, sampled)
        builder = getattr(stage, "dw_builder", None)
        if isinstance(builder, deferred_w._Builder):
            builder.measure = True
            _TRACKED[id(builder)] = tracker
    _patch_builder()


_TRACKED: dict[int, _Tracker] = {}


def _patch_builder() -> None:
    """Have every measured ``dw_builder`` note its microbatch's queue until that microbatch's W runs."""
    from pp_offload.runtime import deferred_w

    cls = deferred_w._Builder
    if getattr(cls, "_bench_patched", False):
        return
    build = cls.__call__

    def noted(builder: Any) -> Any:
        runner = build(builder)
        tracker = _TRACKED.get(id(builder))
        if tracker is not None:  # the runner itself is returned: the offload runtime moves its queue
            tracker.pending[id(runner)] = (runner, set(builder._output_grads))
        return runner

    cls.__call__ = noted
    cls._bench_patched = True


def _setup(name: str, mode: str, deferred: bool, ranks: int, m: int) -> Any:
    """The planner's setup of one row: its stage bytes (outputs and loss left out, as the bench counts) and
    the offload inputs the runtime places the row's offload with."""
    import dataclasses

    from pp_offload.plan.handoff import planner_setup

    setup = planner_setup(
        llama_config(CONFIG),
        schedule=name,
        pp=ranks,
        seq_len=CONFIG["seq"],
        microbatch_size=1,
        num_microbatches=m,
        dtype="fp32",
        recompute=mode.partition(",")[0],
        layers_per_stage=[CONFIG["layers"] // (2 * ranks)] * (2 * ranks),
    )
    for i, st in enumerate(setup.stages):
        act = dataclasses.replace(
            st.activation, output=0, loss=0, queued=st.activation.queued if deferred else None
        )
        setup.stages[i] = dataclasses.replace(st, activation=act)
    return setup


def _worker(rank: int, world_size: int, m: int) -> list[dict[str, Any]]:
    import torch
    from torch.distributed.pipelining import PipelineStage
    from transformers import AutoModelForCausalLM

    from pp_offload.models import TokenCrossEntropy, split_model
    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime.catalog import build_schedule, schedule_info, stage_indices

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab"], (m, CONFIG["seq"] + 1), generator=gen)
    rows = []
    for name in SCHEDULES:
        for mode in MODES:
            for split_kind in SPLITS:
                info = schedule_info(name)
                indices = stage_indices(rank, world_size, info.placement)
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(llama_config(CONFIG), dtype=torch.float32).train()
                split = split_model(model, num_stages=2 * world_size, stage_indices=indices, verify=False)
                recompute, _, rest = mode.partition(", offload ")
                offload, _, placement = rest.partition(", ")
                if recompute != "none":
                    activation_checkpointing(split, mode=recompute)
                n = 2 * world_size
                stages = [PipelineStage(split.stages[s], s, n, torch.device("cpu")) for s in indices]
                loss_fn = TokenCrossEntropy()
                loss_fn.num_target_tokens = m * CONFIG["seq"]
                kwargs = {"loss_fn": loss_fn, "scale_grads": False}
                if offload:
                    deferred = split_kind == "deferred W"
                    setup = _setup(name, mode, deferred, world_size, m)
                    kwargs["offload"] = offload
                    if placement != "default costs":  # else unit costs, copies at half a forward
                        kwargs["offload_inputs"] = setup.offload_inputs()
                schedule = build_schedule(info, stages, m, deferred_w=split_kind == "deferred W", **kwargs)
                params = {p.untyped_storage().data_ptr() for p in split.module.parameters()}
                runtime = getattr(schedule, "offload", None)
                tracker = _Tracker(params, runtime.store if runtime is not None else None)
                _instrument(stages, tracker)
                for _ in range(2):  # the first step allocates torch's buffers; the peak is the second's
                    split.module.zero_grad(set_to_none=True)
                    tracker.peak = 0
                    tracker.pending.clear()
                    args = (ids[:, :-1],) if 0 in indices else ()
                    target = {"target": ids[:, 1:], "losses": []} if n - 1 in indices else {}
                    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
                        schedule.step(*args, **target)
                order = {r: list(actions) for r, actions in schedule.pipeline_order.items()}
                rows.append(
                    {
                        "schedule": name,
                        "recompute": mode,
                        "split": split_kind,
                        "peak": tracker.peak,
                        "order": order,
                        "plan": runtime.plan if runtime is not None else None,
                        # deferred W: queues the plan moved to host memory between their I and W
                        "queue_copies": 0 if runtime is None else len(runtime.moved_queues()),
                    }
                )
    return rows


def _predicted(name: str, mode: str, deferred: bool, ranks: int, m: int, order: Any, plan: Any) -> list[int]:
    """The planner's per-rank peak of the same accounting (outputs and loss left out), on the order the
    runtime ran (its ``pipeline_order``, or with offload its offload plan, replayed with the planner's
    costs)."""
    from pp_offload.order.offload_inputs import activation_peaks
    from pp_offload.sim import simulate

    inputs = _setup(name, mode, deferred, ranks, m).offload_inputs()
    if plan is not None and mode.endswith("default costs"):  # timed as it was placed
        return activation_peaks(plan.sim, inputs.stage_bytes, plan.layered)
    if plan is not None:
        return activation_peaks(plan.replay(inputs.costs), inputs.stage_bytes, plan.layered)
    return activation_peaks(simulate(order, inputs.costs), inputs.stage_bytes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 4))
    parser.add_argument("--microbatches", type=int, default=None, help="default: 2 * ranks")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    from pp_offload.local_ranks import run_on_ranks

    ranks = args.ranks
    m = args.microbatches or 2 * ranks
    per_rank = run_on_ranks(_worker, ranks, m, timeout=1800, op_timeout=600)
    rows = []
    for i, row in enumerate(per_rank[0]):
        predicted = _predicted(
            row["schedule"],
            row["recompute"],
            row["split"] == "deferred W",
            ranks,
            m,
            row["order"],
            row["plan"],
        )
        rows.append(
            {
                **{k: row[k] for k in ("schedule", "recompute", "split")},
                "measured_mib": [round(r[i]["peak"] / _MiB, 2) for r in per_rank],
                "queue_copies": sum(r[i]["queue_copies"] for r in per_rank),
                "predicted_mib": [round(p / _MiB, 2) for p in predicted],
            }
        )
    ranks_label = "measured MiB (rank " + ", ".join(map(str, range(ranks))) + ")"
    print(
        f"{'schedule':14} {'recompute':18} {'split':12} {ranks_label:>34} {'predicted MiB':>26} "
        f"{'queue copies':>12}"
    )
    for r in rows:
        measured = ", ".join(f"{x:.1f}" for x in r["measured_mib"])
        predicted = ", ".join(f"{x:.1f}" for x in r["predicted_mib"])
        print(
            f"{r['schedule']:14} {r['recompute']:18} {r['split']:12} {measured:>34} {predicted:>26} "
            f"{r['queue_copies']:>12}"
        )
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "config": CONFIG,
        "ranks": ranks,
        "microbatches": m,
        "load_average": os.getloadavg(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("queue_peak.json" if ranks == 2 else f"queue_peak_{ranks}ranks.json")
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
