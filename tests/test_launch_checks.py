"""Every check ``pp-offload train`` makes before any rank starts (the table of docs/troubleshooting.md,
"Checks before launch"), each walked once: exit code 2 and one line on stderr, and torchrun never started.
A config that passes the checks starts (``--check``: "configuration ok").

The launcher runs in this process (`run_from_args`); starting torchrun fails the test."""

from __future__ import annotations

import argparse
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from _tiny_hf import RECIPE_LLAMA

from pp_offload.recipe import RecipeConfig, signals, train_command

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "troubleshooting.md"


def _base(out: Path) -> dict:
    return {
        "model": {"config": {**RECIPE_LLAMA, "max_position_embeddings": 128}, "verify_split": False},
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 64},
        "pipeline": {"schedule": "ScheduleVHalf", "microbatches": 2},
        "train": {"steps": 4, "global_batch_size": 4, "warmup_steps": 1},
        "output": {"dir": str(out), "export": False, "timeline": False},
    }


def _another_run(out: Path) -> None:
    """Checkpoints of a run with another learning rate in the output dir (the files a resume reads)."""
    config = _base(out)
    config["train"]["lr"] = 1e-3
    step = out / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(
        json.dumps({"step": 2, "config": RecipeConfig.from_dict(config).to_dict()})
    )
    (out / "checkpoints" / "latest.json").write_text(json.dumps({"step": 2, "dir": step.name}))


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import os

        return (os.system, (f"touch {self.marker}",))


def _tampered(out: Path) -> None:
    """This run's own checkpoint, with rank 1's RNG state replaced by a pickle that runs a command."""
    step = out / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(
        json.dumps({"step": 2, "config": RecipeConfig.from_dict(_base(out)).to_dict()})
    )
    (out / "checkpoints" / "latest.json").write_text(json.dumps({"step": 2, "dir": step.name}))
    with (step / "rng_1.pt").open("wb") as f:
        pickle.dump({"cpu": _Payload(out / "marker")}, f, protocol=2)


def _jsonl(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.jsonl").write_text('{"prompt": "a", "response": "b"}\n' * 8)


# check (the first column of the doc's table) -> (extra arguments, setup of the output dir, the line's regex)
CASES: dict[str, tuple[list[str], Callable[[Path], None] | None, str]] = {
    "keys and values": (
        ["--set", "train.eval_every=null"],
        None,
        r"train\.eval_every=null must be an int >= 0",
    ),
    "options that need each other": (
        ["--set", "train.eval_every=2"],
        None,
        r"train\.eval_every / train\.eval_batches need held-out data",
    ),
    "node options": (["--nnodes", "2"], None, r"--nnodes 2 needs a rendezvous every node can reach"),
    "process count": (["--dp", "3"], None, r"world size 2 is not a multiple of pipeline\.dp=3"),
    "GPUs per node": (
        ["--set", "train.device=cuda"],
        None,
        r"train\.device=cuda (with 2 processes needs 2 GPUs|but no CUDA device is visible)",
    ),
    "model and tokenizer sources": (
        ["--set", "model.config=null", "--set", "model.path=./no_such_model"],
        None,
        r"model\.path='\./no_such_model'",
    ),
    "schedule": (["--set", "pipeline.schedule=ScheduleVHlaf"], None, r"did you mean 'ScheduleVHalf'\?"),
    "batch split": (
        ["--set", "train.global_batch_size=5"],
        None,
        r"train\.global_batch_size=5 must split into pipeline\.dp=1 replicas x pipeline\.microbatches=2",
    ),
    "layers against stages": (
        ["--set", "model.config.num_hidden_layers=3"],
        None,
        r"the model has 3 layers, fewer than the 4 pipeline stages",
    ),
    "schedule options": (
        ["--set", "pipeline.memory_limit=0.5"],
        None,
        r"pipeline\.memory_limit .* goes with pipeline\.schedule=ScheduleVAdaptive",
    ),
    "sequence length against positions": (
        ["--set", "data.seq_len=256"],
        None,
        r"data\.seq_len=256 is longer than the model's positions "
        r"\(model\.config\.max_position_embeddings=128\): set data\.seq_len <= 128",
    ),
    "another run's checkpoints": (
        [],
        _another_run,
        r"holds checkpoints of another run \(up to step 2; it differs in",
    ),
    "checkpoint files": ([], _tampered, r"rng_1\.pt: refused, not a plain RNG state .*posix\.system"),
    "data columns": (
        [
            "--set",
            "data.path={out}/data.jsonl",
            "--set",
            "data.text_column=body",
            "--set",
            "model.tokenizer=train",
        ],
        _jsonl,
        r"column 'body' not found",
    ),
}


def _doc_checks() -> list[str]:
    """The first column of the table under "## Checks before launch" in docs/troubleshooting.md."""
    section = DOC.read_text().split("## Checks before launch", 1)[1].split("\n## ", 1)[0]
    rows = [
        line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| check ")
    ]
    return [row.split("|")[1].strip() for row in rows]


def test_the_doc_table_lists_exactly_the_walked_checks() -> None:
    assert sorted(_doc_checks()) == sorted(CASES)


def _launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], out: Path, check: bool) -> int:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_base(out)))

    def no_torchrun(command: list[str], env: object = None) -> int:
        raise AssertionError(f"torchrun started: {command}")

    monkeypatch.setattr(signals, "run_forwarding_signals", no_torchrun)
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    argv = [
        "--nproc-per-node",
        "2",
        "--config",
        str(config),
        "--no-progress",
        *(["--check"] if check else []),
    ]
    return train_command.run_from_args(parser.parse_args(argv + [a.format(out=out) for a in extra]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_check_is_one_line_and_exit_2_before_any_rank(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    extra, setup, line = CASES[name]
    out = tmp_path / "run"
    if setup is not None:
        setup(out)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id never reaches the network here
    assert _launch(tmp_path, monkeypatch, extra, out, check=False) == 2
    # a launch (not --check) checks in a forked child (train_command._check_in_child): its stderr is the fd's
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("finetune: ") and re.search(line, err), err
    assert not (out / "marker").exists()  # nothing of a tampered file ran


def test_a_config_that_passes_the_checks_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The base config of the cases above passes every check (``--check``; the run itself is tested in
    tests/test_launcher_signals.py), and says when its warm-up never reaches the peak rate."""
    assert (
        _launch(tmp_path, monkeypatch, ["--set", "train.warmup_steps=4"], tmp_path / "run", check=True) == 0
    )
    captured = capsys.readouterr()
    assert "finetune: configuration ok for 2 process(es)" in captured.out
    assert "finetune: warning: train.warmup_steps=4 >= train.steps=4" in captured.err


def test_positions_are_read_under_the_key_the_config_uses() -> None:
    from transformers import GPT2Config, LlamaConfig

    from pp_offload.recipe.preflight import model_positions

    assert model_positions(GPT2Config(n_positions=64)) == ("n_positions", 64)
    assert model_positions(LlamaConfig(max_position_embeddings=96)) == ("max_position_embeddings", 96)
