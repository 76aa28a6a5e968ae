"""The training step's hot path on 2 gloo ranks: no host synchronization, one recomputation per pass.

One spawn runs every schedule (ours and torch's multi-stage ones) on a tiny Llama whose rows pack several
documents (position ids restart inside a row), without and with full offload, and with full, selective and
`+once` recompute.
On the second step (the first builds the schedule's buffers) it counts:

- host-synchronizing ops (`pp_offload.runtime.step_counts.SyncCounter`) over the whole ``schedule.step``:
  must be 0. Before the masks were decided on the host, every stage forward made one (transformers'
  packed-sequence check);
- runs of each checkpointed module per microbatch: the forward plus the recomputations of
  `pp_offload.recompute_plan.recomputations` (split backward: 3, or 2 on torch's first stage, which runs its
  whole backward at W; full backward: 2; a ``+once`` plan: 2 whatever the schedule). Before W shared one
  recomputation over its parameter groups, a checkpointed Llama layer ran 11 times.

The step's loss must equal the unsplit model's on the same packed rows, so the host-decided masks are the
masks transformers builds.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _dist import run_on_ranks

PP = 2
MICROBATCHES = 4
SEQ = 32
LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
}
SCHEDULES = (
    "ScheduleVMin",
    "ScheduleVHalf",
    "ScheduleVZB",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
)
CELLS = (  # (offload, recompute); mlp is selective's wrapper on a submodule (its cells: test_recompute.py,
    # the PP x FSDP2 counted cells), per-pass selective under offload: test_recompute.py, test_offload_*.py
    (None, None),
    ("full", None),
    (None, "full"),
    (None, "selective"),
    (None, "full+once"),
    ("full", "selective+once"),
)


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def _batch() -> dict[str, torch.Tensor]:
    """Rows packing documents of 5 to 20 tokens (position ids restart at each), one row a single document."""
    from pp_offload.models.masks import packed_rows

    gen = torch.Generator().manual_seed(1)
    rows = MICROBATCHES
    ids = torch.randint(0, LLAMA["vocab_size"], (rows, SEQ + 1), generator=gen)
    positions = torch.empty(rows, SEQ, dtype=torch.int64)
    for r in range(rows):
        pos, start = [], 0
        while start < SEQ:
            length = SEQ if r == 0 else int(torch.randint(5, 21, (1,), generator=gen))
            pos.extend(range(min(length, SEQ - start)))
            start += length
        positions[r] = torch.tensor(pos[:SEQ])
    return {
        "input_ids": ids[:, :-1].contiguous(),
        "labels": ids[:, 1:].contiguous(),
        "position_ids": positions,
        "packed_rows": packed_rows(positions),
    }


@functools.cache
def _reference_loss() -> float:
    from pp_offload.models import TokenCrossEntropy

    batch = _batch()
    loss_fn = TokenCrossEntropy()
    loss_fn.num_target_tokens = batch["labels"].numel()
    logits = _model()(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
    ).logits
    return float(loss_fn(logits, batch["labels"]).detach())


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.models import TokenCrossEntropy, split_model
    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime.catalog import build_schedule, schedule_info, stage_indices
    from pp_offload.runtime.offload import enable_offload
    from pp_offload.runtime.step_counts import SyncCounter, count_layer_runs

    batch = _batch()
    out: dict = {}
    for name in SCHEDULES:
        info = schedule_info(name)
        ids = stage_indices(rank, PP, info.placement)
        for offload, recompute in CELLS:
            split = split_model(_model(), num_stages=2 * PP, stage_indices=ids, verify=False)
            if recompute is not None:
                activation_checkpointing(split, mode=recompute)
            stages = [PipelineStage(split.stages[s], s, 2 * PP, torch.device("cpu")) for s in ids]
            loss_fn = TokenCrossEntropy()
            loss_fn.num_target_tokens = batch["labels"].numel()
            kwargs: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
            ours = info.module == "pp_offload.runtime.schedules"
            if ours:
                kwargs["offload"] = offload
            schedule = build_schedule(info, stages, MICROBATCHES, **kwargs)
            if offload is not None and not ours:
                enable_offload(schedule, offload)
            runs = count_layer_runs(split.stages.values())
            counter = SyncCounter()
            for step in range(2):
                split.module.zero_grad(set_to_none=True)
                losses: list[torch.Tensor] = []
                args = (batch["input_ids"],) if 0 in ids else ()
                target = {"target": batch["labels"], "losses": losses} if 2 * PP - 1 in ids else {}
                if step == 1:
                    runs.clear()
                    with counter:
                        schedule.step(
                            *args,
                            position_ids=batch["position_ids"],
                            packed_rows=batch["packed_rows"],
                            **target,
                        )
                else:
                    schedule.step(
                        *args, position_ids=batch["position_ids"], packed_rows=batch["packed_rows"], **target
                    )
            loss = torch.stack([t.detach() for t in losses]).sum() if losses else torch.zeros(())
            dist.all_reduce(loss)
            out[(name, offload, recompute)] = {
                "syncs": dict(counter.counts),
                "runs": dict(runs),
                "loss": float(loss),
                "stage_of": {n: s for s in ids for n, _ in split.stages[s].named_modules() if n in runs},
                "passes": _passes(schedule, rank),
            }
    return out


_KINDS = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}


def _passes(schedule: Any, rank: int) -> dict[int, list[str]]:
    """stage -> the compute passes (F, I, W, B) this rank's order runs on it, overlapped pairs unpacked."""
    from pp_offload.runtime import compat

    found: dict[int, list[str]] = {}

    def add(action: Any) -> None:
        for sub in getattr(action, "sub_actions", None) or ():
            add(sub)
        kind = _KINDS.get(getattr(action.computation_type, "name", ""))
        if kind is not None:
            found.setdefault(action.stage_index, []).append(kind)

    for action in compat.lowered_order(schedule)[rank]:
        if action is not None:
            add(action)
    return found


@functools.cache
def _run() -> list[dict]:
    return run_on_ranks(_worker, PP, timeout=240)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_host_sync_in_a_step(schedule: str) -> None:
    for rank, result in enumerate(_run()):
        for offload, recompute in CELLS:
            cell = result[(schedule, offload, recompute)]
            assert cell["syncs"] == {}, f"rank {rank} {schedule} offload={offload} recompute={recompute}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_losses_equal_the_unsplit_model_on_packed_rows(schedule: str) -> None:
    want = _reference_loss()
    for offload, recompute in CELLS:
        got = _run()[0][(schedule, offload, recompute)]["loss"]
        assert got == pytest.approx(want, rel=1e-5), f"{schedule} offload={offload} recompute={recompute}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_checkpointed_module_recomputes_once_per_pass(schedule: str) -> None:
    from pp_offload.recompute_plan import parse_recompute, recomputations

    for rank, result in enumerate(_run()):
        for offload, recompute in CELLS:
            cell = result[(schedule, offload, recompute)]
            if recompute is None:
                assert cell["runs"] == {}
                continue
            assert cell["runs"], f"{schedule} {recompute}: no checkpointed module ran"
            for module, count in cell["runs"].items():
                stage = cell["stage_of"][module]
                passes = cell["passes"][stage]
                assert passes.count("F") == MICROBATCHES
                once = parse_recompute(recompute).once
                want = sum(
                    1 if kind == "F" else recomputations(kind, first_stage=stage == 0, once=once)
                    for kind in passes
                )
                assert count == want, (
                    f"rank {rank} {schedule} recompute={recompute} offload={offload}: {module} ran {count} "
                    f"times in {MICROBATCHES} microbatches, want {want} (passes {''.join(passes)})"
                )
                assert count == 2 * MICROBATCHES  # F and I (or B): deferred W recomputes nothing
