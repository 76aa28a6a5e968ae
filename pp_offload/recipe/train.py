"""The fine-tuning loop of ``recipes/finetune.py``: one function every rank runs.

A step: take this data-parallel rank's slice of the global batch (a pure function of the step, so resume is
exact), run the forward and backward passes (`pp_offload.recipe.runner.Runner`: the pipeline schedule, or
with one process the unsplit model on the same microbatches, the reference the pipelined run must
reproduce), clip by the norm over every pipeline and data-parallel rank, step the optimizer (AdamW with
transformers Trainer's weight-decay groups: `pp_offload.recipe.optimizer`). Rank 0 shows
a progress bar and logs loss, tokens/s, learning rate and the device peak (`pp_offload.recipe.metrics`).
With held-out data the validation loss is measured every ``train.eval_every`` steps and at the end
(`pp_offload.recipe.held_out`); the model is exported at the end (`pp_offload.recipe.run_export`). With a
``lora`` section the model is wrapped by peft before the split and only the adapters train.

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

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pp_offload.data.batches import to_device
from pp_offload.models.lora import unwrap_peft
from pp_offload.parallel import build_mesh
from pp_offload.recipe.auto import choose_schedule, is_auto
from pp_offload.recipe.checkpoint import load_checkpoint, save_checkpoint
from pp_offload.recipe.config import RecipeConfig
from pp_offload.recipe.held_out import HeldOut
from pp_offload.recipe.lr import lr_at, warmup_warning
from pp_offload.recipe.metrics import RunMetrics, device_peak_mib
from pp_offload.recipe.model_loading import load_model, packing_note
from pp_offload.recipe.optimizer import build_optimizer, decay_groups
from pp_offload.recipe.pipeline import Pipeline, build_pipeline
from pp_offload.recipe.preempt import StopRequest
from pp_offload.recipe.preflight import preflight
from pp_offload.recipe.resume import ResumePlan, plan_resume
from pp_offload.recipe.run_data import RunData, data_cache, run_data
from pp_offload.recipe.run_export import export_run
from pp_offload.recipe.run_result import RunResult
from pp_offload.recipe.runner import Runner, agree_on_step, non_finite, precision
from pp_offload.recipe.single_process import ONE_PROCESS_NOTE, SingleProcess
from pp_offload.recipe.stops import EXIT_STALLED, NonFiniteSteps
from pp_offload.recipe.topology import Topology, device_for, init_process_group, restart_count, topology
from pp_offload.runtime.progress import StallWatchdog, StepProgress, describe

__all__ = ["RunResult", "run"]


def run(
    config: RecipeConfig, *, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> RunResult:
    """Run the recipe on this process (call it on every rank of a torchrun / accelerate launch job)."""
    config = config.validated()  # a config built in Python gets the checks a YAML one had
    topo = topology(config)
    preflight(config, topo)
    device = device_for(config, topo)
    out = Path(config.output.dir)
    cache = data_cache(config, cache_dir)
    if topo.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if warning := warmup_warning(config):
            print(warning, file=sys.stderr, flush=True)
    data = run_data(config, topo, cache)  # before the group exists: a bad dataset stops every rank alike
    layout = {"pp": topo.pp, "dp": topo.dp}
    plan = plan_resume(config, out / "checkpoints", restarts=restart_count(), layout=layout)  # the same
    created = init_process_group(config, topo, device)
    try:
        return _run(config, topo, device, out, progress, data, plan)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _run(
    config: RecipeConfig,
    topo: Topology,
    device: torch.device,
    out: Path,
    progress: bool,
    data: RunData,
    plan: ResumePlan,
) -> RunResult:
    if plan.wipe:  # output.overwrite: every rank has read the old checkpoints' state; now they go
        if topo.rank == 0:
            print(plan.note, flush=True)
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
        if topo.distributed:
            dist.barrier()
    model = load_model(config, data.tokenizer, partial=topo.distributed)
    if topo.rank == 0:
        if note := packing_note(model):
            print(note, flush=True)
        whole = decay_groups(unwrap_peft(model), config.train.weight_decay_exclude)  # before the split
        print(whole.note(config.train), flush=True)
    config, runner, decision = _runner(config, model, topo, device, data, out, plan)
    optimizer = build_optimizer(config.train, runner.module)  # with LoRA: the adapters only
    result = RunResult(output_dir=out, schedule=runner.name)
    if decision is not None:
        result.auto = decision.to_dict()
    start = 0
    if plan.step is not None:
        start = load_checkpoint(out / "checkpoints", runner.module, optimizer)
        result.resumed_from = start
        if topo.rank == 0 and plan.note:
            print(plan.note, flush=True)
    result.last_step = start
    loop = _Loop(config, topo, device, out, runner, optimizer, data, plan, result, start)
    loop.train(progress)
    result.tokens_per_s = loop.tokens_seen / loop.time_spent if loop.time_spent else 0.0
    if config.output.export and result.preempted is None:
        result.export_dir, result.merged_dir = export_run(
            config, model, runner, data.tokenizer, out, topo.dp_rank
        )
    if topo.rank == 0:
        summary = {**result.summary(), "config": config.to_dict()}
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return result


def _runner(
    config: RecipeConfig,
    model: nn.Module,
    topo: Topology,
    device: torch.device,
    data: RunData,
    out: Path,
    plan: ResumePlan,
) -> tuple[RecipeConfig, Runner, Any]:
    """The runner of this rank: the unsplit model with one process, else the pipeline (with ``schedule:
    auto``, the one chosen after a probe; the config returned is then the chosen one)."""
    if not topo.distributed:
        if topo.rank == 0:
            print(ONE_PROCESS_NOTE, flush=True)
        model.to(device).train()
        # with LoRA: the model under the PeftModel, named as the stages are
        return (
            config,
            SingleProcess(unwrap_peft(model), config.pipeline.microbatches, config.train.seed),
            None,
        )
    mesh = build_mesh(topo.pp, topo.dp, device_type=device.type, dp_replicate=config.pipeline.dp_replicate)
    decision = None
    if is_auto(config):
        first = to_device(data.batches.batch(plan.step or 0), device)  # the run's first

        def probe_step(probe: Pipeline) -> None:
            with precision(config.train.precision, device, topo.dp):  # and the all-reduce a step ends with
                agree_on_step(probe.forward_backward(first), torch.zeros(()), False, True, device)

        config, decision = choose_schedule(
            config, model, topo, device, mesh, probe_step, out, reuse=plan.step is not None
        )  # a layout other than the checkpoint's is probed again (auto.json records its layout)
    inputs = decision.offload_inputs if decision is not None else None  # what auto chose with
    return config, build_pipeline(config, model, topo, device, mesh, offload_inputs=inputs), decision


class _Loop:
    """The steps from ``start`` to ``train.steps``, with what happens between them (logging, evaluation,
    checkpoints, a requested stop) and the watch over each step's progress."""

    def __init__(
        self,
        config: RecipeConfig,
        topo: Topology,
        device: torch.device,
        out: Path,
        runner: Runner,
        optimizer: torch.optim.Optimizer,
        data: RunData,
        plan: ResumePlan,
        result: RunResult,
        start: int,
    ) -> None:
        self.config, self.topo, self.device, self.out = config, topo, device, out
        self.runner, self.optimizer, self.data, self.plan, self.result = runner, optimizer, data, plan, result
        self.start = start
        self.held_out = HeldOut(config, data.eval_batches, runner, device, topo.dp)
        self.meta = {"config": config.to_dict(), "layout": {"pp": topo.pp, "dp": topo.dp}}  # how a relaunch
        if plan.lr_restart is not None:  # recognises this run's checkpoints, and its learning-rate curve
            self.meta["lr_restart"] = plan.lr_restart.to_dict()
        self.timeline = runner.timeline(out, topo.rank) if config.output.timeline else None
        self.timeline_step = start + 1 if config.train.steps - start > 1 else start
        self.where = StepProgress()  # what this rank does now, for the stall report
        self.metrics: RunMetrics | None = None
        self.bar: Any = None
        self.bad_in_a_row = 0
        self.tokens_seen, self.time_spent = 0, 0.0

    def train(self, progress: bool) -> None:
        train, where = self.config.train, self.where
        if self.topo.rank == 0:
            self.metrics = RunMetrics(self.config, self.out, resumed=self.start > 0, start=self.start)
            if progress:
                from tqdm.auto import tqdm

                desc = f"fine-tune ({self.runner.name})"
                self.bar = tqdm(total=train.steps, initial=self.start, desc=desc, unit="step")
        untrack = self.runner.track(where)
        watchdog = None
        if train.stall_timeout is not None:
            report = self._stall_reporter(float(train.stall_timeout))
            watchdog = StallWatchdog(where, float(train.stall_timeout), report).start()
        try:
            with StopRequest() as stop:
                for step in range(self.start, train.steps):
                    stopping = self._step(step, stop)
                    if self._between_steps(step + 1, stopping, stop):
                        break
                where.armed = False
                if self.result.preempted is None and self.start < train.steps:  # a signal now is noted
                    self._checkpoint(train.steps)
            if self.result.preempted is None and self.held_out.enabled:  # also when nothing was left
                self._evaluate(train.steps)
        finally:
            where.armed = False
            if watchdog is not None:
                watchdog.stop()
            untrack()
            if self.bar is not None:
                self.bar.close()
            if self.metrics is not None:
                self.metrics.close()

    def _step(self, step: int, stop: StopRequest) -> bool:
        """Train 0-based ``step``; returns whether any rank was asked to stop."""
        config, runner, optimizer, where, result = (
            self.config,
            self.runner,
            self.optimizer,
            self.where,
            self.result,
        )
        where.step = step + 1
        where.enter("loading the batch")
        where.armed = True
        recorded = self.timeline is not None and step == self.timeline_step
        if recorded:
            self.timeline.start()
        batch = to_device(self.data.batches.batch(step), self.device)
        lr = lr_at(config, step, self.plan.lr_restart)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        runner.begin_step(step)
        began = time.perf_counter()
        with precision(config.train.precision, self.device, self.topo.dp):
            local_loss = runner.forward_backward(batch)
        if recorded:
            result.timeline_png = self.timeline.finish()
        runner.finish_backward(where, self._say)
        where.enter("the gradient norm (a collective over every rank)")
        norm_tensor = runner.grad_norm(config.train.max_grad_norm)
        where.enter("the loss all-reduce (every rank)")
        loss, norm, norm_ok, stopping = agree_on_step(
            local_loss, norm_tensor, stop.requested, self.topo.distributed, self.device
        )
        result.last_step = step + 1  # a skipped step's batch and learning rate are used up too
        what = None
        if math.isfinite(loss) and norm_ok:
            where.enter("the optimizer step")
            optimizer.step()
            self.bad_in_a_row = 0
        else:  # every rank decided alike: the values were all-reduced
            optimizer.zero_grad(set_to_none=True)  # nothing of this step reaches the weights
            self.bad_in_a_row += 1
            result.skipped_steps.append(step + 1)
            what = non_finite(loss, norm, norm_ok)
            self._say(f"finetune: step {step + 1} skipped: {what}")
        where.armed = False
        elapsed = time.perf_counter() - began
        tokens = int(batch["input_ids"].numel()) * self.topo.dp
        self.tokens_seen += tokens
        self.time_spent += elapsed
        self._log(step + 1, loss, norm, lr, tokens / elapsed)
        if self.bad_in_a_row >= config.train.max_bad_steps:
            raise NonFiniteSteps(
                f"stopped after {self.bad_in_a_row} non-finite steps in a row (train.max_bad_steps="
                f"{config.train.max_bad_steps}; step {step + 1}: {what}); the weights are those after "
                f"step {step + 1 - self.bad_in_a_row}. Lower train.lr or set train.max_grad_norm, "
                "then --resume from the last checkpoint"
            )
        return stopping

    def _log(self, step: int, loss: float, norm: float, lr: float, tokens_per_s: float) -> None:
        """Every rank keeps the step's loss and norm; rank 0 writes its row, moves the bar, prints a line."""
        self.result.losses.append(loss)
        self.result.grad_norms.append(norm)
        if self.metrics is None:
            return
        peak = device_peak_mib(self.device)
        values = {
            "loss": loss,
            "grad_norm": norm,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "device_peak_mib": peak,
        }
        self.metrics.log(step, values)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        every = self.config.output.log_every
        if every and step % every == 0:
            self._say(
                f"step {step}/{self.config.train.steps}  loss {loss:.4f}  grad_norm {norm:.3f}  "
                f"lr {lr:.2e}  tokens/s {tokens_per_s:.0f}  device_peak {peak:.0f} MiB"
            )

    def _between_steps(self, step: int, stopping: bool, stop: StopRequest) -> bool:
        """After 1-based ``step``: a requested stop's checkpoint (then True: the loop ends), the evaluation
        and the checkpoint that are due (the last step's come after the loop)."""
        last = step == self.config.train.steps
        if stopping and not last:
            self.where.enter("the preemption checkpoint")
            self._checkpoint(step)
            self.result.preempted = stop.name or "a signal to another rank"
            self._say(
                f"finetune: stopped by {self.result.preempted} after step {step} of "
                f"{self.config.train.steps}; checkpoint {self.out / 'checkpoints' / f'step_{step:08d}'} "
                "written; run the same command again to continue"
            )
            return True
        if self.held_out.due(step):
            self.where.enter("evaluation")
            self._evaluate(step)
        every = self.config.output.save_every
        if every and step % every == 0 and not last:
            self.where.enter("a checkpoint")
            self._checkpoint(step)
        return False

    def _checkpoint(self, step: int) -> None:
        save_checkpoint(
            self.out / "checkpoints", step, self.runner.module, self.optimizer, keep=self.config.output.keep,
            meta=self.meta,
        )  # fmt: skip

    def _evaluate(self, step: int) -> None:
        """Validation loss over the held-out batches, forward only (no saved activations, no offload)."""
        outcome = self.held_out.measure()
        self.result.evals.append({"step": step, **outcome.to_dict()})
        if self.metrics is not None:
            self.metrics.log_eval(step, outcome)
            self._say(self.held_out.line(step, outcome))

    def _say(self, line: str) -> None:
        """Print a line on rank 0 (through the progress bar when there is one); other ranks stay quiet."""
        if self.topo.rank == 0:
            (self.bar.write if self.bar is not None else print)(line)
            sys.stdout.flush()

    def _stall_reporter(self, timeout: float) -> Any:
        """What the watchdog does on a stall: print where this rank waits, give the other ranks a few
        seconds to print theirs (a rank that ended first would turn their wait into a connection error),
        exit."""
        where, rank = self.where, self.topo.rank

        def report() -> None:
            at = describe(where, self.runner.waiting_peer(where))
            print(
                f"finetune: rank {rank} stalled at step {where.step} {at}: no progress for {timeout:g} s "
                "(train.stall_timeout); ending the job",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(min(5.0, timeout))
            os._exit(EXIT_STALLED)

        return report
