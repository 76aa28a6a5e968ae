"""Faults a long run meets, on 2 gloo ranks of a tiny Llama (docs/reliability.md has the table):
a non-finite step, SIGTERM mid-run, a killed worker under ``torchrun --max-restarts 1``, a rank stalled
while its peer waits in a receive, a checkpoint write that fails, and another run's checkpoints.

Interrupted runs are compared with one uninterrupted run (rel 1e-5): nothing is trained twice or lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from _dist import RankError, run_on_ranks
from _tiny_hf import RECIPE_LLAMA

from pp_offload.recipe import ConfigError, RecipeConfig

LLAMA = {**RECIPE_LLAMA, "tie_word_embeddings": True}
STEPS = 6
REPO = Path(__file__).resolve().parents[1]


def _config(out: Path, **extra: object) -> dict:
    config = {
        "model": {"config": LLAMA, "verify_split": False},  # tests/test_models_split.py proves the split
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 100},
        "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 4},
        "train": {"steps": STEPS, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 2, "stall_timeout": 60},
        "output": {"dir": str(out), "report_to": ["csv"], "log_every": 0, "export": False, "timeline": False},
    }
    for key, value in extra.items():
        section, name = key.split("__")
        config[section][name] = value
    return config


def _close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _run(config: dict, cache: str):  # noqa: ANN202
    from pp_offload.recipe.train import run

    return run(RecipeConfig.from_dict(config), cache_dir=cache, progress=False)


def _patch_step(rank: int, step: int, *, before=None, nan: bool = False):  # noqa: ANN001, ANN202
    """Make ``rank``'s ``step``-th schedule step (1-based, counted from now) call ``before()`` first, or
    return a NaN loss; returns the undo."""
    import torch.distributed as dist

    from pp_offload.recipe.pipeline import Pipeline

    real = Pipeline.forward_backward
    calls = [0]

    def wrapped(pipeline, batch):  # noqa: ANN001, ANN202
        calls[0] += 1
        hit = calls[0] == step and dist.get_rank() == rank
        if hit and before is not None:
            before()
        loss = real(pipeline, batch)
        return loss * float("nan") if hit and nan else loss

    Pipeline.forward_backward = wrapped

    def undo() -> None:
        Pipeline.forward_backward = real

    return undo


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("reliability_cache"))


def _plain(rank: int, world: int, config: dict, cache: str) -> list[float]:
    return _run(config, cache).losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache: str) -> list[float]:
    """The uninterrupted run's losses."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return run_on_ranks(_plain, 2, _config(out), cache, timeout=120)[0]


# -------------------------------------------------------------------------------------------------------


def _non_finite(rank: int, world: int, injected: dict, exploding: dict, cache: str) -> dict:
    from pp_offload.recipe.stops import NonFiniteSteps

    undo = _patch_step(1, 3, nan=True)  # rank 1 holds no loss: its NaN reaches rank 0 only by all-reduce
    first = _run(injected, cache)
    undo()
    stopped = None
    try:
        _run(exploding, cache)
    except NonFiniteSteps as error:
        stopped = (str(error), error.exit_code)
    return {"losses": first.losses, "skipped": first.skipped_steps, "stopped": stopped}


def _finite(checkpoint: Path, scratch: Path) -> bool:
    """Every floating-point tensor of a DCP checkpoint (model and optimizer state) is finite."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = scratch / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, whole)

    def tensors(value):  # noqa: ANN001, ANN202
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from tensors(v)

    found = [t for t in tensors(torch.load(whole, weights_only=False)) if t.is_floating_point()]
    return bool(found) and all(bool(torch.isfinite(t).all()) for t in found)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_non_finite_step_is_skipped_on_every_rank_and_too_many_stop_the_run(
    tmp_path: Path, cache: str, reference: list[float]
) -> None:
    """Step 3's loss is NaN on rank 1 only: both ranks skip it (one decision), the run goes on. With
    lr=1e30 every step from 2 on is non-finite: 3 in a row stop the run (exit code 3) naming the value,
    and no checkpoint holds a non-finite number."""
    injected = _config(tmp_path / "injected")
    exploding = _config(tmp_path / "exploding", train__lr=1e30, train__max_bad_steps=3, output__save_every=1)
    got = run_on_ranks(_non_finite, 2, injected, exploding, cache, timeout=120)
    assert repr(got[0]) == repr(got[1])  # the same decisions on both ranks (repr: nan != nan)
    first = got[0]
    assert first["skipped"] == [3]
    _close(first["losses"][:2], reference[:2])  # the steps before it are the uninterrupted run's
    assert all(torch.isfinite(torch.tensor(first["losses"][3:])))  # the weights stayed finite
    message, code = first["stopped"]
    assert code == 3
    assert "stopped after 3 non-finite steps in a row (train.max_bad_steps=3; step 4:" in message
    checkpoints = sorted((tmp_path / "exploding" / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints] == ["step_00000002", "step_00000003"]  # keep: 2
    assert all(_finite(c, tmp_path) for c in checkpoints)


def _preempted(rank: int, world: int, config: dict, cache: str) -> dict:
    undo = _patch_step(1, 3, before=lambda: os.kill(os.getpid(), signal.SIGTERM))  # rank 1 only
    first = _run(config, cache)
    undo()
    second = _run(config, cache)  # the same command again
    return {
        "first": [first.losses, first.preempted, first.last_step],
        "second": [second.losses, second.resumed_from],
    }


def test_sigterm_mid_run_checkpoints_the_step_and_a_rerun_continues_exactly(
    tmp_path: Path, cache: str, reference: list[float]
) -> None:
    """SIGTERM reaches rank 1 during step 3: both ranks finish step 3, write its checkpoint and return;
    the same command again resumes at step 3. Together: the uninterrupted run's losses, no step twice."""
    got = run_on_ranks(_preempted, 2, _config(tmp_path / "run"), cache, timeout=120)
    assert [got[1]["first"][1], got[0]["first"][1]] == ["SIGTERM", "a signal to another rank"]
    got[0]["first"][1] = got[1]["first"][1]
    assert got[0] == got[1]
    (head, _, last), (tail, resumed_from) = got[0]["first"], got[0]["second"]
    assert (last, resumed_from) == (3, 3)
    assert len(head) + len(tail) == STEPS
    _close(head + tail, reference)
    assert json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["step"] == STEPS


def _failing_write(rank: int, world: int, config: dict, cache: str) -> dict:
    """Rank 1's disk is full when step 4's checkpoint is written; then the same command again."""
    import pp_offload.recipe.checkpoint as checkpoint
    from pp_offload.recipe.checkpoint import CheckpointWriteError

    real, saves = checkpoint.rng_state, [0]

    def full_disk() -> dict:
        saves[0] += 1
        if rank == 1 and saves[0] == 2:
            raise OSError(28, "No space left on device")
        return real()

    checkpoint.rng_state = full_disk
    try:
        _run(config, cache)
        failed = None
    except CheckpointWriteError as error:
        failed = str(error)
    checkpoint.rng_state = real
    entries = sorted(p.name for p in (Path(config["output"]["dir"]) / "checkpoints").iterdir())
    again = _run(config, cache)
    return {"failed": failed, "entries": entries, "tail": again.losses, "resumed_from": again.resumed_from}


def test_failing_checkpoint_write_keeps_the_previous_one_and_says_so(
    tmp_path: Path, cache: str, reference: list[float]
) -> None:
    got = run_on_ranks(_failing_write, 2, _config(tmp_path / "run", output__save_every=2), cache, timeout=120)
    assert got[0] == got[1]
    result = got[0]
    assert result["failed"].startswith(
        "checkpoint of step 4 not written (rank 1: OSError: [Errno 28] No space left on device); the latest "
        "checkpoint is still step 2"
    )
    assert result["entries"] == ["latest.json", "step_00000002"]  # no partial step 4 left behind
    assert result["resumed_from"] == 2
    _close(result["tail"], reference[2:])


class _Stamped:
    """A text stream that notes, on the line before, when a stall report was written."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w", buffering=1)
        self.first: float | None = None

    def write(self, text: str) -> int:
        if self.first is None and "stalled" in text:
            self.first = time.time()
            self.file.write(f"{self.first}\n")
        return self.file.write(text)

    def flush(self) -> None:
        self.file.flush()


def _stalls(rank: int, world: int, config: dict, cache: str, logs: str) -> None:
    sys.stderr = _Stamped(Path(logs) / f"rank{rank}.log")  # the stall report goes to stderr

    def hang() -> None:
        (Path(logs) / "stalled_at").write_text(str(time.time()))
        time.sleep(300)

    _patch_step(1, 2, before=lambda: _hang_in_forward(hang))
    _run(config, cache)


def _hang_in_forward(hang) -> None:  # noqa: ANN001
    """Rank 1's next stage forward hangs (inside its forward chunk, as a slow or stuck kernel would): rank
    0 then waits in a receive from rank 1. The stage module's class is patched, not the pipeline stage's
    methods: those may be wrapped per instance (dropout keys, timing) before the patch."""
    from pp_offload.models.split import CausalLMStage

    real = CausalLMStage.forward

    def forward(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        hang()
        return real(self, *args, **kwargs)

    CausalLMStage.forward = forward


def test_stalled_rank_every_rank_says_where_it_waits(tmp_path: Path, cache: str) -> None:
    """Rank 1 hangs in a forward of step 2; within train.stall_timeout + 10 s each rank prints its action
    (rank 0: waiting for rank 1 in a compute action that needs rank 1's output) and the job ends with exit
    code 4."""
    config = _config(tmp_path / "run", train__stall_timeout=3)
    began = time.time()
    with pytest.raises(RankError) as failure:
        run_on_ranks(_stalls, 2, config, cache, str(tmp_path), timeout=120)
    assert failure.value.exitcode == 4
    stalled_at = float((tmp_path / "stalled_at").read_text())
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.log").read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if "stalled" in line)
        report, printed = lines[at], float(lines[at - 1])
        assert report.startswith(f"finetune: rank {rank} stalled at step 2 in action "), report
        assert printed - stalled_at <= 3 + 10
        action = report.split(" in action ")[1].split(": no progress")[0]
        assert action.endswith("(waiting for rank 1)" if rank == 0 else "(computing: its input is here)"), (
            report
        )
    assert time.time() - began < 60


def _config_error(rank: int, world: int, config: dict, cache: str) -> str:
    try:
        _run(config, cache)
    except ConfigError as error:
        return str(error)
    return "no error"


def test_another_runs_checkpoints_are_not_resumed_silently(tmp_path: Path, cache: str) -> None:
    """A fresh run (another learning rate) on an output dir holding another run's checkpoints stops with
    the three ways on; a longer train.steps of the same run resumes (see the SIGTERM test for the rest)."""
    from pp_offload.recipe.resume import plan_resume

    out = tmp_path / "run"
    ckpt = out / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    saved = RecipeConfig.from_dict(_config(out, train__steps=2))
    (ckpt / "meta.json").write_text(json.dumps({"step": 2, "config": saved.to_dict()}))
    (out / "checkpoints" / "latest.json").write_text(json.dumps({"step": 2, "dir": ckpt.name}))
    other = RecipeConfig.from_dict(_config(out, train__lr=1e-3))
    with pytest.raises(
        ConfigError,
        match=r"holds checkpoints of another run \(up to step 2; it differs in "
        r"train.lr: 0.003 -> 0.001\): continue it anyway with --resume .*output.overwrite=true",
    ):
        plan_resume(other, out / "checkpoints", restarts=0)
    longer = plan_resume(RecipeConfig.from_dict(_config(out)), out / "checkpoints", restarts=0)
    assert (
        longer.step == 2 and "train.steps 2 -> 6: the learning rate continues from 3.000e-03" in longer.note
    )
    forced = plan_resume(
        RecipeConfig.from_dict(_config(out, train__lr=1e-3, output__resume=True)),
        out / "checkpoints",
        restarts=0,
    )
    assert forced.step == 2 and "config changed since: train.lr: 0.003 -> 0.001" in forced.note
    over = RecipeConfig.from_dict(_config(out, train__lr=1e-3, output__overwrite=True))
    assert plan_resume(over, out / "checkpoints", restarts=0).wipe
    same = RecipeConfig.from_dict(_config(out, train__steps=2, output__overwrite=True))
    restarted = plan_resume(same, out / "checkpoints", restarts=1)  # never wipes its own run
    assert restarted.step == 2 and "(restart)" in restarted.note
    assert not restarted.wipe


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_bad_steps", 0, r"train.max_bad_steps=0 must be an int >= 1; consecutive non-finite steps"),
        ("max_bad_steps", "five", r"train.max_bad_steps='five' must be an int >= 1"),
        ("stall_timeout", 0, r"train.stall_timeout=0 must be a number > 0, or null; seconds a step may"),
        ("stall_timeout", "soon", r"train.stall_timeout='soon' must be a number > 0, or null"),
    ],
)
def test_new_keys_are_checked(tmp_path: Path, key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RecipeConfig.from_dict(_config(tmp_path, **{f"train__{key}": value}))


def test_killed_worker_under_torchrun_max_restarts_resumes_exactly(
    tmp_path: Path, cache: str, reference: list[float]
) -> None:
    """torchrun --max-restarts 1: rank 1 is SIGKILLed in step 4 (after step 2's checkpoint); the restarted
    workers form their group again, resume from step 2 by themselves, and the run's losses (metrics.csv:
    each step once) are the uninterrupted run's."""
    config = _config(tmp_path / "run", output__save_every=2)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "cache").symlink_to(cache)  # the recipe's cache: tokenizer and data made once
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PP_OFFLOAD_TEST_KILL": "1:4"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(REPO / "tests" / "_fault_finetune.py"),
        "--config",
        str(path),
        "--no-progress",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "finetune: resumed from step 2 (restart)" in output, output[-3000:]
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, STEPS + 1))
    _close([float(r.split(",")[1]) for r in rows], reference)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_non_finite_state_is_never_checkpointed(tmp_path: Path) -> None:
    """The last line of defence behind the skipped steps: save_checkpoint refuses NaN / inf anywhere in
    the model or optimizer state, names the tensor and keeps the previous checkpoint as latest."""
    from pp_offload.recipe.checkpoint import CheckpointWriteError, latest_step, save_checkpoint

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path, 1, model, optimizer)
    optimizer.state[model.bias]["exp_avg_sq"][0] = float("inf")
    with pytest.raises(
        CheckpointWriteError, match=r"step 2 not written \(rank 0: non-finite values in optim\..*bias"
    ):
        save_checkpoint(tmp_path, 2, model, optimizer)
    assert latest_step(tmp_path) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "step_00000001",
    ]
