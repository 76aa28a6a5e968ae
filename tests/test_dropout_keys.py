"""Dropout keyed to (seed, step, microbatch, site) (`pp_offload.runtime.dropout_keys`): the same losses with
GPT-2's default dropout 0.1 under every schedule, split, offload policy and recompute plan, and the same as
one process running the unsplit model microbatch by microbatch with the same keys.

Offline: the key itself, the hooks leave the surrounding generator state alone, eval mode and
no-microbatch are no-ops, a second install replaces the first, unkeyed dropout modules are named, and a
split run in any forward order under every recompute plan gives the unsplit model's losses and gradients.
Multi-process (gloo, 2 ranks, one launch): V-Half, V-ZB and Interleaved1F1B, each without and with full
offload, under no, selective and full recompute, plus budget offload with a mixed recompute plan and a
microbatch offset (a data-parallel replica's place in the global batch): two optimizer steps, losses equal
to the reference to rel 1e-5 (fp32).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_on_ranks
from torch import nn

from pp_offload.runtime.dropout_keys import (
    EMBEDDING,
    DropoutKeys,
    dropout_sites,
    key_dropout,
    unkeyed_dropout,
)

VOCAB, SEQ, M, SEED, LR = 96, 32, 4, 7, 0.05
GPT2 = {  # GPT2Config's default dropout: resid, embd and attn 0.1
    "n_embd": 64,
    "n_inner": 192,
    "n_head": 4,
    "n_layer": 4,
    "vocab_size": VOCAB,
    "n_positions": SEQ,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "tie_word_embeddings": False,  # a loop placement would need the tied-gradient sync of the recipe
}


def _model() -> nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(**GPT2, attn_implementation="sdpa")
    assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.1, 0.1, 0.1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (m, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1))


def _reference(steps: int, m: int = M, first: int = 0) -> list[list[float]]:
    """The unsplit model, one microbatch at a time with keys ``first``, ``first + 1``, ...: losses per
    step, SGD in between."""
    model = _model()
    keys = DropoutKeys(seed=SEED)
    key_dropout(model, keys)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _batch(m)
    out = []
    for step in range(steps):
        keys.step = step
        optimizer.zero_grad()
        losses = []
        for j, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
            with keys.running(first + j):
                loss = _loss(model(input_ids=xm, use_cache=False).logits, ym)
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        out.append(losses)
    return out


# --- offline ----------------------------------------------------------------------------------------------


def test_keys_are_a_function_of_seed_step_microbatch_and_site() -> None:
    keys = DropoutKeys(seed=1, step=2)
    with pytest.raises(RuntimeError, match="no microbatch"):
        keys.seed_for(0)
    with keys.running(3):
        a = keys.seed_for(0)
        assert a == DropoutKeys(seed=1, step=2, microbatch=3).seed_for(0) and 0 <= a < 2**63
        assert len({a, keys.seed_for(1), keys.seed_for(EMBEDDING)}) == 3
    assert keys.microbatch is None
    others = {DropoutKeys(seed=s, step=t, microbatch=j).seed_for(0) for s, t, j in ((2, 2, 3), (1, 3, 3))}
    assert a not in others and len(others) == 2


def test_hooks_leave_the_generator_alone_and_do_nothing_in_eval_or_outside_a_microbatch() -> None:
    model = _model()
    keys = DropoutKeys(seed=SEED)
    sites = key_dropout(model, keys)
    assert [s for s, _ in sites] == [0, 1, 2, 3, EMBEDDING] and unkeyed_dropout(model) == []
    assert key_dropout(model, keys) == sites  # a second install replaces the first: one seeding per call
    layer = model.transformer.h[0]
    assert (len(layer._forward_pre_hooks), len(layer._forward_hooks)) == (1, 1)
    x, _ = _batch(1)
    with keys.running(0):
        torch.manual_seed(123)
        first = model(input_ids=x).logits
        after = torch.rand(3)  # the sites put the generator back: the draw after the forward is unchanged
        torch.manual_seed(999)  # another surrounding state: the same masks
        again = model(input_ids=x).logits
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    with keys.running(1):
        assert not torch.equal(model(input_ids=x).logits, first)  # another microbatch, other masks
    torch.manual_seed(5)
    unkeyed = model(input_ids=x).logits  # no microbatch: the plain generator
    torch.manual_seed(5)
    assert torch.equal(unkeyed, model(input_ids=x).logits)
    model.eval()
    with keys.running(0):
        plain = model(input_ids=x).logits
    assert torch.equal(plain, model(input_ids=x).logits)


def test_unkeyed_dropout_is_named() -> None:
    model = _model()
    model.transformer.extra = nn.Dropout(0.2)  # a dropout outside the layers and the embedding
    assert unkeyed_dropout(model) == ["transformer.extra"]
    assert {s for s, _ in dropout_sites(model)} == {0, 1, 2, 3, EMBEDDING}


def unsplit_run(prepare: Any = None) -> tuple[list[float], nn.Module]:
    """The unsplit model, keyed, one microbatch at a time: its losses and the model (its gradients).
    ``prepare``: called on the model's modules after keying (tests/test_compile.py compiles them)."""
    model = _model()
    keys = DropoutKeys(seed=SEED)
    key_dropout(model, keys)
    if prepare is not None:
        prepare([model])
    x, y = _batch(M)
    losses = []
    for j in range(M):
        with keys.running(j):
            loss = _loss(model(input_ids=x[j : j + 1]).logits, y[j : j + 1])
            loss.backward()
        losses.append(loss.item())
    return losses, model


def split_run(recompute: str, prepare: Any = None) -> tuple[list[float], nn.Module]:
    """The model split in 4 chained stages under ``recompute``, keyed, forwards in a shuffled microbatch
    order and backwards in reverse: its losses and the model. ``prepare``: as for `unsplit_run`, on the
    stages."""
    from pp_offload.models.split import chain_stages, split_model
    from pp_offload.parallel import activation_checkpointing

    model = _model()
    split = split_model(model, num_stages=4, stage_indices=[0, 1, 2, 3], verify=False)
    if recompute != "none":
        activation_checkpointing(split, mode=recompute)
    keys = DropoutKeys(seed=SEED)
    assert len(key_dropout(split, keys)) == 5
    if prepare is not None:
        prepare(list(split.stages.values()))
    x, y = _batch(M)
    losses: dict[int, torch.Tensor] = {}
    order = [2, 0, 3, 1]
    torch.manual_seed(42)  # any surrounding state
    for j in order:
        with keys.running(j):
            logits, _ = chain_stages(list(split.stages.values()), x[j : j + 1])
            losses[j] = _loss(logits, y[j : j + 1])
    for j in reversed(order):
        with keys.running(j):
            losses[j].backward()
    return [losses[j].item() for j in range(M)], model


@pytest.mark.parametrize("recompute", ["none", "full", "selective", "mlp", "selective:0.5,mlp"])
def test_split_stages_in_any_order_give_the_unsplit_losses_and_grads(recompute: str) -> None:
    """Chained stages under a recompute plan, forwards in a shuffled microbatch order and backwards in
    reverse: the unsplit model's losses exactly and its gradients."""
    ref_losses, reference = unsplit_run()
    losses, model = split_run(recompute)
    assert losses == ref_losses
    ref_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)


# --- multi-process ----------------------------------------------------------------------------------------

CONFIGS: tuple[tuple[str, str, str, int], ...] = tuple(
    (schedule, offload, recompute, 0)
    for schedule in ("ScheduleVHalf", "ScheduleVZB", "ScheduleInterleaved1F1B")
    for offload in ("none", "full")
    for recompute in ("none", "selective", "full")
) + (("ScheduleVZB", "budget", "selective:0.5,mlp", 0), ("ScheduleVHalf", "none", "none", M))
"""(schedule, offload, recompute, microbatch offset)."""
STEPS = 2


def _pipeline_losses(
    rank: int, world: int, schedule_name: str, offload: str, recompute: str, offset: int, keyed: bool = True
) -> dict[str, Any]:
    """Losses per step of one pipelined run on this rank (the last stage's rank has them)."""
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.models.split import split_model
    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime.catalog import build_schedule, schedule_info, stage_indices
    from pp_offload.runtime.dropout_keys import key_schedule
    from pp_offload.runtime.offload import enable_offload

    info = schedule_info(schedule_name)
    num_stages = 2 * world
    ids = stage_indices(rank, world, info.placement, 2)
    model = _model()
    split = split_model(model, num_stages=num_stages, stage_indices=ids, verify=False)
    if recompute != "none":
        activation_checkpointing(split, mode=recompute)
    keys = DropoutKeys(seed=SEED)
    if keyed:
        key_dropout(split, keys)
    torch.manual_seed(SEED)  # unkeyed: the same generator state on every rank and run
    stages = [PipelineStage(split.stages[s], s, num_stages, torch.device("cpu")) for s in ids]
    kwargs: dict[str, Any] = {"loss_fn": _loss, "scale_grads": False}
    ours = info.module == "pp_offload.runtime.schedules"
    if ours and offload != "none":
        kwargs["offload"] = offload
    schedule = build_schedule(info, stages, M, **kwargs)
    if not ours and offload != "none":
        enable_offload(schedule, offload)
    key_schedule(schedule, keys, microbatch_offset=offset)
    optimizer = torch.optim.SGD(split.module.parameters(), lr=LR)
    x, y = _batch(M)
    out = []
    for step in range(STEPS):
        keys.step = step
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        first, last = 0 in ids, num_stages - 1 in ids
        schedule.step(*((x,) if first else ()), **({"target": y, "losses": losses} if last else {}))
        optimizer.step()
        out.append([t.item() for t in losses])
    moved = schedule.offload.store.stats().host_pool_bytes if offload != "none" else 0
    return {"losses": out if out[0] else None, "moved": moved}


UNKEYED = ("ScheduleVHalf", "ScheduleInterleaved1F1B")
"""Run without keys too: what the keys fix (the test can fail)."""


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out: dict[Any, Any] = {config: _pipeline_losses(rank, world, *config) for config in CONFIGS}
    for name in UNKEYED:
        out[name] = _pipeline_losses(rank, world, name, "none", "none", 0, keyed=False)
    return out


@functools.cache
def _run() -> list[dict]:
    return run_on_ranks(_worker, 2, timeout=300)


def test_losses_with_dropout_equal_across_schedules_offload_recompute_and_the_reference() -> None:
    results = _run()
    references = {offset: _reference(STEPS, first=offset) for offset in {c[3] for c in CONFIGS}}
    for config in CONFIGS:
        losses = [r[config]["losses"] for r in results if r[config]["losses"] is not None]
        assert len(losses) == 1, config
        torch.testing.assert_close(losses[0], references[config[3]], rtol=1e-5, atol=0, msg=str(config))
        if config[1] != "none":
            assert sum(r[config]["moved"] for r in results) > 0, f"{config}: offload moved nothing"
    # the offset is a real change: another replica's microbatches get other masks
    assert references[0] != references[M]
    # without keys the masks follow each rank's draw order: the schedule changes the losses
    unkeyed = [next(r[name]["losses"] for r in results if r[name]["losses"] is not None) for name in UNKEYED]
    assert unkeyed[0][0] != unkeyed[1][0] and unkeyed[0][0] != references[0][0]
