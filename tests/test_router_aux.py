"""The MoE router load-balancing loss through pipeline stages (issue 12, item 3).

Offline: chained stages give transformers' own loss (cross entropy + coef x aux) and gradients, for one
microbatch bit for bit; the aux gradient is really there (dropping it is caught by the split-time proof);
on several microbatches the pipelined loss is the mean of the microbatches' aux losses, equal to one
process accumulating gradients over the same microbatches. On 2 gloo ranks: V-Half (4 stages, the last
on rank 0; without and with full offload) gives one process's gradients of that same loss; on 4 ranks,
pp 2 x dp 2 with FSDP2, too. The recipe-level 2-rank run is in test_recipe_families.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_on_ranks

from pp_offload.models import (
    IGNORE_INDEX,
    TokenCrossEntropy,
    UnsupportedModelError,
    chain_stages,
    router_aux_of,
    split_model,
    verify,
)
from pp_offload.models.router_aux import RouterAux
from pp_offload.models.sweep import tiny_model

COEF = 0.5  # large enough that the aux loss moves the loss and the router gradients visibly
TIGHT = 1e-5  # the stages run transformers' ops in its order: rounding at most (in practice bit-equal)
MICROBATCHES, ROWS, SEQ = 2, 2, 12


def _model(model_type: str = "mixtral") -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_model(model_type, output_router_logits=True, router_aux_loss_coef=COEF).train()


def _batch(model: torch.nn.Module, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (rows, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float) -> None:
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        scale = float(ref.abs().max()) or 1.0
        diff = float((got[name] - ref).abs().max())
        assert diff <= rtol * scale, f"{name}: {diff:.3g} vs largest {scale:.3g}"


def _accumulated(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, m: int) -> float:
    """One process, unsplit, gradient accumulation over ``m`` microbatches: the pipelined loss."""
    loss_fn = TokenCrossEntropy(router_aux_weight=COEF / m)
    loss_fn.num_target_tokens = int((labels != IGNORE_INDEX).sum())
    total = 0.0
    for mb_ids, mb_labels in zip(ids.tensor_split(m), labels.tensor_split(m), strict=True):
        out = model(input_ids=mb_ids, use_cache=False)
        loss = loss_fn((out.logits, out.aux_loss), mb_labels)
        loss.backward()
        total += float(loss.detach())
    return total


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_chained_stages_give_transformers_loss_and_gradients(model_type: str) -> None:
    model = _model(model_type)
    ids, labels = _batch(model, ROWS)
    full = torch.cat([ids[:, :1], labels], dim=1)  # transformers shifts labels itself
    out = model(input_ids=full[:, :-1], labels=full[:, :-1].clone(), use_cache=False)
    out.loss.backward()  # mean CE (of the SEQ - 1 targets it sees) + coef x aux
    want_loss, want_aux, want = float(out.loss.detach()), float(out.aux_loss.detach()), _grads(model)

    split = split_model(model, num_stages=3, stage_indices=[0, 1, 2])
    assert split.router_aux is not None and split.router_aux.coef == COEF
    shifted = torch.cat([labels[:, :-1], torch.full((ROWS, 1), IGNORE_INDEX)], dim=1)
    loss_fn = TokenCrossEntropy(router_aux_weight=COEF)
    loss_fn.num_target_tokens = int((shifted != IGNORE_INDEX).sum())
    logits, aux = chain_stages([split.stages[s] for s in range(3)], ids)
    assert aux is not None
    loss = loss_fn((logits, aux), shifted)
    loss.backward()
    assert float(aux.detach()) == pytest.approx(want_aux, rel=TIGHT) and want_aux > 0.1
    assert float(loss.detach()) == pytest.approx(want_loss, rel=TIGHT)
    _assert_grads_close(_grads(model), want, TIGHT)


def test_the_router_gradient_of_the_aux_loss_is_there_and_proven() -> None:
    """Dropping the aux gradient (value kept) changes the router gradients and the proof refuses it."""
    model = _model()
    assert verify.check_split(model, split_model).ok
    ids, labels = _batch(model, ROWS)
    split = split_model(model, num_stages=2, stage_indices=[0, 1])
    loss_fn = TokenCrossEntropy(router_aux_weight=COEF)
    loss_fn.num_target_tokens = labels.numel()
    loss_fn(chain_stages([split.stages[0], split.stages[1]], ids), labels).backward()
    want = _grads(model)
    original = RouterAux.loss
    try:
        RouterAux.loss = lambda self, stats: original(self, stats.detach())  # type: ignore[method-assign]
        loss_fn(chain_stages([split.stages[0], split.stages[1]], ids), labels).backward()
        dropped = _grads(model)
        router = "model.layers.0.mlp.gate.weight"
        assert float((dropped[router] - want[router]).abs().max()) > 1e-3 * float(want[router].abs().max())
        check = verify.check_split(model, split_model)
        assert not check.ok and check.grad_rel > 1e-3, check
    finally:
        RouterAux.loss = original  # type: ignore[method-assign]


def test_the_proof_checks_the_aux_weight_against_the_model_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """JetMoE weighs its aux loss by ``aux_loss_coef``, not the ``router_aux_loss_coef`` others use: read
    from the wrong place, the weight would be wrong, and the proof (loss - cross entropy) says so."""
    from pp_offload.models import router_aux

    model = _model("jetmoe")  # router_aux_loss_coef=COEF is not JetMoE's: its aux_loss_coef is
    assert router_aux_of(model).coef == model.config.aux_loss_coef != COEF
    assert verify.check_split(model, split_model).ok
    monkeypatch.setattr(router_aux, "_coefficient", lambda m: m.config.router_aux_loss_coef)
    check = verify.check_split(model, split_model)
    assert not check.ok and "weighs its router aux loss by 0.01" in check.reason, check


def test_microbatched_aux_is_the_mean_over_microbatches_as_with_gradient_accumulation() -> None:
    """The loss per microbatch is transformers' per forward: equal to one process accumulating over the
    same microbatches, not to one forward of the whole batch (a product of means is not linear)."""
    model = _model()
    ids, labels = _batch(model, MICROBATCHES * ROWS)
    want_loss = _accumulated(model, ids, labels, MICROBATCHES)
    want = _grads(model)
    split = split_model(model, num_stages=2, stage_indices=[0, 1])
    loss_fn = TokenCrossEntropy(router_aux_weight=COEF / MICROBATCHES)
    loss_fn.num_target_tokens = labels.numel()
    total = 0.0
    for mb_ids, mb_labels in zip(
        ids.tensor_split(MICROBATCHES), labels.tensor_split(MICROBATCHES), strict=True
    ):
        loss = loss_fn(chain_stages([split.stages[0], split.stages[1]], mb_ids), mb_labels)
        loss.backward()
        total += float(loss.detach())
    assert total == pytest.approx(want_loss, rel=TIGHT)
    _assert_grads_close(_grads(model), want, TIGHT)
    with torch.no_grad():
        whole = float(model(input_ids=ids, use_cache=False).aux_loss)
        per_mb = [
            float(model(input_ids=mb, use_cache=False).aux_loss) for mb in ids.tensor_split(MICROBATCHES)
        ]
    assert whole != pytest.approx(sum(per_mb) / MICROBATCHES, rel=1e-6)  # the semantics differ, slightly


def test_activation_checkpointing_keeps_the_aux_gradient() -> None:
    """Recomputed layers record no router logits twice (the capture hooks exist only during forward)."""
    from pp_offload.parallel import activation_checkpointing

    model = _model()
    ids, labels = _batch(model, ROWS)
    split = split_model(model, num_stages=2, stage_indices=[0, 1])
    loss_fn = TokenCrossEntropy(router_aux_weight=COEF)
    loss_fn.num_target_tokens = labels.numel()
    want_loss = loss_fn(chain_stages([split.stages[0], split.stages[1]], ids), labels)
    want_loss.backward()
    want = _grads(model)
    assert activation_checkpointing(split) == model.config.num_hidden_layers
    loss = loss_fn(chain_stages([split.stages[0], split.stages[1]], ids), labels)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(want_loss.detach()), rel=TIGHT)
    _assert_grads_close(_grads(model), want, TIGHT)


def test_eval_mode_errors_and_refusals() -> None:
    model = _model()
    split = split_model(model, num_stages=2, stage_indices=[0, 1])
    ids, labels = _batch(model, 1)
    with pytest.raises(ValueError, match="needs the previous stage's router_stats"):
        split.stages[1](torch.zeros(1, SEQ, model.config.hidden_size))
    with pytest.raises(ValueError, match="padding attention_mask with the router aux loss"):
        split.stages[0](ids, attention_mask=torch.ones_like(ids))
    loss_fn = TokenCrossEntropy()
    loss_fn.num_target_tokens = labels.numel()
    with pytest.raises(RuntimeError, match="router_aux_weight is not set"):
        loss_fn(chain_stages([split.stages[0], split.stages[1]], ids), labels)
    for stage in split.stages.values():
        stage.eval()  # evaluation: the language-model loss only, plain logits
    logits, aux = chain_stages([split.stages[0], split.stages[1]], ids)
    assert aux is None and logits.shape == (1, SEQ, model.config.vocab_size)
    model.config.output_router_logits = False  # what the model's forward reads at call time
    assert router_aux_of(model) is None
    doge = tiny_model("doge", output_router_logits=True, router_aux_loss_coef=COEF)  # its own aux formula
    with pytest.raises(UnsupportedModelError, match="output_router_logits=True .*set config.output_router"):
        split_model(doge, num_stages=2, stage_indices=[0])
    assert "no router module found" in verify.check_split(doge, split_model).reason  # no raise: a reason


def _pipelined(rank: int, world: int, offloads: tuple[str | None, ...]) -> list[dict]:
    """V-Half, 4 stages (rank 0: 0 and 3, rank 1: 1 and 2), MICROBATCHES microbatches, each offload
    setting: the step's loss and this rank's gradients."""
    from torch.distributed.pipelining import PipelineStage

    from pp_offload import ScheduleVHalf

    results = []
    for offload in offloads:
        model = _model()
        ids, labels = _batch(model, MICROBATCHES * ROWS)
        mine = [rank, 3 - rank]
        split = split_model(model, num_stages=4, stage_indices=mine)
        stages = [PipelineStage(split.stages[s], s, 4, torch.device("cpu")) for s in mine]
        loss_fn = TokenCrossEntropy(router_aux_weight=split.router_aux.coef / MICROBATCHES)
        loss_fn.num_target_tokens = labels.numel()
        schedule = ScheduleVHalf(stages, MICROBATCHES, loss_fn=loss_fn, scale_grads=False, offload=offload)
        losses: list[torch.Tensor] = []
        aux: list[float] = []
        if rank == 0:  # stage 0 and the last stage; outputs: the logits and one aux loss per microbatch
            outputs = schedule.step(ids, target=labels, losses=losses)
            aux = [float(a) for a in outputs[1].detach()]
        else:
            schedule.step()
        grads = {n: p.grad.clone() for n, p in split.module.named_parameters() if p.grad is not None}
        results.append({"loss": float(sum(float(t) for t in losses)), "aux": aux, "grads": grads})
    return results


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_v_half_on_two_ranks_equals_one_process() -> None:
    offloads = (None, "full")
    results = run_on_ranks(_pipelined, 2, offloads, timeout=120)
    model = _model()
    ids, labels = _batch(model, MICROBATCHES * ROWS)
    want_loss = _accumulated(model, ids, labels, MICROBATCHES)
    want = _grads(model)
    with torch.no_grad():
        want_aux = [
            float(model(input_ids=mb, use_cache=False).aux_loss) for mb in ids.tensor_split(MICROBATCHES)
        ]
    for i, offload in enumerate(offloads):
        assert results[0][i]["aux"] == pytest.approx(want_aux, rel=TIGHT), offload
        got = {**results[1][i]["grads"], **results[0][i]["grads"]}
        assert results[0][i]["loss"] == pytest.approx(want_loss, rel=TIGHT), offload
        _assert_grads_close(got, want, TIGHT)


def _pp_x_fsdp(rank: int, world: int) -> dict:
    """pp 2 x dp 2: each replica runs V-Half on its half of the batch (MICROBATCHES microbatches), the
    stages sharded with FSDP2; the aux weight counts the microbatches of both replicas."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor

    from pp_offload import ScheduleVHalf
    from pp_offload.parallel import apply_fsdp, build_mesh, dp_rank, pp_rank

    mesh = build_mesh(2, 2, device_type="cpu")
    model = _model()
    ids, labels = _batch(model, 2 * MICROBATCHES * ROWS)
    half = slice(dp_rank(mesh) * MICROBATCHES * ROWS, (dp_rank(mesh) + 1) * MICROBATCHES * ROWS)
    mine = [pp_rank(mesh), 3 - pp_rank(mesh)]
    split = split_model(model, num_stages=4, stage_indices=mine)
    sharded = apply_fsdp(split, mesh, split_backward=True)
    group = mesh["pp"].get_group()
    stages = [PipelineStage(sharded.modules[s], s, 4, torch.device("cpu"), group=group) for s in mine]
    loss_fn = TokenCrossEntropy(router_aux_weight=split.router_aux.coef / (MICROBATCHES * 2))
    loss_fn.num_target_tokens = labels.numel()
    schedule = ScheduleVHalf(stages, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
    sharded.attach(schedule)
    losses: list[torch.Tensor] = []
    if pp_rank(mesh) == 0:
        schedule.step(ids[half], target=labels[half], losses=losses, return_outputs=False)
    else:
        schedule.step(return_outputs=False)
    grads = {}
    for name, p in split.module.named_parameters():
        if p.grad is not None:
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
    return {"loss": float(sum(float(t) for t in losses)), "grads": grads}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pp_x_fsdp_equals_one_process_over_all_replicas_microbatches() -> None:
    results = run_on_ranks(_pp_x_fsdp, 4, timeout=180)
    model = _model()
    ids, labels = _batch(model, 2 * MICROBATCHES * ROWS)
    want_loss = _accumulated(model, ids, labels, 2 * MICROBATCHES)  # both replicas' microbatches, in order
    want = _grads(model)
    pp0 = [r for r in results if r["loss"]]  # the two ranks holding stage 0 and the last stage
    assert len(pp0) == 2 and sum(r["loss"] for r in pp0) == pytest.approx(want_loss, rel=TIGHT)
    for r in results:
        _assert_grads_close(r["grads"], {n: want[n] for n in r["grads"]}, TIGHT)
    assert set().union(*(r["grads"] for r in results)) == set(want)
