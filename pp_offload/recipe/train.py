"""The fine-tuning loop of ``recipes/finetune.py``: one function every rank runs.

A step: take this data-parallel rank's slice of the global batch (a pure function of the step, so resume is
exact), tell the loss the global target-token count, run the pipeline schedule (or, with one process, the
unsplit model on the same microbatches: the reference the pipelined run must reproduce), sum a tied
weight's gradient across ranks when the two ends sit apart, clip by the norm over every pipeline and
data-parallel rank, step AdamW. Rank 0 shows a progress bar and logs loss, tokens/s, learning rate and
the device peak. With held-out data (``data.eval_split`` / ``data.eval_path``) the validation loss is measured
every ``train.eval_every`` steps and at the end, forward only (`pp_offload.models.evaluate_pipeline`).
With a ``lora`` section the model is wrapped by peft before the split and only the adapters train
(`pp_offload.models.lora`).

Hybrid runs (``pipeline.dp > 1``): the world is a ``("dp", "pp")`` mesh, pipeline rank inner; each
pipeline replica gets its own slice of every global batch, and each stage is sharded with FSDP2 over the
replicas (`pp_offload.parallel.apply_fsdp`), which reduces its gradients once per step (a sum: the loss is
already normalised over the global batch). bf16 then means FSDP's bf16 parameter policy rather than
autocast. Checkpoints stay sharded (DCP); the HF export gathers full tensors and is written by replica 0.

Long runs (docs/reliability.md): a step whose loss or global gradient norm is not finite is skipped on
every rank, and ``train.max_bad_steps`` of them in a row stop the run; SIGTERM / SIGUSR1 finish the step,
write a checkpoint and return; a relaunch (or a torchrun restart) on the same output directory continues
from its newest checkpoint (`pp_offload.recipe.resume`); a step that makes no progress for
``train.stall_timeout`` seconds makes every rank print where it waits, and the job ends. The loss, the
non-finite verdict and the stop request travel in one all-reduce per step, the one the loss always took.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_offload.data.batches import to_device
from pp_offload.models import TokenCrossEntropy, export_pretrained, router_aux_of
from pp_offload.models.evaluate import EvalResult, evaluate_model, evaluate_pipeline
from pp_offload.models.lora import base_state, export_adapter, merged_state, unwrap_peft
from pp_offload.parallel import build_mesh, checkpointing_mode, clip_grad_norm_, grad_norm
from pp_offload.recipe.auto import choose_schedule, is_auto
from pp_offload.recipe.checkpoint import load_checkpoint, save_checkpoint
from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.recipe.lr import lr_at, warmup_warning
from pp_offload.recipe.model_loading import hf_config_of, load_model, num_layers_of, packing_note
from pp_offload.recipe.pipeline import Pipeline, build_pipeline
from pp_offload.recipe.preempt import StopRequest
from pp_offload.recipe.preflight import preflight
from pp_offload.recipe.resume import ResumePlan, plan_resume
from pp_offload.recipe.run_checks import check_positions
from pp_offload.recipe.run_data import RunData, data_cache, run_data
from pp_offload.recipe.sources import check_model_sources
from pp_offload.recipe.stops import EXIT_STALLED, NonFiniteSteps
from pp_offload.recipe.timeline import StepTimeline
from pp_offload.recipe.topology import Topology, device_for, init_process_group, restart_count, topology
from pp_offload.runtime import compat
from pp_offload.runtime.dropout_keys import DropoutKeys, key_dropout
from pp_offload.runtime.progress import StallWatchdog, StepProgress, describe, track_actions, waiting_peer

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
    skipped_steps: list[int] = field(default_factory=list)  # 1-based steps skipped as non-finite
    preempted: str | None = None  # the signal's name when SIGTERM / SIGUSR1 stopped the run early
    last_step: int = 0  # the step the run's weights are at when it returned


#: What a one-process run says first: it is the reference, not a pipeline, and how to get the pipeline.
ONE_PROCESS_NOTE = (
    "finetune: one process: training the unsplit model (no pipeline split); to split it, start one "
    "process per pipeline rank: pp-offload train --nproc-per-node N (or torchrun --nproc-per-node N)"
)
_AUTO_SUMMARY = ("schedule", "offload", "memory_limit", "predicted_step_s", "peak_bytes", "reason")


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


def _device_peak_mib(device: torch.device) -> float:
    """The device peak (docs/planner.md, *Two peaks*): CUDA's allocated high-water mark, or on CPU the
    process's largest resident set."""
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

    def __init__(self, config: RecipeConfig, out: Path, resumed: bool, start: int = 0) -> None:
        self.csv_file = None
        if resumed:  # rows of steps after the checkpoint were trained again: drop the first copies
            for name in ("metrics.csv", "eval.csv"):
                _keep_rows_up_to(out / name, start)
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
                self.writer.writerow(["step", "loss", "grad_norm", "lr", "tokens_per_s", "device_peak_mib"])
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
        """One row per step (a skipped step's row holds its non-finite loss or norm)."""
        if self.csv_file is not None:
            self.writer.writerow(
                [
                    step,
                    *(
                        f"{values[k]:.6g}"
                        for k in ("loss", "grad_norm", "lr", "tokens_per_s", "device_peak_mib")
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


def _keep_rows_up_to(path: Path, step: int) -> None:
    """Rewrite the metrics CSV ``path`` keeping its header and the rows of steps <= ``step``."""
    if not path.is_file():
        return
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    kept = rows[:1] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]
    if len(kept) != len(rows):
        with path.open("w", newline="") as f:
            csv.writer(f).writerows(kept)


def run(
    config: RecipeConfig, *, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> RunResult:
    """Run the recipe on this process (call it on every rank of a torchrun / accelerate launch job)."""
    config = config.validated()  # a config built in Python gets the checks a YAML one had
    _check(config)
    topo = topology(config)
    device = device_for(config, topo)
    out = Path(config.output.dir)
    cache = data_cache(config, cache_dir)
    if topo.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if warning := warmup_warning(config):
            print(warning, file=sys.stderr, flush=True)
    check_model_sources(config)
    preflight(config, topo, num_layers_of(config) if topo.distributed else None)
    check_positions(config, hf_config_of(config))
    data = run_data(config, topo, cache)  # before the group exists: a bad dataset stops every rank alike
    layout = {"pp": topo.pp, "dp": topo.dp}
    plan = plan_resume(config, out / "checkpoints", restarts=restart_count(), layout=layout)  # the same
    created = init_process_group(config, topo, device)
    try:
        return _run(config, topo, device, out, cache, progress, data, plan)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _run(
    config: RecipeConfig,
    topo: Topology,
    device: torch.device,
    out: Path,
    cache: Path | None,
    progress: bool,
    data: RunData,
    plan: ResumePlan,
) -> RunResult:
    tokenizer, batches = data.tokenizer, data.batches
    ckpt_root = out / "checkpoints"
    if plan.wipe:  # output.overwrite: every rank has read the old checkpoints' state; now they go
        if topo.rank == 0:
            print(plan.note, flush=True)
            shutil.rmtree(ckpt_root, ignore_errors=True)
        if topo.distributed:
            dist.barrier()
    resume_from = plan.step
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
                with _autocast(config, device, topo):  # and the all-reduce a step ends with
                    _agree(_pipeline_step(probe, first), torch.zeros(()), False, True, device)

            config, decision = choose_schedule(
                config, model, topo, device, mesh, probe_step, out, reuse=resume_from is not None
            )  # a layout other than the checkpoint's is probed again (auto.json records its layout)
        inputs = decision.offload_inputs if decision is not None else None  # what auto chose with
        pipeline = build_pipeline(config, model, topo, device, mesh, offload_inputs=inputs)
        module = pipeline.module
    else:
        if config.pipeline.pp not in (None, 1):
            raise ConfigError(
                f"pipeline.pp={config.pipeline.pp} needs that many processes; launch with torchrun"
            )
        if topo.rank == 0:
            print(ONE_PROCESS_NOTE, flush=True)
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
        if topo.rank == 0 and plan.note:
            print(plan.note, flush=True)
    result.last_step = start
    metrics = _Metrics(config, out, resumed=start > 0, start=start) if topo.rank == 0 else None
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
    meta = {"config": config.to_dict(), "layout": {"pp": topo.pp, "dp": topo.dp}}  # how a relaunch
    if plan.lr_restart is not None:  # recognises this run's checkpoints, and its learning-rate curve
        meta["lr_restart"] = plan.lr_restart.to_dict()
    where = StepProgress()  # what this rank does now, for the stall report
    untrack = track_actions(pipeline.schedule, where) if pipeline is not None else (lambda: None)
    watchdog = None
    if train.stall_timeout is not None:
        report = _stall_reporter(where, pipeline, topo, float(train.stall_timeout))
        watchdog = StallWatchdog(where, float(train.stall_timeout), report).start()
    bad_in_a_row = 0
    say = _say(topo, bar)
    try:
        with StopRequest() as stop:
            for step in range(start, train.steps):
                where.step = step + 1
                where.enter("loading the batch")
                where.armed = True
                if timeline is not None and step == timeline_step:
                    timeline.start()
                batch = to_device(batches.batch(step), device)
                lr = lr_at(config, step, plan.lr_restart)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.zero_grad(set_to_none=True)
                keys = pipeline.dropout if pipeline is not None else reference.dropout
                keys.step = step  # dropout masks keyed to the step, not to the generator's history
                began = time.perf_counter()
                with _autocast(config, device, topo):
                    if pipeline is not None:
                        local_loss = _pipeline_step(pipeline, batch)
                    else:
                        reference.loss_fn.num_target_tokens = int(batch["num_target_tokens"])
                        local_loss = torch.tensor(reference.step(batch), dtype=torch.float64)
                if timeline is not None and step == timeline_step:
                    result.timeline_png = timeline.finish()
                if pipeline is not None and pipeline.compile_watch is not None:
                    pipeline.compile_watch.after_step(say)
                if pipeline is not None and pipeline.tied is not None:
                    where.enter("the tied weight's gradient all-reduce")
                    pipeline.tied.sync_grads()
                where.enter("the gradient norm (a collective over every rank)")
                norm_tensor = _clip(pipeline, module, train.max_grad_norm)
                where.enter("the loss all-reduce (every rank)")
                loss, norm, norm_ok, stopping = _agree(
                    local_loss, norm_tensor, stop.requested, topo.distributed, device
                )
                if math.isfinite(loss) and norm_ok:
                    where.enter("the optimizer step")
                    optimizer.step()
                    bad_in_a_row = 0
                    result.last_step = step + 1
                else:  # every rank decided alike: the values were all-reduced
                    optimizer.zero_grad(set_to_none=True)  # nothing of this step reaches the weights
                    bad_in_a_row += 1
                    result.skipped_steps.append(step + 1)
                    result.last_step = step + 1  # its batch and learning rate are used up
                    what = _non_finite(loss, norm, norm_ok)
                    say(f"finetune: step {step + 1} skipped: {what}")
                where.armed = False
                elapsed = time.perf_counter() - began
                tokens = int(batch["input_ids"].numel()) * topo.dp
                tokens_seen += tokens
                time_spent += elapsed
                result.losses.append(loss)
                result.grad_norms.append(norm)
                values = {
                    "loss": loss,
                    "grad_norm": norm,
                    "lr": lr,
                    "tokens_per_s": tokens / elapsed,
                    "device_peak_mib": _device_peak_mib(device),
                }
                if metrics is not None:
                    metrics.log(step + 1, values)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
                    if config.output.log_every and (step + 1) % config.output.log_every == 0:
                        line = (
                            f"step {step + 1}/{train.steps}  loss {loss:.4f}  grad_norm {norm:.3f}  "
                            f"lr {lr:.2e}  tokens/s {values['tokens_per_s']:.0f}  "
                            f"device_peak {values['device_peak_mib']:.0f} MiB"
                        )
                        say(line)
                if bad_in_a_row >= train.max_bad_steps:
                    raise NonFiniteSteps(
                        f"stopped after {bad_in_a_row} non-finite steps in a row (train.max_bad_steps="
                        f"{train.max_bad_steps}; step {step + 1}: {what}); the weights are those after "
                        f"step {step + 1 - bad_in_a_row}. Lower train.lr or set train.max_grad_norm, "
                        "then --resume from the last checkpoint"
                    )
                last = step + 1 == train.steps
                if stopping and not last:
                    where.enter("the preemption checkpoint")
                    save_checkpoint(
                        ckpt_root, step + 1, module, optimizer, keep=config.output.keep, meta=meta
                    )
                    result.preempted = stop.name or "a signal to another rank"
                    say(
                        f"finetune: stopped by {result.preempted} after step {step + 1} of {train.steps}; "
                        f"checkpoint {ckpt_root / f'step_{step + 1:08d}'} written; run the same command "
                        "again to continue"
                    )
                    break
                if train.eval_every and (step + 1) % train.eval_every == 0 and not last:
                    where.enter("evaluation")
                    _evaluate(config, data, pipeline, module, device, topo, step + 1, result, metrics, bar)
                every = config.output.save_every
                if every and (step + 1) % every == 0 and not last:
                    where.enter("a checkpoint")
                    save_checkpoint(
                        ckpt_root, step + 1, module, optimizer, keep=config.output.keep, meta=meta
                    )
            where.armed = False
            if result.preempted is None and start < train.steps:  # a signal now is noted, not fatal
                save_checkpoint(ckpt_root, train.steps, module, optimizer, keep=config.output.keep, meta=meta)
        if result.preempted is None and data.eval_batches is not None:  # also when nothing was left
            _evaluate(config, data, pipeline, module, device, topo, train.steps, result, metrics, bar)
    finally:
        where.armed = False
        if watchdog is not None:
            watchdog.stop()
        untrack()
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
    result.tokens_per_s = tokens_seen / time_spent if time_spent else 0.0
    if config.output.export and result.preempted is None:
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
            "skipped_steps": result.skipped_steps,
            "preempted": result.preempted,
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
    data: RunData,
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


def _pipeline_step(pipeline: Pipeline, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One schedule step; returns this rank's part of the step's loss (its microbatches' sum; zero on
    ranks without the last stage), a float64 scalar where the losses are, for `_agree` to all-reduce
    (no host read here: `_agree` reads the step's figures once)."""
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
    if not losses:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([loss.detach().double() for loss in losses]).sum()


def _agree(
    local_loss: torch.Tensor,
    norm: torch.Tensor,
    stop: bool,
    distributed: bool,
    device: torch.device | None = None,
) -> tuple[float, float, bool, bool]:
    """The step's loss, this rank's gradient norm, whether that norm is finite on every rank, whether any
    rank was asked to stop: one all-reduce over the whole job (the one the loss always took), so every
    rank decides alike, and one host read of all four at the end of the step."""
    where = device if device is not None and device.type == "cuda" else torch.device("cpu")  # NCCL: device
    norm = norm.detach().reshape(()).to(where, torch.float64)
    flags = torch.stack(
        [
            local_loss.detach().reshape(()).to(where, torch.float64),
            (~torch.isfinite(norm)).to(torch.float64),
            torch.tensor(1.0 if stop else 0.0, dtype=torch.float64, device=where),
        ]
    )
    if distributed:
        dist.all_reduce(flags)
    loss, bad_norm, stopping, own_norm = torch.cat([flags, norm.reshape(1)]).tolist()
    return loss, own_norm, bad_norm == 0, stopping > 0


def _non_finite(loss: float, norm: float, norm_ok: bool) -> str:
    """``loss nan`` / ``grad norm inf`` / both: what made a step non-finite."""
    parts = [f"loss {loss}"] if not math.isfinite(loss) else []
    if not norm_ok:
        parts.append(f"grad norm {norm if not math.isfinite(norm) else 'nan on another rank'}")
    return ", ".join(parts)


def _say(topo: Topology, bar: Any) -> Any:
    """Print a line on rank 0 (through the progress bar when there is one); other ranks stay quiet."""

    def say(line: str) -> None:
        if topo.rank == 0:
            (bar.write if bar is not None else print)(line)
            sys.stdout.flush()

    return say


def _stall_reporter(where: StepProgress, pipeline: Pipeline | None, topo: Topology, timeout: float) -> Any:
    """What the watchdog does on a stall: print where this rank waits, give the other ranks a few seconds
    to print theirs (a rank that ended first would turn their wait into a connection error), exit."""
    ranks = dist.get_process_group_ranks(pipeline.pp_group) if pipeline is not None else [topo.rank]

    def report() -> None:
        peer = None
        if pipeline is not None:
            peer = waiting_peer(pipeline.schedule, where.action, lambda r: ranks[r])
        print(
            f"finetune: rank {topo.rank} stalled at step {where.step} {describe(where, peer)}: no progress "
            f"for {timeout:g} s (train.stall_timeout); ending the job",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(min(5.0, timeout))
        os._exit(EXIT_STALLED)

    return report


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
