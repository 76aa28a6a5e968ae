"""``data.streaming``: batches packed on the fly are the prepared blocks in file order, split across
data-parallel ranks the same way whatever their number, and a resumed run continues exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pp_offload.data import DataConfig, DataError, load_examples, pack_examples
from pp_offload.data.blocks import PACKED_COLUMNS
from pp_offload.data.streaming import StreamingBatches

pytestmark = pytest.mark.usefixtures("quiet_datasets")

WORDS = "a b c d e f g h".split()


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<eos>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def _file(path: Path, n: int = 300) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 4)))
            response = "" if i % 17 == 5 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
            f.write(json.dumps({"q": prompt, "r": response}) + "\n")
    return path


def _config(path: Path) -> DataConfig:
    return DataConfig(path=str(path), prompt_column="q", response_column="r", seq_len=6, streaming=True)


def _batches(config: DataConfig, tmp_path: Path, **kwargs) -> StreamingBatches:
    return StreamingBatches(
        lambda: load_examples(config, cache_dir=tmp_path), _tokenizer(), config, 8, **kwargs
    )


def test_streamed_batches_are_the_prepared_blocks_in_order_and_resume_exactly(tmp_path: Path) -> None:
    config = _config(_file(tmp_path / "d.jsonl"))
    assert isinstance(load_examples(config, cache_dir=tmp_path), datasets.IterableDataset)
    in_memory = DataConfig(**{**config.__dict__, "streaming": False})
    prepared = pack_examples(load_examples(in_memory, cache_dir=tmp_path), _tokenizer(), in_memory)
    blocks = len(prepared)
    reported: list[str] = []
    stream = _batches(config, tmp_path, report=reported.append)
    steps = blocks // 8 + 3  # past the end of the first pass: the stream starts over
    run = [stream.batch(step) for step in range(steps)]
    for step in range(blocks // 8):
        for name in PACKED_COLUMNS:
            expect = torch.tensor(prepared[step * 8 : (step + 1) * 8][name])
            assert torch.equal(run[step][name], expect), (step, name)
        assert int(run[step]["num_target_tokens"]) == int((run[step]["labels"] != -100).sum())
    assert stream.counts.note() == f"skipped {300 // 17 + 1} of 300 rows: empty or null response"
    assert reported == [f"data: {stream.counts.note()}"]  # once, though the stream was read twice
    resumed = _batches(config, tmp_path)
    for step in (steps - 2, steps - 1, 1):  # a resume skips ahead; looking back starts the stream again
        for name, value in resumed.batch(step).items():
            assert torch.equal(value, run[step][name]), (step, name)
    assert resumed.skipped_rows > 300


@pytest.mark.parametrize("dp_size", [2, 4])
def test_streamed_global_batches_do_not_depend_on_the_dp_size(tmp_path: Path, dp_size: int) -> None:
    config = _config(_file(tmp_path / "d.jsonl"))
    whole = _batches(config, tmp_path)
    parts = [_batches(config, tmp_path, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for step in (0, 3, 4):
        expect = whole.batch(step)
        got = [p.batch(step) for p in parts]
        for name in PACKED_COLUMNS:
            assert torch.equal(torch.cat([g[name] for g in got]), expect[name])
        assert {int(g["num_target_tokens"]) for g in got} == {int(expect["num_target_tokens"])}


def test_streaming_names_a_missing_column_and_an_empty_stream(tmp_path: Path) -> None:
    file = _file(tmp_path / "d.jsonl")
    with pytest.raises(DataError, match="column 'question' not found"):
        load_examples(
            DataConfig(path=str(file), prompt_column="question", response_column="r", streaming=True)
        )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "a", "r": "b"}\n{"q": "a", "r": "b"\n')  # its line 2 is read mid-stream
    two_files = DataConfig(**{**_config(file).__dict__, "path": "json", "data_files": [str(file), str(bad)]})
    load_examples(two_files, cache_dir=tmp_path)  # opening reads only the first file's first rows: fine
    with pytest.raises(DataError, match=rf"could not read 'json' .*; {bad}:2: malformed JSON line"):
        _batches(two_files, tmp_path).batch(0)
    empty = tmp_path / "e.jsonl"
    empty.write_text(json.dumps({"q": "a", "r": ""}) + "\n")
    with pytest.raises(DataError, match="holds no document with text to learn"):
        _batches(_config(empty), tmp_path).batch(0)


def _run_config(out: Path, steps: int, **output) -> dict:
    return {
        "model": {
            "config": {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        },
        "data": {"path": "embedded", "seq_len": 32, "streaming": True},
        "pipeline": {"microbatches": 2},
        "train": {
            "steps": steps,
            "global_batch_size": 4,
            "lr": 3e-3,
            "warmup_steps": 0,
            "lr_schedule": "constant",
        },
        "output": {"dir": str(out), "log_every": 0, "export": False, **output},
    }


def test_a_streamed_run_resumes_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    from pp_offload.recipe.config import RecipeConfig
    from pp_offload.recipe.train import run

    cache = tmp_path / "cache"
    full = run(
        RecipeConfig.from_dict(_run_config(tmp_path / "full", 4, save_every=0)),
        cache_dir=cache,
        progress=False,
    )
    head = run(
        RecipeConfig.from_dict(_run_config(tmp_path / "cut", 2, save_every=2)),
        cache_dir=cache,
        progress=False,
    )
    tail = run(
        RecipeConfig.from_dict(_run_config(tmp_path / "cut", 4, save_every=2, resume=True)),
        cache_dir=cache,
        progress=False,
    )
    assert len(tail.losses) == 2
    torch.testing.assert_close(
        torch.tensor(head.losses + tail.losses), torch.tensor(full.losses), rtol=1e-5, atol=0
    )
