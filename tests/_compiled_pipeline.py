"""One compiled pipeline cell (schedule x offload x recompute x model family) on this rank, and the
one-process reference it must match: shared by tests/test_compile_gloo.py and bench/bench_compile_grads.py.

A cell splits a tiny Hugging Face model (`pp_offload.models.split_model`), checkpoints its layers,
compiles each decoder layer in place (`pp_offload.runtime.compile.compile_layers`), builds the schedule
(deferred weight gradients for split-backward ones) and runs steps over batches that alternate unpacked
rows (one document a row) and packed rows (several documents a row), zeroing the gradients before each.
It returns the last step's gradients (HF parameter names), the graphs dynamo compiled after the first
step, and how many times the checkpointed layers ran per microbatch (a custom op at the start of each
checkpointed forward: it runs in the compiled forward and again wherever the compiled backward
recomputes the layer, which Python code inside a compiled region would not show).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
from _tiny_hf import RECIPE_LLAMA

MICROBATCHES = 4
ROWS = 8  # 2 rows a microbatch: a mask's batch stride matters (a 1-row batch hides it)
SEQ = 16
VOCAB = 96
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": RECIPE_LLAMA,
    "qwen2": {**RECIPE_LLAMA, "model_type": "qwen2"},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 4},
    "lora": RECIPE_LLAMA,  # with a LoRA adapter (peft): frozen base linears, trainable A and B
}

_RUNS: Counter[str] = Counter()
_COMPILED_WITH: dict[str, bool] = {}  # the donated_buffer setting dynamo's cached graphs were compiled under


@torch.library.custom_op("pp_offload_tests::tick", mutates_args=())
def _tick(x: torch.Tensor) -> torch.Tensor:
    """Counts one run of a checkpointed layer (its impl runs in eager, in compiled graphs and in their
    recomputations alike) and passes ``x`` on."""
    _RUNS["runs"] += 1
    return x.clone()


_tick.register_fake(lambda x: torch.empty_like(x))
_tick.register_autograd(lambda ctx, grad: grad)


def _ticked(inner: Any, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    return inner(torch.ops.pp_offload_tests.tick(hidden), *args, **kwargs)


def _count_runs(modules: Any) -> int:
    """Put the tick in front of every checkpointed forward under ``modules``; returns how many."""
    from pp_offload.parallel.fsdp import _WRAPPERS

    count = 0
    for root in modules:
        for module in root.modules():
            forward = vars(module).get("forward")
            if isinstance(forward, functools.partial) and forward.func in _WRAPPERS.values():
                module.forward = functools.partial(forward.func, functools.partial(_ticked, forward.args[0]))
                count += 1
    return count


def model(family: str) -> torch.nn.Module:
    """The family's tiny causal LM (fp32, train mode, no dropout, sdpa, seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = dict(FAMILIES[family])
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=VOCAB, **fields)
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    config._attn_implementation = "sdpa"
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    if family == "lora":
        import peft

        lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
        net = peft.get_peft_model(net, lora).base_model.model
        torch.manual_seed(1)
        for name, param in net.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: give the adapter a gradient on A too
                torch.nn.init.normal_(param, std=0.02)
    return net


def batch(packed: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    """``ROWS`` rows of ``SEQ`` tokens; ``packed``: each row packs documents of 3 to 9 tokens (position ids
    restart at each), else one document a row."""
    from pp_offload.models.masks import packed_rows

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).repeat(ROWS, 1)
    if packed:
        for r in range(ROWS):
            pos: list[int] = []
            while len(pos) < SEQ:
                pos.extend(range(int(torch.randint(3, 10, (1,), generator=gen))))
            positions[r] = torch.tensor(pos[:SEQ])
    return {
        "input_ids": ids[:, :-1].contiguous(),
        "labels": ids[:, 1:].contiguous(),
        "position_ids": positions,
        "packed_rows": packed_rows(positions),
    }


def _loss_fn(labels: torch.Tensor) -> Any:
    from pp_offload.models import TokenCrossEntropy

    loss_fn = TokenCrossEntropy()
    loss_fn.num_target_tokens = labels.numel()
    return loss_fn


def _grads(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


def aliases(family: str) -> dict[str, str]:
    """Every parameter name of the family's model -> the name ``named_parameters()`` gives it (a tied
    weight has two names; a pipeline rank holding only the LM head calls it by the head's)."""
    net, names = model(family), {}
    first = {id(p): n for n, p in reversed(list(net.named_parameters(remove_duplicate=False)))}
    for name, param in net.named_parameters(remove_duplicate=False):
        names[name] = first[id(param)]
    return names


def sum_over_ranks(per_rank: list[dict[str, torch.Tensor]], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The model's gradients from the ranks' (a weight tied across two ranks: its two parts summed)."""
    summed: dict[str, torch.Tensor] = {}
    for grads in per_rank:
        for name, grad in grads.items():
            key = names.get(name, name)
            summed[key] = summed[key] + grad if key in summed else grad
    return summed


def reference(family: str, backend: str) -> dict[str, torch.Tensor]:
    """The same model, each decoder layer compiled with ``backend`` (no recompute: it changes what is kept,
    not the gradients), in one process, on the packed batch: every parameter's gradient."""
    from pp_offload.runtime.compile import CompileOptions, compile_layers

    net = model(family)
    compile_layers([net], CompileOptions(backend=backend))
    data = batch(packed=True)
    logits = net(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False).logits
    _loss_fn(data["labels"])(logits, data["labels"]).backward()
    return _grads(net)


def run_cell(
    rank: int,
    world: int,
    *,
    family: str,
    schedule: str,
    offload: str | None,
    recompute: str | None,
    backend: str,
    steps: int = 2,
    donated_buffer: bool = True,
) -> dict[str, Any]:
    """One cell on this rank (module doc); the last step runs the packed batch `reference` uses."""
    from torch._functorch import config as functorch_config
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.models import split_model
    from pp_offload.parallel import activation_checkpointing
    from pp_offload.runtime import compat
    from pp_offload.runtime.catalog import build_schedule, schedule_info, stage_indices
    from pp_offload.runtime.compile import CompileOptions, compile_layers
    from pp_offload.runtime.offload import enable_offload

    info = schedule_info(schedule)
    num_stages = world * info.stages_per_rank()
    ids = stage_indices(rank, world, info.placement)
    if _COMPILED_WITH.get("donated_buffer", donated_buffer) != donated_buffer:
        torch._dynamo.reset()  # dynamo does not guard on the setting: compile afresh under the new one
    _COMPILED_WITH["donated_buffer"] = donated_buffer
    previous = functorch_config.donated_buffer
    functorch_config.donated_buffer = donated_buffer
    try:
        split = split_model(model(family), num_stages=num_stages, stage_indices=ids, verify=False)
        if recompute is not None:
            activation_checkpointing(split, mode=recompute)
        checkpointed = _count_runs(split.stages.values())
        compile_layers(split.stages.values(), CompileOptions(backend=backend))
        stages = [PipelineStage(split.stages[s], s, num_stages, torch.device("cpu")) for s in ids]
        ours = info.module == "pp_offload.runtime.schedules"
        kwargs: dict[str, Any] = {"scale_grads": False, "loss_fn": _loss_fn(batch(True)["labels"])}
        if ours:
            kwargs["offload"] = offload
        sched = build_schedule(info, stages, MICROBATCHES, **kwargs)
        if offload is not None and not ours:
            enable_offload(sched, offload)
        graphs_after_first = 0
        for step in range(steps):
            data = batch(packed=step % 2 == (steps - 1) % 2)  # alternating; the last one packed
            split.module.zero_grad(set_to_none=True)
            _RUNS.clear()
            sched.step(
                *((data["input_ids"],) if 0 in ids else ()),
                **({"target": data["labels"]} if num_stages - 1 in ids else {}),
                position_ids=data["position_ids"],
                packed_rows=data["packed_rows"],
            )
            if step == 0:
                graphs_after_first = -compat.compile_counters()[1]
        graphs_after_first += compat.compile_counters()[1]
    finally:
        functorch_config.donated_buffer = previous
    return {
        "grads": _grads(split.module),
        "graphs_after_first": graphs_after_first,
        "runs_per_microbatch": _RUNS["runs"] / (checkpointed * MICROBATCHES) if checkpointed else None,
    }


def run_cells(
    rank: int,
    world: int,
    cells: list[dict[str, Any]],
    references: str | None = None,
    progress: bool = False,
) -> list[dict]:
    """`run_cell` for each cell in one process (start-up and imports paid once); an error is recorded in
    its cell and the next cell runs. ``references``: a backend; then each rank also computes `reference`
    for its share of the cells' families (appended as ``{"reference": family, "grads": ...}``), in
    parallel with the other rank instead of after the spawn."""
    out: list[dict] = []
    if progress and rank == 0:
        from tqdm import tqdm

        cells = tqdm(cells, desc="cells", unit="cell")
    for cell in cells:
        try:
            out.append(run_cell(rank, world, **cell))
        except Exception as error:  # noqa: BLE001 - recorded per cell, reported by the caller
            out.append({"error": f"{type(error).__name__}: {error}"})
    if references is not None:
        families = sorted({cell["family"] for cell in cells})
        out.extend({"reference": f, "grads": reference(f, references)} for f in families[rank::world])
    return out
