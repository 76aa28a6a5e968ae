"""Extending (or shortening) a run keeps the learning rate continuous, a resume on another layout says
so, and a few silent surprises now get one line: a warm-up as long as the run, a one-process run
(docs/reliability.md, "Extending a run" and "Restarts and relaunches")."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from _tiny_hf import RECIPE_LLAMA

from pp_offload.recipe import RecipeConfig
from pp_offload.recipe.lr import LrRestart, extension, lr_at, warmup_warning
from pp_offload.recipe.resume import plan_resume


def _config(out: Path, **train: object) -> RecipeConfig:
    return RecipeConfig.from_dict(
        {
            "model": {"config": {"model_type": "llama", "num_hidden_layers": 2}},
            "data": {"path": "embedded", "seq_len": 32},
            "train": {"steps": 8, "lr": 3e-3, "warmup_steps": 2, **train},
            "output": {"dir": str(out)},
        }
    )


def _checkpoint(out: Path, config: RecipeConfig, step: int, **meta: object) -> Path:
    """The files plan_resume reads (no tensors): latest.json and meta.json of ``step``."""
    root = out / "checkpoints"
    (root / f"step_{step:08d}").mkdir(parents=True)
    (root / f"step_{step:08d}" / "meta.json").write_text(
        json.dumps({"step": step, "config": config.to_dict(), **meta})
    )
    (root / "latest.json").write_text(json.dumps({"step": step, "dir": f"step_{step:08d}"}))
    return root


def _rates(config: RecipeConfig, restart: LrRestart | None) -> list[float]:
    return [lr_at(config, s, restart) for s in range(config.train.steps)]


def test_extending_a_finished_run_does_not_jump_the_learning_rate(tmp_path: Path) -> None:
    """The issue's case: 8 steps, then 16 in the same dir. Step 9's rate is at most 1.05x step 8's (it was
    4x before: the 16-step cosine started near the peak again); the console line says what happens."""
    short = _config(tmp_path)
    root = _checkpoint(tmp_path, short, 8)
    longer = replace(short, train=replace(short.train, steps=16))
    plan = plan_resume(longer, root, restarts=0)
    step8, step9 = lr_at(short, 7), lr_at(longer, 8, plan.lr_restart)
    assert step9 <= 1.05 * step8
    assert lr_at(longer, 8) > 3 * step8  # what recomputing the schedule gives: the jump
    assert "train.steps 8 -> 16: the learning rate stays at the schedule's floor, 3.000e-04" in plan.note
    assert "--set train.extend_lr=recompute" in plan.note
    rates = _rates(longer, plan.lr_restart)[8:]
    assert all(b <= a + 1e-12 for a, b in zip(rates, rates[1:], strict=False))  # never rises


def test_extending_mid_run_decays_from_the_current_rate(tmp_path: Path) -> None:
    """Stopped at step 4 of 8, relaunched for 16: the rate goes on from step 4's and decays smoothly to the
    floor at step 16; a relaunch of the extended run (preempted at 10) stays on the same curve."""
    short = _config(tmp_path)
    root = _checkpoint(tmp_path, short, 4)
    longer = replace(short, train=replace(short.train, steps=16))
    plan = plan_resume(longer, root, restarts=0)
    assert plan.lr_restart == LrRestart(4, pytest.approx(lr_at(short, 4)))
    assert "continues from 2.325e-03 (its value at step 5) and decays to 3.000e-04 at step 16" in plan.note
    curve = _rates(longer, plan.lr_restart)
    assert curve[4] == pytest.approx(lr_at(short, 4)) and lr_at(longer, 16, plan.lr_restart) == pytest.approx(
        3e-4
    )
    assert all(b <= a for a, b in zip(curve[4:], curve[5:], strict=False))
    again = tmp_path / "again"
    _checkpoint(again, longer, 10, lr_restart=plan.lr_restart.to_dict())
    relaunch = plan_resume(
        replace(longer, output=replace(longer.output, dir=str(again))), again / "checkpoints", restarts=0
    )
    assert relaunch.lr_restart == plan.lr_restart and "train.steps" not in relaunch.note


def test_recompute_is_taken_only_when_asked(tmp_path: Path) -> None:
    short = _config(tmp_path)
    root = _checkpoint(tmp_path, short, 8)
    asked = replace(short, train=replace(short.train, steps=16, extend_lr="recompute"))
    plan = plan_resume(asked, root, restarts=0)  # extend_lr may change between launches: not "another run"
    assert plan.lr_restart is None
    assert "recomputed for 16 steps (train.extend_lr=recompute; lr at step 9: 3.000e-04 -> 1." in plan.note


def test_extension_during_warmup_keeps_the_warmup() -> None:
    config = _config(Path("unused"), steps=16, warmup_steps=4)
    restart, words = extension(config, 2, 8, None)
    assert restart is None and "goes on as planned" in words


def test_extend_lr_is_checked(tmp_path: Path) -> None:
    from pp_offload.recipe import ConfigError

    with pytest.raises(ConfigError, match=r"train.extend_lr='keep' must be one of continue, recompute"):
        _config(tmp_path, extend_lr="keep")


def test_a_resume_on_another_layout_says_so(tmp_path: Path) -> None:
    config = _config(tmp_path)
    root = _checkpoint(tmp_path, config, 4, layout={"pp": 2, "dp": 2})
    plan = plan_resume(config, root, restarts=0, layout={"pp": 4, "dp": 1})
    assert plan.layout_changed
    assert (
        "checkpoint written at pp 2 x dp 2, resumed at pp 4 x dp 1: model and optimizer resharded"
        in plan.note
    )
    same = plan_resume(config, root, restarts=0, layout={"pp": 2, "dp": 2})
    assert not same.layout_changed and "resharded" not in same.note


def test_auto_probes_again_on_another_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """auto.json records the layout its choice was probed at; a resume at another layout probes again, and
    says so; at the same layout the recorded choice is reused."""
    from pp_offload.recipe.auto import _recorded_decision

    recorded = tmp_path / "auto.json"
    decision = {
        "schedule": "ScheduleVHalf",
        "offload": "none",
        "memory_limit": None,
        "costs": {},
        "predicted_step_s": 1.0,
        "peak_bytes": [1, 1],
        "reason": "fastest",
    }
    recorded.write_text(json.dumps({"decision": decision, "layout": {"pp": 2, "dp": 2}}))
    assert _recorded_decision(recorded, {"pp": 2, "dp": 2}) == decision
    assert _recorded_decision(recorded, {"pp": 4, "dp": 1}) is None
    assert (
        "auto: the checkpoint's choice was made at pp 2 x dp 2, this run is pp 4 x dp 1: probing again"
        in capsys.readouterr().out
    )


def test_a_warmup_as_long_as_the_run_warns(tmp_path: Path) -> None:
    assert warmup_warning(_config(tmp_path, steps=8, warmup_steps=7)) is None
    assert "learning rate reaches train.lr=0.003 only at the last step, with no decay" in str(
        warmup_warning(_config(tmp_path, steps=8, warmup_steps=8))
    )
    line = warmup_warning(_config(tmp_path, steps=8, warmup_steps=10))
    assert line == (
        "finetune: warning: train.warmup_steps=10 >= train.steps=8: the learning rate never reaches "
        "train.lr=0.003 (it ends at 2.400e-03); lower train.warmup_steps or raise train.steps"
    )


def test_one_process_extended_run_says_what_it_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    """End to end in one process: the run says it trains the unsplit model; extended from 3 to 6 steps in
    the same dir, the rate of step 4 is at most 1.05x step 3's (metrics.csv), and the resume line states
    the rule. A seq_len beyond the model's positions stops the ranks too (not only the launcher) before
    any data is read."""
    import csv

    from pp_offload.recipe import ConfigError
    from pp_offload.recipe.single_process import ONE_PROCESS_NOTE
    from pp_offload.recipe.train import run

    def config(steps: int, **data: object) -> RecipeConfig:
        return RecipeConfig.from_dict(
            {
                "model": {"config": {**RECIPE_LLAMA, "max_position_embeddings": 64}, "verify_split": False},
                "data": {"path": "embedded", "seq_len": 32, "max_examples": 32, **data},
                "pipeline": {"microbatches": 2},
                "train": {"steps": steps, "global_batch_size": 2, "warmup_steps": 1, "device": "cpu"},
                "output": {
                    "dir": str(tmp_path / "run"),
                    "report_to": ["csv"],
                    "export": False,
                    "log_every": 0,
                },  # fmt: skip
            }
        )

    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"data\.seq_len=128 is longer than the model's positions"):
        run(config(3, seq_len=128), cache_dir=cache, progress=False)
    run(config(3), cache_dir=cache, progress=False)
    first = capsys.readouterr()
    assert ONE_PROCESS_NOTE in first.out
    run(config(6), cache_dir=cache, progress=False)
    assert "train.steps 3 -> 6: the learning rate stays at the schedule's floor" in capsys.readouterr().out
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rates = {int(row["step"]): float(row["lr"]) for row in csv.DictReader(f)}
    assert sorted(rates) == [1, 2, 3, 4, 5, 6]
    assert rates[4] <= 1.05 * rates[3]
