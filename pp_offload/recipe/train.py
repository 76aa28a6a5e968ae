"""The fine-tuning loop of ``recipes/finetune.py``: one function every rank runs.

A step: take this data-parallel rank's slice of the global batch (a pure function of the step, so resume is
exact), tell the loss the global target-token count, run the pipeline schedule (or, with one process, the
unsplit model on the same microbatches: the reference the pipelined run must reproduce), sum a tied
weight's gradient across ranks when the two ends sit apart, clip by the norm over every pipeline and
data-parallel rank, step AdamW. Rank 0 shows a progress bar and logs loss, tokens/s, learning rate and
peak memory. With held-out data (``data.eval_split`` / ``data.eval_path``) the validation loss is measured
every ``train.eval_every`` steps and at the end, forward only (`pp_offload.models.evaluate_pipeline`).
With a ``lora`` section the model is wrapped by peft before the split and only the adapters train
(`pp_offload.models.lora`).

Hybrid runs (``pipeline.dp > 1``): the world is a ``("dp", "pp")`` mesh, pipeline rank inner; each
pipeline replica gets its own slice of every global batch, and each stage is sharded with FSDP2 over the
replicas (`pp_offload.parallel.apply_fsdp`), which reduces its gradients once per step (a sum: the loss is
already normalised over the global batch). bf16 then means FSDP's bf16 parameter policy rather than
autocast. Checkpoints stay sharded (DCP); the HF export gathers full tensors and is written by replica 0.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_offload.data import (
    DataConfig,
    DataError,
    PackedBatches,
    embedded_assets,
    embedded_dir,
    load_examples,
    pack_examples,
)
from pp_offload.data.batches import to_device
from pp_offload.models import TokenCrossEntropy, export_pretrained, router_aux_of
from pp_offload.models.evaluate import EvalResult, evaluate_model, evaluate_pipeline
from pp_offload.models.lora import base_state, export_adapter, merged_state, unwrap_peft
from pp_offload.parallel import build_mesh, checkpointing_mode, clip_grad_norm_, grad_norm
from pp_offload.recipe.auto import choose_schedule, is_auto
from pp_offload.recipe.checkpoint import latest_step, load_checkpoint, save_checkpoint
from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.parts import (
    Pipeline,
    Topology,
    build_pipeline,
    check_model_sources,
    device_for,
    init_process_group,
    load_model,
    load_tokenizer,
    num_layers_of,
    packing_note,
    preflight,
    topology,
)
from pp_offload.recipe.timeline import StepTimeline
from pp_offload.runtime import compat
from pp_offload.runtime.dropout_keys import DropoutKeys, key_dropout

__all__ = ["RunResult", "run"]


@dataclass
class RunResult:
    """What a run did: per-step losses (every rank has them), where it wrote, the step it resumed from."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    resumed_from: int | None = None
    export_dir: Path | None = None  # with LoRA: the adapter, in peft's format
    merged_dir: Path | None = None  # LoRA with lora.merge: the merged full model
    output_dir: Path | None = None
    schedule: str = ""
    tokens_per_s: float = 0.0
    timeline_png: Path | None = None
    auto: dict[str, Any] | None = None  # schedule: auto's decision (the same on every rank)
    evals: list[dict[str, float]] = field(default_factory=list)  # {"step", "loss", "perplexity", "tokens"}


_AUTO_SUMMARY = ("schedule", "offload", "memory_limit", "predicted_step_s", "peak_bytes", "reason")


def _lr_at(config: RecipeConfig, step: int) -> float:
    """Linear warm-up to ``train.lr``, then cosine (or constant) down to ``lr * min_lr_ratio``."""
    train = config.train
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return train.lr
    span = max(train.steps - train.warmup_steps, 1)
    progress = min((step - train.warmup_steps) / span, 1.0)
    floor = train.lr * train.min_lr_ratio
    return floor + (train.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check(config: RecipeConfig) -> None:
    train = config.train
    if train.steps < 1:
        raise ConfigError(f"train.steps must be >= 1, got {train.steps}")
    if train.lr_schedule not in ("cosine", "constant"):
        raise ConfigError(f"train.lr_schedule must be cosine or constant, got {train.lr_schedule!r}")
    if train.precision not in ("fp32", "bf16"):
        raise ConfigError(f"train.precision must be fp32 or bf16, got {train.precision!r}")
    try:
        checkpointing_mode(train.activation_checkpointing)
    except ValueError as error:
        raise ConfigError(f"train.activation_checkpointing: {error}") from None
    if train.eval_every < 0:
        raise ConfigError(
            f"train.eval_every must be >= 0 (0: evaluate only at the end), got {train.eval_every}"
        )
    if train.eval_batches is not None and train.eval_batches < 1:
        raise ConfigError(
            f"train.eval_batches must be >= 1 or null (all held-out blocks), got {train.eval_batches}"
        )
    if (train.eval_every or train.eval_batches is not None) and not config.data.has_eval:
        raise ConfigError(
            "train.eval_every / train.eval_batches need held-out data: set data.eval_split (the embedded "
            "corpus has 'validation') or data.eval_path"
        )
    unknown = set(config.output.metrics) - {"csv", "tensorboard"}
    if unknown:
        raise ConfigError(f"output.metrics may hold csv and tensorboard, got {sorted(unknown)}")


@dataclass
class _Data:
    tokenizer: Any
    batches: PackedBatches
    eval_batches: list[dict[str, torch.Tensor]] | None


def _data(config: RecipeConfig, topo: Topology, cache: Path) -> _Data:
    """Tokenizer, training batches and the held-out batches (every rank; the embedded assets and datasets'
    cache are safe to share)."""
    data: DataConfig = config.data
    if topo.rank != 0:  # one progress bar per job, not one per rank
        import datasets

        datasets.disable_progress_bars()
    tokenizer_dir = None
    if data.path == "embedded":
        tokenizer_dir = embedded_assets(embedded_dir(cache)).tokenizer_dir
    examples = load_examples(data, cache_dir=cache)
    tokenizer = load_tokenizer(config, tokenizer_dir, examples)  # model.tokenizer: train learns the examples
    packed = pack_examples(examples, tokenizer, data)
    batches = PackedBatches(
        packed, config.train.global_batch_size, dp_rank=topo.dp_rank, dp_size=topo.dp, seed=config.train.seed
    )
    held_out = None
    if data.has_eval:
        held_out = _eval_batches(config, topo, tokenizer, cache)
    return _Data(tokenizer, batches, held_out)


def _eval_batches(config: RecipeConfig, topo: Topology, tokenizer: Any, cache: Path) -> list[dict[str, Any]]:
    """The first ``train.eval_batches`` global batches of the held-out blocks (all of them by default),
    in a fixed order, each data-parallel rank its slice: every evaluation scores the same tokens."""
    eval_data = config.data.eval_config()
    try:
        packed = pack_examples(load_examples(eval_data, cache_dir=cache), tokenizer, eval_data)
        held_out = PackedBatches(
            packed, config.train.global_batch_size, dp_rank=topo.dp_rank, dp_size=topo.dp, seed=0
        )
    except DataError as error:
        raise ConfigError(f"evaluation data (data.eval_split / data.eval_path): {error}") from error
    count = len(held_out)
    if config.train.eval_batches is not None:
        count = min(count, config.train.eval_batches)
    return [held_out.batch(i) for i in range(count)]


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def _autocast(config: RecipeConfig, device: torch.device, topo: Topology) -> Any:
    if config.train.precision == "bf16" and topo.dp == 1:  # with dp > 1, FSDP's bf16 policy does it
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class _Reference:
    """One process, no pipeline: the unsplit model on the same microbatches, summed like the pipeline."""

    def __init__(self, model: nn.Module, microbatches: int, seed: int = 0) -> None:
        self.model = model
        self.microbatches = microbatches
        aux = router_aux_of(model)  # weighed as the pipeline weighs it: the mean over the microbatches
        self.loss_fn = TokenCrossEntropy(None if aux is None else aux.coef / microbatches)
        self.dropout = DropoutKeys(seed=seed)  # the pipeline's masks: keyed by step, microbatch and layer
        key_dropout(model, self.dropout)

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        total = 0.0
        chunks = zip(
            *(batch[k].tensor_split(self.microbatches) for k in ("input_ids", "labels", "position_ids")),
            strict=True,
        )
        for j, (input_ids, labels, position_ids) in enumerate(chunks):
            with self.dropout.running(j):
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
                aux = out.aux_loss if self.loss_fn.router_aux_weight is not None else None
                loss = self.loss_fn(out.logits if aux is None else (out.logits, aux), labels)
                loss.backward()
            total += float(loss.detach())
        return total


class _Metrics:
    """CSV and (optionally) TensorBoard metrics on rank 0."""

    def __init__(self, config: RecipeConfig, out: Path, resumed: bool) -> None:
        self.csv_file = None
        self.eval_csv = None
        self.tensorboard = None
        if "csv" in config.output.metrics and config.data.has_eval:
            path = out / "eval.csv"
            new = not (resumed and path.exists())
            self.eval_csv = path.open("w" if new else "a", newline="")
            self.eval_writer = csv.writer(self.eval_csv)
            if new:
                self.eval_writer.writerow(["step", "loss", "perplexity", "tokens"])
        if "csv" in config.output.metrics:
            path = out / "metrics.csv"
            new = not (resumed and path.exists())
            self.csv_file = path.open("w" if new else "a", newline="")
            self.writer = csv.writer(self.csv_file)
            if new:
                self.writer.writerow(["step", "loss", "grad_norm", "lr", "tokens_per_s", "peak_memory_mib"])
        if "tensorboard" in config.output.metrics:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ConfigError(
                    "output.metrics includes tensorboard but the tensorboard package is not installed: "
                    "pip install tensorboard, or use output.metrics=[csv]"
                ) from error
            self.tensorboard = SummaryWriter(str(out / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.csv_file is not None:
            self.writer.writerow(
                [
                    step,
                    *(
                        f"{values[k]:.6g}"
                        for k in ("loss", "grad_norm", "lr", "tokens_per_s", "peak_memory_mib")
                    ),
                ]
            )
            self.csv_file.flush()
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(f"train/{key}", value, step)

    def log_eval(self, step: int, outcome: EvalResult) -> None:
        if self.eval_csv is not None:
            self.eval_writer.writerow(
                [step, f"{outcome.loss:.6g}", f"{outcome.perplexity:.6g}", outcome.tokens]
            )
            self.eval_csv.flush()
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("eval/loss", outcome.loss, step)
            self.tensorboard.add_scalar("eval/perplexity", outcome.perplexity, step)

    def close(self) -> None:
        if self.eval_csv is not None:
            self.eval_csv.close()
        if self.csv_file is not None:
            self.csv_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def run(
    config: RecipeConfig, *, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> RunResult:
    """Run the recipe on this process (call it on every rank of a torchrun / accelerate launch job)."""
    config = config.validated()  # a config built in Python gets the checks a YAML one had
    _check(config)
    topo = topology(config)
    device = device_for(config, topo)
    out = Path(config.output.dir)
    cache = Path(cache_dir) if cache_dir is not None else out / "cache"
    if topo.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    check_model_sources(config)
    preflight(config, topo, num_layers_of(config) if topo.distributed else None)
    data = _data(config, topo, cache)  # before the group exists: a bad dataset stops every rank alike
    created = init_process_group(config, topo, device)
    try:
        return _run(config, topo, device, out, cache, progress, data)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _run(
    config: RecipeConfig,
    topo: Topology,
    device: torch.device,
    out: Path,
    cache: Path,
    progress: bool,
    data: _Data,
) -> RunResult:
    tokenizer, batches = data.tokenizer, data.batches
    ckpt_root = out / "checkpoints"
    resume_from = latest_step(ckpt_root) if config.output.resume else None
    model = load_model(config, tokenizer, partial=topo.distributed)
    if topo.rank == 0 and (note := packing_note(model)):
        print(note, flush=True)
    pipeline: Pipeline | None = None
    reference: _Reference | None = None
    decision = None
    if topo.distributed:
        mesh = build_mesh(
            topo.pp, topo.dp, device_type=device.type, dp_replicate=config.pipeline.dp_replicate
        )
        if is_auto(config):
            first = to_device(batches.batch(resume_from or 0), device)  # the run's first

            def probe_step(probe: Pipeline) -> None:
                with _autocast(config, device, topo):
                    _pipeline_step(probe, first)

            config, decision = choose_schedule(
                config, model, topo, device, mesh, probe_step, out, reuse=resume_from is not None
            )
        inputs = decision.offload_inputs if decision is not None else None  # what auto chose with
        pipeline = build_pipeline(config, model, topo, device, mesh, offload_inputs=inputs)
        module = pipeline.module
    else:
        if config.pipeline.pp not in (None, 1):
            raise ConfigError(
                f"pipeline.pp={config.pipeline.pp} needs that many processes; launch with torchrun"
            )
        model.to(device).train()
        module = unwrap_peft(model)  # with LoRA: the model under the PeftModel, named as the stages are
        reference = _Reference(module, config.pipeline.microbatches, seed=config.train.seed)
    train = config.train
    trainable = [p for p in module.parameters() if p.requires_grad]  # with LoRA: the adapters only
    optimizer = torch.optim.AdamW(
        trainable, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay
    )
    start = 0
    result = RunResult(output_dir=out, schedule=pipeline.info.name if pipeline else "single process")
    if decision is not None:
        result.auto = decision.to_dict()
    if resume_from is not None:
        start = load_checkpoint(ckpt_root, module, optimizer)
        result.resumed_from = start
    metrics = _Metrics(config, out, resumed=start > 0) if topo.rank == 0 else None
    bar = None
    if topo.rank == 0 and progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=train.steps, initial=start, desc=f"fine-tune ({result.schedule})", unit="step")
    tokens_seen, time_spent = 0, 0.0
    timeline = None
    if pipeline is not None and config.output.timeline and StepTimeline.supported(pipeline.schedule):
        timeline = StepTimeline(
            pipeline.schedule,
            out,
            rank=topo.rank,
            title=f"{result.schedule}, this run",
            group=pipeline.pp_group,
        )
    timeline_step = start + 1 if train.steps - start > 1 else start
    try:
        for step in range(start, train.steps):
            if timeline is not None and step == timeline_step:
                timeline.start()
            batch = to_device(batches.batch(step), device)
            lr = _lr_at(config, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            keys = pipeline.dropout if pipeline is not None else reference.dropout
            keys.step = step  # dropout masks keyed to the step, not to the generator's history
            began = time.perf_counter()
            with _autocast(config, device, topo):
                if pipeline is not None:
                    loss = _pipeline_step(pipeline, batch)
                else:
                    reference.loss_fn.num_target_tokens = int(batch["num_target_tokens"])
                    loss = reference.step(batch)
            if timeline is not None and step == timeline_step:
                result.timeline_png = timeline.finish()
            if pipeline is not None and pipeline.tied is not None:
                pipeline.tied.sync_grads()
            norm = _clip(pipeline, module, train.max_grad_norm)
            optimizer.step()
            elapsed = time.perf_counter() - began
            tokens = int(batch["input_ids"].numel()) * topo.dp
            tokens_seen += tokens
            time_spent += elapsed
            result.losses.append(loss)
            result.grad_norms.append(float(norm))
            values = {
                "loss": loss,
                "grad_norm": float(norm),
                "lr": lr,
                "tokens_per_s": tokens / elapsed,
                "peak_memory_mib": _peak_memory_mib(device),
            }
            if metrics is not None:
                metrics.log(step + 1, values)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
                if config.output.log_every and (step + 1) % config.output.log_every == 0:
                    line = (
                        f"step {step + 1}/{train.steps}  loss {loss:.4f}  grad_norm {float(norm):.3f}  "
                        f"lr {lr:.2e}  tokens/s {values['tokens_per_s']:.0f}  "
                        f"peak_mem {values['peak_memory_mib']:.0f} MiB"
                    )
                    (bar.write if bar is not None else print)(line)
            if train.eval_every and (step + 1) % train.eval_every == 0 and step + 1 < train.steps:
                _evaluate(config, data, pipeline, module, device, topo, step + 1, result, metrics, bar)
            every = config.output.save_every
            if every and (step + 1) % every == 0 and step + 1 < train.steps:
                save_checkpoint(ckpt_root, step + 1, module, optimizer, keep=config.output.keep)
        if start < train.steps:
            save_checkpoint(ckpt_root, train.steps, module, optimizer, keep=config.output.keep)
        if data.eval_batches is not None:  # the final evaluation, also after a resume that had nothing left
            _evaluate(config, data, pipeline, module, device, topo, train.steps, result, metrics, bar)
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
    result.tokens_per_s = tokens_seen / time_spent if time_spent else 0.0
    if config.output.export:
        if config.lora is not None:
            result.export_dir, result.merged_dir = _export_lora(
                config, model, pipeline, module, tokenizer, out, topo
            )
        else:
            result.export_dir = _export(config, model, pipeline, module, tokenizer, out, topo)
    if topo.rank == 0:
        summary = {
            "losses": result.losses,
            "grad_norms": result.grad_norms,
            "schedule": result.schedule,
            "resumed_from": result.resumed_from,
            "tokens_per_s": result.tokens_per_s,
            "export_dir": str(result.export_dir) if result.export_dir else None,
            "merged_dir": str(result.merged_dir) if result.merged_dir else None,
            "timeline_png": str(result.timeline_png) if result.timeline_png else None,
            "auto": None if result.auto is None else {k: result.auto[k] for k in _AUTO_SUMMARY},
            "eval": result.evals,
            "final_eval": result.evals[-1] if result.evals else None,
            "config": config.to_dict(),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return result


def _evaluate(
    config: RecipeConfig,
    data: _Data,
    pipeline: Pipeline | None,
    module: nn.Module,
    device: torch.device,
    topo: Topology,
    step: int,
    result: RunResult,
    metrics: _Metrics | None,
    bar: Any,
) -> EvalResult:
    """Validation loss over the held-out batches, forward only (no saved activations, no offload)."""
    assert data.eval_batches is not None
    batches = [to_device(b, device) for b in data.eval_batches]
    with _autocast(config, device, topo):
        if pipeline is not None:
            outcome = evaluate_pipeline(pipeline.schedule, batches, microbatches=config.pipeline.microbatches)
        else:
            outcome = evaluate_model(module, batches, microbatches=config.pipeline.microbatches)
    result.evals.append({"step": step, **outcome.to_dict()})
    if metrics is not None:
        metrics.log_eval(step, outcome)
        line = (
            f"eval step {step}/{config.train.steps}  loss {outcome.loss:.4f}  "
            f"perplexity {outcome.perplexity:.2f}  ({outcome.tokens} tokens)"
        )
        (bar.write if bar is not None else print)(line)
    return outcome


def _clip(pipeline: Pipeline | None, module: nn.Module, max_norm: float | None) -> torch.Tensor:
    """The whole model's gradient norm (every pipeline and data-parallel rank), clipping to ``max_norm``."""
    if pipeline is None:
        grads = [p.grad.detach().double().pow(2).sum() for p in module.parameters() if p.grad is not None]
        norm = torch.stack(grads).sum().sqrt() if grads else torch.zeros((), dtype=torch.float64)
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(module.parameters(), max_norm, norm.float())
        return norm
    skip = pipeline.skip_in_norm()
    if max_norm is None:
        return grad_norm(module.parameters(), pipeline.mesh, skip=skip)
    return clip_grad_norm_(module.parameters(), max_norm, pipeline.mesh, skip=skip)


def _pipeline_step(pipeline: Pipeline, batch: dict[str, torch.Tensor]) -> float:
    """One schedule step; returns the step's loss (summed over microbatches) on every rank."""
    pipeline.loss_fn.num_target_tokens = int(batch["num_target_tokens"])
    losses: list[torch.Tensor] = []
    kwargs = compat.no_output_kwargs(pipeline.schedule)  # the last stage's logits are not needed: losses are
    args = (batch["input_ids"],) if pipeline.has_first else ()
    target = batch["labels"] if pipeline.has_last else None
    pipeline.schedule.step(
        *args,
        target=target,
        losses=losses,
        position_ids=batch["position_ids"],
        packed_rows=batch["packed_rows"],  # on the CPU: masks decided without reading the device
        **kwargs,
    )
    local = torch.stack([loss.detach().float() for loss in losses]).sum().cpu() if losses else torch.zeros(())
    dist.all_reduce(local)
    return float(local)


def _export(
    config: RecipeConfig,
    model: nn.Module,
    pipeline: Pipeline | None,
    module: nn.Module,
    tokenizer: Any,
    out: Path,
    topo: Topology,
) -> Path | None:
    """Write one HF checkpoint: every pipeline rank of replica 0 writes the parameters it holds.

    Under FSDP each stage's parameters are first gathered whole (a collective over the data-parallel
    ranks, so every rank takes part); the other replicas hold the same values and write nothing. Returns
    the export directory on the ranks that wrote it, None on the others.
    """
    target = out / "export"
    if pipeline is None:
        return export_pretrained(module, model.config, target, tokenizer=tokenizer)
    state = {}  # a tied LM head is left out by export_pretrained (the first stage saves the embedding)
    for name, tensor in module.state_dict().items():
        if pipeline.sharded is not None and hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()  # collective over dp: same names, same order on every replica
        state[name] = tensor
    exported = None
    if topo.dp_rank == 0:
        exported = export_pretrained(
            _StateDictView(state), model.config, target, tokenizer=tokenizer, group=pipeline.pp_group
        )
    dist.barrier()
    return exported


def _export_lora(
    config: RecipeConfig,
    model: nn.Module,
    pipeline: Pipeline | None,
    module: nn.Module,
    tokenizer: Any,
    out: Path,
    topo: Topology,
) -> tuple[Path | None, Path | None]:
    """The adapter (peft's format, every rank's layers gathered) to ``out/export``; for a base model built
    from ``model.config`` the base too, to ``out/export/base`` (recorded as the adapter's
    ``base_model_name_or_path``); with ``lora.merge`` the merged model to ``out/merged``. Each pipeline rank
    writes its own shard of the full models."""
    assert config.lora is not None
    group = pipeline.pp_group if pipeline is not None else None
    replica0 = topo.dp_rank == 0  # the other replicas hold the same values and write nothing
    state = {name: _whole(t) for name, t in module.state_dict().items()}  # under FSDP: collective over dp
    adapter = None
    # a base built from model.config exists nowhere else: its weights go beside the adapter, as an HF model
    base = out / "export" / "base" if config.model.path is None else None
    if replica0:
        if base is not None:  # first: peft's save reads the base's config
            base_model = _StateDictView(base_state(module, state))
            export_pretrained(base_model, unwrap_peft(model).config, base, tokenizer=tokenizer, group=group)
        adapter_only = _StateDictView({k: v for k, v in state.items() if ".lora_" in k})
        base_name = str(base.resolve()) if base is not None else None
        adapter = export_adapter(
            adapter_only, model, out / "export", group=group, tokenizer=tokenizer, base_model=base_name
        )
    merged = None
    if config.lora.merge and replica0:
        merged = export_pretrained(
            _StateDictView(merged_state(module, state)),
            unwrap_peft(model).config,
            out / "merged",
            tokenizer=tokenizer,
            group=group,
        )
    if pipeline is not None:
        dist.barrier()
    return adapter, merged


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class _StateDictView(nn.Module):
    """A module whose state dict is the given tensors (what `export_pretrained` reads)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._state = state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return dict(self._state)
