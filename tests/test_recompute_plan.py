"""Activation recompute in the planner (offline): the kept-bytes formulas against the hook measurement of
bench/bench_recompute.py, the time model, the budget's slowdown limit with per-stage costs, and that the
planner and `choose` pick recompute only where it wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_plan import SMALL_LLAMA

from pp_offload.order import Costs, v_half_order, v_zb_order
from pp_offload.order.offload import plan_offload
from pp_offload.plan import plan
from pp_offload.plan.auto import (
    DEFAULT_RECOMPUTE,
    Measurement,
    RecomputeOption,
    choose,
    recompute_options,
)
from pp_offload.plan.costs import layer_flops, recompute_seconds, stage_times
from pp_offload.plan.machines import A100, GH200, H100, H200, resolve_machine
from pp_offload.plan.memory import (
    RECOMPUTE,
    chunk_activation,
    layer_activation_bytes,
    layer_recompute_traffic,
)
from pp_offload.plan.model import model_spec
from pp_offload.plan.shapes import SHAPES
from pp_offload.sim import as_executed_by_torch, simulate

MEASURED = Path(__file__).resolve().parents[1] / "bench" / "results" / "recompute.json"
LLAMA_8B = SHAPES["llama-3-8b"]


def _bench_specs(data: dict) -> dict:
    """The layers bench/bench_recompute.py measured, as planner specs (its module constants)."""
    h, i = data["hidden"], data["intermediate"]
    llama = {"hidden_size": h, "intermediate_size": i, "num_attention_heads": 8, "num_key_value_heads": 2}
    return {
        "llama": model_spec({"model_type": "llama", "num_hidden_layers": 1, "vocab_size": 256, **llama}),
        "gpt2": model_spec(
            {
                "model_type": "gpt2",
                "n_embd": h,
                "n_inner": 4 * h,
                "n_head": 8,
                "n_layer": 1,
                "vocab_size": 256,
            }
        ),
    }


def test_layer_formulas_equal_the_bytes_the_store_moved_per_layer():
    """bench_recompute.py runs real HF layers under the activation store (bf16, sdpa) and records the bytes
    of a middle layer's store entry, i.e. what an offload of that layer moves: plain, with selective
    recompute (the runtime's `pp_offload.runtime.recompute`: matmul and attention outputs kept, the layer's
    trailing projection not), and with full checkpointing (the layer input). The planner's formulas must
    give exactly those bytes; the plain Llama entry also holds the rotary cos/sin, which the planner counts
    once per stage (`chunk_activation`), not per layer."""
    data = json.loads(MEASURED.read_text())
    seq, a = data["seq"], 2  # bf16
    for name, spec in _bench_specs(data).items():
        moved = data["results"][name]["layer_entry_bytes"]
        kw = {"microbatch_size": 1, "seq_len": seq}
        for mode in ("selective", "full"):
            assert layer_activation_bytes(spec, "bf16", recompute=mode, **kw) == moved[mode], (name, mode)
        rotary = 2 * a * seq * spec.head_dim if name == "llama" else 0
        assert layer_activation_bytes(spec, "bf16", recompute="none", **kw) + rotary == moved["plain"], name
        assert layer_activation_bytes(spec, "bf16", recompute="full", count_input=False, **kw) == 0


def test_recompute_bytes_shrink_and_stage_accounting_is_consistent():
    for config in (
        LLAMA_8B,
        SMALL_LLAMA,
        {"model_type": "gpt2", "n_embd": 256, "n_head": 4, "n_layer": 4, "vocab_size": 300},
    ):
        spec = model_spec(config)
        for dtype in ("bf16", "fp32"):
            kw = {"microbatch_size": 2, "seq_len": 512}
            b = {r: layer_activation_bytes(spec, dtype, recompute=r, **kw) for r in RECOMPUTE}
            assert 0 < b["full"] < b["selective"] < b["none"]
            for first in (False, True):
                for last in (False, True):
                    st = {
                        r: chunk_activation(spec, dtype, layers=3, first=first, last=last, recompute=r, **kw)
                        for r in RECOMPUTE
                    }
                    # only the layers' saved bytes change: outputs and the loss stay
                    assert st["full"].saved < st["selective"].saved < st["none"].saved
                    assert st["full"].resident == st["none"].resident
                    # two layers inside the stage keep exactly the per-layer formula
                    two = chunk_activation(
                        spec, dtype, layers=5, first=first, last=last, recompute="selective", **kw
                    )
                    assert two.saved - st["selective"].saved == 2 * b["selective"]
    with pytest.raises(ValueError, match="unknown recompute mode 'partial'"):
        spec = model_spec(SMALL_LLAMA)
        layer_activation_bytes(spec, "bf16", microbatch_size=1, seq_len=8, recompute="partial")


def test_recompute_traffic_hand_computed_and_timed_over_hbm():
    spec = model_spec(SMALL_LLAMA)  # h 1024, q 1024, kv 512, i 2816
    n, a = 64, 2
    norm = (2 * (a + 4) + 8 + 4 + 8 + 2 * a) * 1024  # casts, pow, mean, rsqrt-mul, weight-mul
    per_token = 2 * norm + 10 * a * (1024 + 512) + 3 * a * 1024 + 5 * a * 2816
    assert layer_recompute_traffic(spec, "bf16", microbatch_size=1, seq_len=n) == n * per_token
    # fp32: no casts
    assert layer_recompute_traffic(spec, "fp32", microbatch_size=1, seq_len=n) == n * (
        2 * (8 + 4 + 8 + 8) * 1024 + 40 * 1536 + 12 * 1024 + 20 * 2816
    )
    kw = {"microbatch_size": 1, "seq_len": 4096}
    big = model_spec(LLAMA_8B)
    assert recompute_seconds(big, H100, "bf16", recompute="none", **kw) == 0
    sel = recompute_seconds(big, H100, "bf16", recompute="selective", **kw)
    assert sel == pytest.approx(layer_recompute_traffic(big, "bf16", **kw) / 3.35e12)
    assert recompute_seconds(big, A100, "bf16", recompute="selective", **kw) == pytest.approx(
        sel * 3.35 / 2.0
    )
    full = recompute_seconds(big, H100, "bf16", recompute="full", **kw)
    assert full == pytest.approx(layer_flops(big, seq_len=4096).F * 4096 / H100.flops_for("bf16"))
    assert 0 < sel < full
    # F unchanged; I grows by one recompute of the stage's layers, W by none (deferred W: W runs only the
    # queued weight-gradient GEMMs)
    plain = stage_times(big, H100, "bf16", layers=4, first=False, last=False, **kw)
    for mode, extra in (("selective", sel), ("full", full)):
        t = stage_times(big, H100, "bf16", layers=4, first=False, last=False, recompute=mode, **kw)
        assert t.F == plain.F
        assert t.I == pytest.approx(plain.I + 4 * extra) and t.W == pytest.approx(plain.W)


def test_hbm_bandwidth_presets_and_override():
    assert (A100.hbm_bandwidth, H100.hbm_bandwidth, H200.hbm_bandwidth, GH200.hbm_bandwidth) == (
        2.0e12,
        3.35e12,
        4.8e12,
        4.0e12,
    )
    assert resolve_machine("H100", hbm_bandwidth=1e12).hbm_bandwidth == 1e12
    with pytest.raises(ValueError, match="hbm_bandwidth"):
        resolve_machine("H100", hbm_bandwidth=0)


@pytest.mark.parametrize("build", [v_half_order, v_zb_order])
@pytest.mark.parametrize("policy,limit", [("budget", 0.03), ("budget:auto:0.1", 0.10)])
def test_budget_lands_within_its_slowdown_with_imbalanced_stages(build, policy, limit):
    """Placed with the per-stage costs it is timed with, a budget never exceeds its own limit (it overshot
    by up to 1.5 points at 3% and 4.5 points at 10% when placed with the scalar costs)."""
    d, m = 4, 8
    order = as_executed_by_torch(build(d, m))
    for transfer in (0.5, 4.0):
        stages = [(1.0 + 0.1 * s, 1.1 + 0.05 * s, 0.9) for s in range(2 * d)]
        stages[-1] = (1.6, 1.7, 1.2)  # the head
        costs = Costs(F=1.0, I=1.1, W=0.9, comm=0.05, transfer=transfer, stages=tuple(stages))
        base = simulate(order, costs)
        planned = plan_offload(order, costs, policy, layers=4)
        assert planned.sim.makespan <= base.makespan * (1 + limit) + 1e-9
        assert planned.replay(costs).makespan == pytest.approx(planned.sim.makespan)


def _plan(**kw):
    return plan(
        SMALL_LLAMA,
        seq_len=512,
        microbatch_size=1,
        num_microbatches=8,
        pp=4,
        machine="A100",
        reserve_gib=0.0,
        jobs=1,
        schedules=("ScheduleVHalf", "ScheduleVZB"),
        offload=("none", "budget"),
        **kw,
    )


def test_planner_picks_recompute_only_where_it_wins_and_never_a_useless_candidate():
    roomy = _plan(gpu_memory_gib=8.0)
    assert roomy.recompute == "none" and roomy.recommended.offload == "none"
    # recompute candidates of schedules that fit without it are not replayed (never faster)
    assert all(c.skipped for c in roomy.candidates if c.recompute != "none")
    every = _plan(gpu_memory_gib=8.0, evaluate_dominated=True)
    plain = every.candidate("ScheduleVHalf")
    for mode in ("selective", "full"):
        c = every.candidate("ScheduleVHalf", "none", mode)
        assert c.step_time > plain.step_time and c.activation_peak < plain.activation_peak
        assert c.useless is None and mode in c.label
    assert (
        every.candidate("ScheduleVHalf", "none", "selective").step_time
        < every.candidate("ScheduleVHalf", "none", "full").step_time
    )
    # a memory limit just above the lowest peak: only recompute makes a schedule fit, and the lowest-peak
    # plans are those picked. (Under deferred W the queue of every linear's input and output gradient lives
    # from I to W whatever the plan, so full recompute no longer has the lowest peak here: selective's,
    # which runs faster, is as low; `pp_offload.plan.memory.queued_bytes`.)
    peaks = sorted({c.peak_bytes for c in every.candidates if c.evaluated})
    limit = (peaks[0] + 0.5 * (peaks[1] - peaks[0])) / (1 << 30)
    lowest = {c.label for c in every.candidates if c.evaluated and c.peak_bytes == peaks[0]}
    tight = _plan(gpu_memory_gib=limit, evaluate_dominated=True)
    best = tight.recommended
    assert best.fits and best.recompute != "none" and best.label in lowest
    assert tight.recompute == best.recompute and f"{best.recompute} recompute" in tight.table()
    for c in tight.candidates:
        assert c.useless is None or c is not best
        if c.useless and c.recompute != "none" and c.offload == "none":
            assert c.activation_peak >= tight.candidate(c.schedule).activation_peak
    assert tight.to_dict()["recompute"] == best.recompute


def test_choose_considers_recompute_options():
    measured = Measurement.uniform(
        4, F=0.010, I=0.012, W=0.008, saved_bytes=64 << 20, offload=0.006, layers=4
    )
    selective = RecomputeOption("selective", kept_share=0.45, forward_share=0.2)
    full = RecomputeOption("full", kept_share=0.05, forward_share=1.0)
    kw = {"num_microbatches": 8, "schedules": ["ScheduleVHalf"], "offload": ["none"]}
    # no budget: the fastest, without recompute
    assert choose(measured, **kw, recompute=[selective, full]).recompute == "none"
    # a budget below the plain candidate but above selective recompute's peak: recompute is chosen
    budget = int(0.8 * max(choose(measured, **kw).peak_bytes))
    decision = choose(measured, **kw, activation_budget_bytes=budget, recompute=[selective, full])
    assert decision.recompute == "selective" and max(decision.peak_bytes) <= budget
    # per stage F, I, W (ms) with the recompute: I + 4 layers x 2.5 ms x 0.2 on every stage, W unchanged
    # (deferred W recomputes nothing, so a full backward B shares nothing with I + W: no 4th entry)
    assert len(decision.stage_costs) == 8
    assert decision.stage_costs[1] == pytest.approx([10.0, 14.0, 8.0])
    assert decision.stage_costs[0] == pytest.approx([10.0, 14.0, 8.0])
    assert "selective" in decision.table() and decision.to_dict()["recompute"] == "selective"
    applied = selective.apply(measured)
    st, base = applied.stages[1], measured.stages[1]
    assert st.F == base.F and st.I == pytest.approx(base.I + 4 * (0.010 / 4) * 0.2)
    assert st.saved_bytes == round(base.saved_bytes * 0.45)
    assert applied.stages[0].I == st.I  # deferred W: stage 0's I is a real backward too
    options = {o.label: o for o in recompute_options(LLAMA_8B, seq_len=4096)}
    assert list(options) == list(DEFAULT_RECOMPUTE)
    assert DEFAULT_RECOMPUTE[0] == "mlp"
    # no +once by default: under deferred W it prices as the plan without it (asked for, it is offered)
    assert DEFAULT_RECOMPUTE[-2:] == ("selective", "full")
    assert not any("+once" in plan for plan in DEFAULT_RECOMPUTE)
    once_plans = ["selective+once", "full+once"]
    asked = {o.label: o for o in recompute_options(LLAMA_8B, seq_len=4096, modes=once_plans)}
    for mode in ("selective", "full"):  # the same shares; only the rule (W recomputes nothing) differs
        once, per_pass = asked[f"{mode}+once"], options[mode]
        assert once.once and not per_pass.once
        assert (once.kept_share, once.forward_share) == (per_pass.kept_share, per_pass.forward_share)
    sel, mlp = options["selective"], options["mlp"]
    assert all(options[k].kept_share == sel.kept_share for k in ("selective:0.5", "selective:0.75"))
    assert 0.4 < sel.kept_share < 0.5 and options["full"].forward_share == pytest.approx(1.0)
    # mlp: about 70% of the bytes stay, for a quarter of selective's recompute time
    assert 0.65 < mlp.kept_share < 0.75
    assert mlp.forward_share == pytest.approx(sel.forward_share * 143360 / 565248)
    # two modes: selective on the share, the MLP-only recompute's figures on the other layers
    mixed = options["selective:0.75,mlp"]
    assert (mixed.kept_share, mixed.forward_share) == (sel.kept_share, sel.forward_share)
    assert (mixed.rest, mixed.rest_kept_share, mixed.rest_forward_share) == (
        "mlp",
        mlp.kept_share,
        mlp.forward_share,
    )
    # a share: only the first ceil(share x 4) = 2 layers of each stage lose bytes and gain recompute time
    half = RecomputeOption("selective", kept_share=0.45, forward_share=0.2, share=0.5).apply(measured)
    assert half.stages[1].saved_bytes == round(base.saved_bytes - 2 * (base.saved_bytes / 4) * 0.55)
    assert half.stages[1].I == pytest.approx(base.I + 2 * (0.010 / 4) * 0.2)
    share = choose(
        measured,
        **kw,
        activation_budget_bytes=budget,
        recompute=[RecomputeOption("selective", 0.45, 0.2, 0.75)],
    )
    assert share.recompute == "selective:0.75"
    with pytest.raises(ValueError, match="layer count"):
        selective.apply(Measurement.uniform(4, F=1, I=1, W=1, saved_bytes=10))


def test_recompute_plan_strings_and_layer_counts():
    from pp_offload.recompute_plan import RecomputePlan, parse_recompute

    assert parse_recompute("selective:0.75") == RecomputePlan("selective", 0.75)
    assert parse_recompute(" Full:0.5 ").label == "full:0.5"
    assert parse_recompute("selective:1").label == "selective"  # every layer: the plain mode
    # the first ceil(share x n) layers of a stage, earliest first
    plan = parse_recompute("selective:0.75")
    assert [plan.count(n) for n in (0, 1, 2, 3, 4, 8)] == [0, 1, 2, 3, 3, 6]
    assert plan.modes(4) == ["selective"] * 3 + ["none"]
    assert parse_recompute("none").count(4) == 0
    # another mode on the other layers
    mixed = parse_recompute("Selective:0.5, MLP")
    assert mixed == RecomputePlan("selective", 0.5, "mlp") and mixed.label == "selective:0.5,mlp"
    assert mixed.modes(3) == ["selective", "selective", "mlp"] and not mixed.uniform
    bad_plans = ("selective:1,mlp", "mlp:0.5,mlp", "selective:0.5,partial", "none,mlp")
    for bad in ("selective:0", "selective:1.5", "none:0.5", "selective:x", "partial:0.5", *bad_plans):
        with pytest.raises(ValueError):
            parse_recompute(bad)


def _stage_capture(plan: str, *, per_layer: bool) -> dict:
    """A tiny HF Llama stage (4 decoder layers, bf16, sdpa) under ``plan`` run through the activation store
    as the runtime captures it: the layers as one chunk, or (``per_layer``) each layer its own entry as
    budget offload captures it; the stage input is the pipeline's (kept in place)."""
    import contextlib

    import torch
    from transformers import AutoModel, LlamaConfig

    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime.store import ActivationStore

    config = LlamaConfig(**TINY_STAGE, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModel.from_config(config).to(torch.bfloat16).train()
    layers = list(model.layers)
    if plan != "none":
        activation_checkpointing({0: model}, layers=lambda _: layers, mode=plan)
    x = torch.randn(1, TINY_SEQ, TINY_STAGE["hidden_size"]).to(torch.bfloat16).requires_grad_(True)
    store, stack = ActivationStore("cpu"), contextlib.ExitStack()

    def pre(i: int) -> None:
        if per_layer or i == 0:
            stack.enter_context(store.capture(i if per_layer else "chunk", keep=[x]))

    def post(i: int) -> None:
        if per_layer or i == len(layers) - 1:
            stack.close()

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: pre(i))
        layer.register_forward_hook(lambda m, a, o, i=i: post(i))
    model(inputs_embeds=x, use_cache=False)
    return {k: s.captured_bytes for k, s in store.stats().chunks.items()}


TINY_STAGE = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 64,
}
TINY_SEQ = 96  # every activation above the store's 1024-element floor except rsqrt and the log-sum-exp


@pytest.mark.parametrize(
    "plan",
    [
        "none",
        "selective:0.25",
        "selective:0.5",
        "selective:0.75",
        "selective",
        "full:0.5",
        "full",
        "mlp",
        "mlp:0.5",
        "selective:0.5,mlp",
        "full:0.25,selective",
    ],
)
def test_planner_bytes_of_a_mixed_plan_equal_what_the_store_captures(plan):
    """A middle stage (the first layer reads the receive buffer) under a recompute plan on a share of its
    layers: the planner's saved bytes equal the store's capture of the stage's chunk exactly, and its
    per-layer bytes (what budget offload moves, earliest layer first) each layer's own store entry, except
    that a layer keeping everything captured on its own also holds the stage's rotary cos/sin (the planner
    counts them once per stage)."""
    from pp_offload.plan.memory import layers_activation_bytes
    from pp_offload.recompute_plan import parse_recompute

    spec = model_spec({"model_type": "llama", **TINY_STAGE})
    kw = {"microbatch_size": 1, "seq_len": TINY_SEQ, "recompute": plan}
    chunk = chunk_activation(spec, "bf16", layers=4, first=False, last=False, **kw)
    assert _stage_capture(plan, per_layer=False)["chunk"] == chunk.saved
    rotary = 2 * 2 * TINY_SEQ * spec.head_dim
    entries = _stage_capture(plan, per_layer=True)
    modes = parse_recompute(plan).modes(4)
    got = [entries[i] - (rotary if mode in ("none", "mlp") else 0) for i, mode in enumerate(modes)]
    assert got == layers_activation_bytes(spec, "bf16", layers=4, first=False, **kw)
    if ":" in plan:  # a share: the recomputed layers are the earliest
        plan_ = parse_recompute(plan)
        assert modes[0] == plan_.mode and modes[-1] == plan_.rest


def test_planner_orders_recompute_shares_between_none_and_every_layer():
    """A share of the layers costs part of the recompute time for part of the bytes: its step time and its
    peak lie between no recompute and recomputing every layer, growing with the share; the default plans
    include shares, and the candidates are ranked by mode, then share."""
    every = _plan(
        gpu_memory_gib=8.0, evaluate_dominated=True, recompute=["selective:0.5", "none", "selective"]
    )
    assert every.settings["recompute"] == ["none", "selective:0.5", "selective"]
    plain, half, sel = (
        every.candidate("ScheduleVHalf", "none", r) for r in ("none", "selective:0.5", "selective")
    )
    assert plain.step_time < half.step_time < sel.step_time
    assert plain.activation_peak > half.activation_peak > sel.activation_peak
    assert "selective:0.5 recompute" in half.label and half.useless is None
    with pytest.raises(ValueError, match="share"):
        _plan(gpu_memory_gib=8.0, recompute=["selective:2"])
    from pp_offload.plan.planner import DEFAULT_RECOMPUTE

    assert "selective:0.75,mlp" in DEFAULT_RECOMPUTE


QWEN3 = {  # q/k norms: a group of their own inside the norms
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 64,
}


@pytest.mark.parametrize("config", [LLAMA_8B, SMALL_LLAMA, QWEN3])
def test_recompute_groups_add_up_to_selective_and_rank_the_mlp_first(config):
    """The per-group split of selective recompute is the planner's own model: freed bytes add up to a
    plain layer minus a selective one, traffic to the selective traffic; the MLP group (what mode ``mlp``
    recomputes) frees the most per byte of traffic, rotary frees nothing; ``mlp`` keeps exactly a plain
    layer minus the MLP group and costs the MLP group's traffic."""
    from pp_offload.plan.recompute_groups import recompute_groups

    spec = model_spec(config)
    for dtype in ("bf16", "fp32"):
        kw = {"microbatch_size": 2, "seq_len": 1024}
        groups = recompute_groups(spec, dtype, **kw)
        plain = layer_activation_bytes(spec, dtype, **kw)
        selective = layer_activation_bytes(spec, dtype, recompute="selective", **kw)
        assert sum(g.freed for g in groups) == plain - selective
        assert sum(g.traffic for g in groups) == layer_recompute_traffic(spec, dtype, **kw)
        mlp, norms, rotary = groups
        assert mlp.freed_per_traffic > norms.freed_per_traffic > rotary.freed_per_traffic == 0
        assert layer_activation_bytes(spec, dtype, recompute="mlp", **kw) == plain - mlp.freed
        assert layer_recompute_traffic(spec, dtype, mode="mlp", **kw) == mlp.traffic
    with pytest.raises(ValueError, match="Llama-family"):
        gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 64}
        recompute_groups(model_spec(gpt2), "bf16", **kw)
