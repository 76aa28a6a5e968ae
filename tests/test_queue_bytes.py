"""The deferred-W queue in the memory model: `pp_offload.plan.memory.queued_bytes` against the queue a real
input-gradient pass leaves (tiny HF Llama, Qwen2, GPT-2, LoRA), and the I-to-W accounting of the byte peaks
(`pp_offload.order.offload_inputs.activation_peaks`) that the planner, ``schedule: auto`` and budget offload
share."""

from __future__ import annotations

import types

import pytest
import torch

from pp_offload.order.actions import F as FWD
from pp_offload.order.actions import I, W
from pp_offload.order.offload_inputs import OffloadInputs, StageBytes, activation_level, activation_peaks
from pp_offload.plan.memory import chunk_activation, queued_bytes
from pp_offload.plan.model import model_spec
from pp_offload.sim import SimResult

QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "vocab_size": 300,
}
STAGES = [(True, False), (False, False), (False, True)]  # (first, last): first, middle, last stage


@pytest.mark.parametrize(
    "name,dtype,lora",
    [
        ("llama-h128-gqa", "fp32", 0),
        ("llama-h64-mha", "bf16", 0),
        ("qwen2", "fp32", 0),
        ("gpt2-h64", "fp32", 0),
        ("llama-h128-gqa", "fp32", 8),
        ("gpt2-h64", "fp32", 4),
    ],
)
def test_queued_bytes_equal_the_queue_a_real_input_gradient_pass_leaves(name, dtype, lora) -> None:
    """Exact: every stage's queue (each distinct storage once, the stage output's gradient, a receive
    buffer, left out) is the formula's bytes, with and without LoRA, in fp32 and bf16."""
    pytest.importorskip("transformers")
    from pp_offload.plan.validate import TINY_CONFIGS, measure_queue

    config = QWEN2 if name == "qwen2" else TINY_CONFIGS[name]
    for first, last in STAGES:
        row = measure_queue(
            name,
            config,
            layers=2,
            first=first,
            last=last,
            microbatch_size=2,
            seq_len=48,
            dtype=dtype,
            lora_rank=lora,
        )
        assert row.measured > 0 and row.measured == row.estimated, row
    head_only = measure_queue(name, config, layers=0, first=False, last=True, microbatch_size=1, seq_len=40)
    assert head_only.measured == head_only.estimated > 0


def _llama_spec():
    from pp_offload.plan.validate import TINY_CONFIGS

    return model_spec(dict(TINY_CONFIGS["llama-h128-gqa"]))


def test_chunk_activation_queues_under_deferred_w_only() -> None:
    spec = _llama_spec()
    kw = {"layers": 2, "first": False, "last": False, "microbatch_size": 2, "seq_len": 64}
    deferred = chunk_activation(spec, "bf16", **kw)
    split = chunk_activation(spec, "bf16", **kw, deferred_w=False)
    assert deferred.queued == queued_bytes(
        spec, "bf16", layers=2, first=False, last=False, microbatch_size=2, seq_len=64
    )
    assert split.queued is None and split.saved == deferred.saved
    # the queue does not depend on recompute: a recomputed layer queues tensors of the same sizes
    assert chunk_activation(spec, "bf16", **kw, recompute="full").queued == deferred.queued
    # Llama per layer and token: X 2h + q + i, dY q + 2k + 2h + 2i; the stage output's gradient left out
    h, q, k, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    assert deferred.queued == 2 * 128 * (2 * (2 * h + q + i + q + 2 * k + 2 * h + 2 * i) - h)


def _one_stage(order: list[tuple[str, int]]) -> SimResult:
    """Stage 0's passes back to back, one time unit each."""
    timeline = {0: [((0, kind, mb), t, t + 1) for t, (kind, mb) in enumerate(order)]}
    return SimResult(
        float(len(order)), {0: float(len(order))}, {0: 0.0}, timeline, {0: []}, {0: []}, {0: 0.0}
    )


def test_peaks_hold_saved_to_w_under_torchs_split_and_the_queue_under_deferred_w() -> None:
    """F F I I W W on one stage. torch's split: both chunks' saved bytes until their W (``resident`` leaves
    at I). Deferred W: each chunk's I frees saved and resident and holds the queue until its W."""
    sim = _one_stage([(FWD, 0), (FWD, 1), (I, 0), (I, 1), (W, 0), (W, 1)])
    split = StageBytes(saved=100, resident=10)
    assert activation_peaks(sim, [split]) == [220]
    # a small queue: the peak is at the second F, as before; after the Is only the queues are held
    assert activation_peaks(sim, [StageBytes(saved=100, resident=10, queued=30)]) == [220]
    # a queue larger than what I frees: first chunk's queue plus the second's whole chunk, then two queues
    assert activation_peaks(sim, [StageBytes(saved=100, resident=10, queued=150)]) == [300]
    # +once's bytes are torch's-split-only: deferred W's I keeps none of them for W
    assert activation_peaks(sim, [StageBytes(saved=100, held_after_input=30, queued=0)]) == [200]
    # W right after I: a queue lives only during its own gap
    sim = _one_stage([(FWD, 0), (I, 0), (W, 0), (FWD, 1), (I, 1), (W, 1)])
    assert activation_peaks(sim, [StageBytes(saved=100, queued=150)]) == [150]
    assert activation_peaks(sim, [StageBytes(saved=100)]) == [100]


def test_copies_after_a_deferred_input_pass_move_nothing() -> None:
    """The runtime releases a deferred-W chunk when its I ends, so an OFFLOAD/RELOAD the plan placed between
    its I and W (for torch's split, where W reads the saved tensors again) lowers nothing; under torch's
    split the same copy takes the chunk's saved bytes off the device."""
    sim = _one_stage([(FWD, 0), (FWD, 1), (I, 0), (I, 1), (W, 0), (W, 1)])
    copy = {"stage_index": 0, "microbatch_index": 0}
    sim.transfers[0] = [
        (types.SimpleNamespace(computation_type="OFFLOAD", **copy), 3.0, 3.5),
        (types.SimpleNamespace(computation_type="RELOAD", **copy), 3.6, 4.0),
    ]
    deferred = StageBytes(saved=100, queued=150)
    plain = _one_stage([(FWD, 0), (FWD, 1), (I, 0), (I, 1), (W, 0), (W, 1)])
    assert activation_peaks(sim, [deferred]) == activation_peaks(plain, [deferred]) == [300]
    # torch's split: chunk 0 is off the device from 3.5 to 3.6; the peak (both chunks, 200) is before
    assert activation_peaks(sim, [StageBytes(saved=100)]) == [200]
    sim.transfers[0] = [
        (types.SimpleNamespace(computation_type="OFFLOAD", **copy), 1.0, 1.5),
        (types.SimpleNamespace(computation_type="RELOAD", **copy), 1.6, 2.0),
    ]
    assert activation_level(sim, [deferred], 0, 1.55) == (100, 200)  # a copy before I still counts


def test_offload_inputs_carry_the_queue() -> None:
    from pp_offload.order.actions import Costs

    inputs = OffloadInputs(
        Costs(),
        (1, 1),
        (0.1, 0.1),
        (StageBytes(8, queued=5), StageBytes(9, held_after_input=2)),
    )
    back = OffloadInputs.from_dict(inputs.to_dict())
    assert back.stage_bytes == inputs.stage_bytes
    with pytest.raises(ValueError, match=r"StageBytes.queued must be an int >= 0"):
        StageBytes(1, queued=-1)


def test_planner_setup_counts_the_queue_of_every_stage() -> None:
    """`setup_schedule` (the planner, `pp-offload plan`) hands each stage's queue to the byte peaks; with
    ``deferred_w=False`` it models torch's split as before."""
    from pp_offload.plan.handoff import planner_setup

    kw = {"schedule": "ScheduleVHalf", "pp": 2, "seq_len": 256, "microbatch_size": 1, "num_microbatches": 4}
    setup = planner_setup("llama-3.2-1b", **kw)
    queued = [b.queued for b in setup.offload_inputs().stage_bytes]
    spec = model_spec("llama-3.2-1b")
    expected = [
        queued_bytes(
            spec, "bf16", layers=st.layers, first=st.first, last=st.last, microbatch_size=1, seq_len=256
        )
        for st in setup.stages
    ]
    assert queued == expected and all(q > 0 for q in queued[1:])


def test_stage_builder_measures_what_the_model_predicts() -> None:
    """The probe's measurement (`_Builder.measure`): the bytes one microbatch's I queued, the stage output's
    gradient left out, as `queued_bytes` predicts, through the stage's own backward hook."""
    pytest.importorskip("transformers")
    from pp_offload.plan.validate import TINY_CONFIGS, _build, _stage_fn
    from pp_offload.runtime import deferred_w

    config = TINY_CONFIGS["llama-h64-mha"]
    hf_config, model = _build(config, "fp32")
    spec = model_spec(hf_config)

    def backward(kind, bwd_kwargs, last_backward=False):
        torch.autograd.backward([bwd_kwargs["stage_output"]], list(bwd_kwargs["output_grads"]))
        return (), None

    stage = types.SimpleNamespace(submod=model, backward_maybe_with_nosync=backward)
    deferred_w.defer_weight_grads([stage])
    hidden = torch.randn(1, 32, spec.hidden_size, requires_grad=True)
    ids = torch.zeros(1, 32, dtype=torch.long)
    output = _stage_fn(model, layers=2, first=False, last=False, ids=ids, hidden=hidden)()
    stage.dw_builder.measure = True
    grads = (torch.randn_like(output),)
    stage.backward_maybe_with_nosync("full", {"stage_output": output, "output_grads": grads})
    run_w = stage.dw_builder()
    run_w()
    assert stage.dw_builder.queued == queued_bytes(
        spec, "fp32", layers=2, first=False, last=False, microbatch_size=1, seq_len=32
    )
    assert all(p.grad is not None for p in model.model.layers[0].parameters())


def test_a_compiled_backward_queues_one_copy_of_each_shared_input() -> None:
    """Under compile the queue keeps copies (inductor reuses buffers); q/k/v and gate/up read one input
    each, and they share one copy of it: the queue's bytes equal eager's (the memory model's), and the
    gradients equal eager's. ``aot_eager`` traces the backward as inductor's does (the sharing is decided
    while tracing) in seconds."""
    pytest.importorskip("transformers")
    from pp_offload.plan.validate import TINY_CONFIGS, _build, _stage_fn
    from pp_offload.runtime import deferred_w
    from pp_offload.runtime.compile import CompileOptions, compile_layers

    config = TINY_CONFIGS["llama-h64-mha"]
    queues, grads = [], []
    for compiled in (False, True):
        hf_config, model = _build(config, "fp32")
        deferred_w.defer_weight_grads([types.SimpleNamespace(submod=model, backward_maybe_with_nosync=None)])
        if compiled:
            compile_layers([model.model], CompileOptions(backend="aot_eager"))
        hidden = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        ids = torch.zeros(2, 32, dtype=torch.long)
        output = _stage_fn(model, layers=2, first=False, last=False, ids=ids, hidden=hidden)()
        grad = torch.ones_like(output)
        with deferred_w.collecting():
            output.backward(grad)
        entries = list(deferred_w._QUEUE)
        storages = deferred_w.queued_storages()
        storages.pop((grad.device, grad.untyped_storage().data_ptr()), None)
        queues.append((len(entries), sum(storages.values())))
        deferred_w.apply_queued_weight_grads(model.parameters())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if compiled:  # shared inputs were copied once: per layer q/k/v's, o's, gate/up's, down's
            assert len({x.untyped_storage().data_ptr() for _, x, _, _ in entries}) == 2 * 4
    spec = model_spec(hf_config)
    expected = queued_bytes(spec, "fp32", layers=2, first=False, last=False, microbatch_size=2, seq_len=32)
    # eager queues the stage output's gradient itself (left out above); compiled a copy of it (counted)
    assert queues[0] == (14, expected)
    assert queues[1] == (14, expected + 2 * 32 * 64 * 4)
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


PROBE_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PROBE_SEQ = 32


def _probe_queue_worker(rank: int, world: int, m: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pp_offload.models import TokenCrossEntropy, split_model
    from pp_offload.plan.probe import PROBE_OFFLOAD, PROBE_SCHEDULE, measure_step
    from pp_offload.runtime.catalog import build_schedule, schedule_info, stage_indices

    torch.set_num_threads(1)
    config = LlamaConfig(**PROBE_LLAMA, num_hidden_layers=4, vocab_size=300, attn_implementation="sdpa")
    info = schedule_info(PROBE_SCHEDULE)
    indices = stage_indices(rank, world, info.placement)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    split = split_model(model, num_stages=4, stage_indices=indices, verify=False)
    stages = [PipelineStage(split.stages[s], s, 4, torch.device("cpu")) for s in indices]
    loss_fn = TokenCrossEntropy()
    loss_fn.num_target_tokens = m * PROBE_SEQ
    schedule = build_schedule(info, stages, m, loss_fn=loss_fn, scale_grads=False, offload=PROBE_OFFLOAD)
    tokens = torch.randint(0, 300, (m, PROBE_SEQ + 1), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        split.module.zero_grad(set_to_none=True)
        args = (tokens[:, :-1],) if 0 in indices else ()
        schedule.step(*args, **({"target": tokens[:, 1:], "losses": []} if 3 in indices else {}))

    return measure_step(schedule, step, steps=1).to_dict()


def test_the_probe_measures_each_stages_queue_as_the_model_predicts() -> None:
    """``schedule: auto``'s probe (V-Min, full offload, 2 gloo ranks, a 4-layer Llama in 4 stages):
    every stage's measured queue is `queued_bytes` of its layers, with the activation store capturing and
    reloading the saved tensors the queue's inputs come from."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from pp_offload.local_ranks import run_on_ranks
    from pp_offload.plan.probe import Measurement

    measured = Measurement.from_dict(run_on_ranks(_probe_queue_worker, 2, 2, timeout=180)[0])
    spec = model_spec(LlamaConfig(**PROBE_LLAMA, num_hidden_layers=4, vocab_size=300))
    for s, st in enumerate(measured.stages):
        first, last = s == 0, s == len(measured.stages) - 1
        kw = {"layers": st.layers, "first": first, "last": last, "microbatch_size": 1, "seq_len": PROBE_SEQ}
        assert st.queued_bytes == queued_bytes(spec, "fp32", **kw), (s, st)
