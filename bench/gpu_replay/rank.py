"""The rank a replay runs: its stages of the model (only its layers exist), the schedule on a fake process
group, and the inputs of a step (`bench/bench_gpu_replay.py`)."""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from typing import Any

import torch

GIB = 1024**3

TINY_SHAPE = {
    "model_type": "llama",
    "vocab_size": 512,
    "num_key_value_heads": 2,
    "num_hidden_layers": 8,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Config:
    schedule: str
    offload: str
    recompute: str

    @classmethod
    def parse(cls, text: str) -> Config:
        parts = text.split("/")
        if len(parts) != 3:
            raise ValueError(f"a configuration is schedule/offload/recompute, got {text!r}")
        return cls(*parts)

    @property
    def label(self) -> str:
        return f"{self.schedule} / {self.offload} / {self.recompute}"


def _hf_config(shape: dict[str, Any], num_layers: int, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig

    values = dict(shape)
    model_type = values.pop("model_type")
    values["num_hidden_layers"] = num_layers
    config = AutoConfig.for_model(model_type, **values)
    config.use_cache = False
    config.dtype = dtype
    return config


def build_rank(
    shape: dict[str, Any],
    config: Config,
    *,
    layers_per_stage: list[int],
    pp: int,
    rank: int,
    seq: int,
    microbatches: int,
    device: torch.device,
    dtype: torch.dtype,
    costs: Any,
    inputs: Any = None,
    compile_options: Any = None,
) -> tuple[Any, list[Any], Any]:
    """This rank's stages (only its layers exist: the model is built with the rank's layer count and the
    other stages get zero layers) and the schedule on the fake process group. Returns
    (schedule, stages, loss_fn). ``compile_options`` (`pp_offload.runtime.compile.CompileOptions`): each
    decoder layer compiled in place, as the recipe's ``train.compile`` does (compiled at the first step)."""
    import contextlib
    import functools

    from torch.distributed.pipelining import PipelineStage
    from transformers import AutoModelForCausalLM

    from pp_offload.models.loss import TokenCrossEntropy
    from pp_offload.models.split import split_model
    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime import compat
    from pp_offload.runtime.catalog import build_schedule, schedule_info, stage_indices
    from pp_offload.runtime.compile import compile_layers
    from pp_offload.runtime.offload import enable_offload

    info = schedule_info(config.schedule)
    per_rank = info.stages_per_rank(None)
    num_stages = pp * per_rank
    held = stage_indices(rank, pp, info.placement, per_rank)
    mine = [layers_per_stage[s] if s in held else 0 for s in range(num_stages)]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_hf_config(shape, sum(mine), dtype), dtype=dtype)
    model.train()
    split = split_model(model, num_stages=num_stages, stage_indices=held, layers_per_stage=mine, verify=False)
    if config.recompute != "none":
        activation_checkpointing(split, mode=config.recompute)
    eager: Any = contextlib.nullcontext
    if compile_options is not None:  # before the schedule, as the recipe: a refused combination stops here
        compile_layers(split.stages.values(), compile_options)
        # the metadata forward below runs before deferred W patches the layers: compiled, it would compile
        # a graph the step never uses (and the step would compile again)
        eager = functools.partial(torch.compiler.set_stance, "force_eager")
    hidden = int(shape["hidden_size"])
    stages = []
    for s in split.stage_indices:
        if s == 0:
            example = torch.zeros(1, seq, dtype=torch.long, device=device)
        else:
            example = torch.zeros(1, seq, hidden, dtype=dtype, device=device, requires_grad=True)
        with eager():
            out = split.stages[s](example)  # the stage's output metadata (static: no handshake with peers)
        stages.append(
            PipelineStage(
                split.stages[s],
                s,
                num_stages,
                device,
                input_args=example,
                output_args=out.detach().requires_grad_(out.requires_grad),
            )
        )
        del out
    loss_fn = TokenCrossEntropy()
    loss_fn.num_target_tokens = microbatches * (seq - 1)
    kwargs: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
    ours = info.module == "pp_offload.runtime.schedules"
    if ours:
        kwargs["costs"] = costs
        kwargs["spread_search"] = False  # the peers are not there: this rank searches its order alone
        if config.offload != "none":
            kwargs["offload"] = config.offload
            if inputs is not None:  # the planner's figures: the runtime places what the planner predicts
                kwargs["costs"] = None
                kwargs["offload_inputs"] = inputs
    schedule = build_schedule(info, stages, microbatches, **kwargs)
    if not ours and config.offload != "none":
        if inputs is not None:
            enable_offload(schedule, config.offload, inputs=inputs, device=device)
        else:
            enable_offload(schedule, config.offload, costs=costs, device=device)
    compat.use_static_stage_metadata(schedule)
    return schedule, stages, loss_fn


def step_inputs(stages: list[Any], num_stages: int, microbatches: int, seq: int, vocab: int, device: Any):
    has_first = any(st.stage_index == 0 for st in stages)
    has_last = any(st.stage_index == num_stages - 1 for st in stages)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab, (microbatches, seq), generator=gen).to(device)
    args = (ids,) if has_first else ()
    kwargs = {"target": ids} if has_last else {}
    return args, kwargs


def no_outputs(schedule: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The step keywords the recipe uses: the last stage keeps no logits for the step's return value."""
    from pp_offload.runtime import compat

    return {**kwargs, **compat.no_output_kwargs(schedule)}


def fill_receive_buffers(stages: list[Any]) -> None:
    """Peers never send: give every receive buffer finite activation-like values once."""
    from pp_offload.runtime import compat

    gen = torch.Generator(device="cpu").manual_seed(2)
    for stage in stages:
        for buffer in compat.receive_buffers(stage):
            with torch.no_grad():
                buffer.copy_(torch.randn(buffer.shape, generator=gen).mul_(0.5).to(buffer.dtype))


def ready_rank(
    shape: dict[str, Any],
    config: Config,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    layers_per_stage: list[int],
    *,
    costs: Any,
    inputs: Any = None,
    compile_options: Any = None,
) -> tuple[Any, list[Any], tuple, dict[str, Any]]:
    """`build_rank`, then one step (it allocates the receive buffers and gradients, and compiles the layers
    under ``compile_options``) and finite values in the receive buffers. Returns (schedule, stages, step
    args, step kwargs)."""
    from pp_offload.runtime.catalog import schedule_info

    schedule, stages, _ = build_rank(
        shape,
        config,
        layers_per_stage=layers_per_stage,
        pp=args.pp,
        rank=args.rank,
        seq=args.seq,
        microbatches=args.microbatches,
        device=device,
        dtype=dtype,
        costs=costs,
        inputs=inputs,
        compile_options=compile_options,
    )
    num_stages = args.pp * schedule_info(config.schedule).stages_per_rank(None)
    step_args, step_kwargs = step_inputs(
        stages, num_stages, args.microbatches, args.seq, int(shape["vocab_size"]), device
    )
    step_kwargs = no_outputs(schedule, step_kwargs)
    schedule.step(*step_args, **step_kwargs)
    fill_receive_buffers(stages)
    return schedule, stages, step_args, step_kwargs


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Drop the last configuration's model and buffers (reference cycles through stage hooks included)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
