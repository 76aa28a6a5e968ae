"""A new user's own data and model: ``model.tokenizer: train``, model directories missing a piece, and
``pp-offload train`` stopping a bad config in one line before any rank starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pp_offload.__main__ import main as pp_offload_main
from pp_offload.data import DataConfig, load_examples
from pp_offload.data.tokenizer import trained_tokenizer
from pp_offload.recipe.config import ConfigError, load_config
from pp_offload.recipe.preflight import check_model_sources

WORDS = (
    "the a model pipeline stage rank learns loss falls data token shard offload memory host device".split()
)


def _jsonl(path: Path, rows: int = 120, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(rows):
            prompt = " ".join(rng.choice(WORDS) for _ in range(8))
            response = " ".join(rng.choice(WORDS) for _ in range(12))
            f.write(json.dumps({"prompt": f"Q{i}: {prompt}?", "response": f"{response}."}) + "\n")
    return path


def test_trained_tokenizer_is_kept_for_the_same_texts_and_retrained_for_others(tmp_path: Path) -> None:
    data = DataConfig(
        path=str(_jsonl(tmp_path / "a.jsonl")), prompt_column="prompt", response_column="response"
    )
    examples = load_examples(data, cache_dir=tmp_path / "cache")
    first = trained_tokenizer(examples, data, tmp_path / "run", vocab_size=300)
    saved = tmp_path / "run" / "tokenizer"
    assert (saved / "tokenizer.json").is_file() and first.eos_token == "<|endoftext|>"
    assert 257 < len(first) <= 300
    text = "Q7: the pipeline learns? loss falls."
    assert first.decode(first(text)["input_ids"]) == text  # byte-level: lossless
    stamp = (saved / "trained_on.json").read_text()
    again = trained_tokenizer(examples, data, tmp_path / "run", vocab_size=300)
    assert (saved / "trained_on.json").read_text() == stamp and again.get_vocab() == first.get_vocab()

    other = DataConfig(path=str(_jsonl(tmp_path / "b.jsonl", seed=1)), text_column="response")
    other_examples = load_examples(other, cache_dir=tmp_path / "cache")
    kept = trained_tokenizer(other_examples, other, tmp_path / "run", vocab_size=300, keep_existing=True)
    assert kept.get_vocab() == first.get_vocab()  # a resumed run keeps its token ids
    retrained = trained_tokenizer(other_examples, other, tmp_path / "run", vocab_size=300)
    assert (saved / "trained_on.json").read_text() != stamp and retrained.get_vocab() != first.get_vocab()
    assert not [p.name for p in (tmp_path / "run").iterdir() if p.name != "tokenizer"]  # no leftovers


def _model_dir(tmp_path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    from pp_offload.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([" ".join(WORDS)] * 4, vocab_size=300)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=len(tokenizer)))
    full = tmp_path / "full"
    model.save_pretrained(full)
    tokenizer.save_pretrained(full)
    return full


def test_a_model_directory_missing_weights_or_tokenizer_names_the_keys_that_provide_them(
    tmp_path: Path,
) -> None:
    full = _model_dir(tmp_path)
    check_model_sources(load_config(None, [f"model.path={full}"]))
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(full / "config.json", config_only)
    with pytest.raises(
        ConfigError, match=r"holds a config.json but no weights .*model\.config.*model\.tokenizer"
    ):
        check_model_sources(load_config(None, [f"model.path={config_only}"]))
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(full / name, no_tokenizer)
    with pytest.raises(ConfigError, match=r"holds no tokenizer .*set model\.tokenizer"):
        check_model_sources(load_config(None, [f"model.path={no_tokenizer}"]))
    check_model_sources(load_config(None, [f"model.path={no_tokenizer}", f"model.tokenizer={full}"]))
    with pytest.raises(ConfigError, match=r"model\.tokenizer='.*config_only' is not a tokenizer directory"):
        check_model_sources(load_config(None, [f"model.path={full}", f"model.tokenizer={config_only}"]))
    with pytest.raises(ConfigError, match=r"model\.path='\./nowhere': no such directory"):
        check_model_sources(load_config(None, ["model.path=./nowhere"]))
    with pytest.raises(ConfigError, match=r"model\.tokenizer=train trains a new tokenizer"):
        load_config(None, [f"model.path={full}", "model.tokenizer=train"]).validated()


def _config(tmp_path: Path) -> Path:
    data = _jsonl(tmp_path / "mine.jsonl")
    path = tmp_path / "mine.yaml"
    path.write_text(
        "model:\n  config: {model_type: gpt2, n_layer: 4, n_embd: 32, n_head: 2}\n  tokenizer: train\n"
        f"data: {{path: {data}, prompt_column: prompt, response_column: response, seq_len: 32}}\n"
        "pipeline: {schedule: ScheduleVHalf, microbatches: 2}\n"
        f"train: {{steps: 2, global_batch_size: 4}}\noutput: {{dir: {tmp_path / 'run'}}}\n"
    )
    return path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.prompt_column=question"],
            r"column 'question' not found .*its columns are \['prompt', 'response'\]",
        ),
        (["train.eval_every=null"], r"train\.eval_every=null must be an int >= 0"),
        (["model.config.n_layer=3"], r"use at most 1 pipeline rank .*: with 4 processes, --dp 4 "),
        (["pipeline.schedule=ScheduleVHlaf"], r"did you mean 'ScheduleVHalf'\?"),
        (["data.chat_template=true"], r"model\.tokenizer=train: chat_template .* use prompt_template"),
        (["model.config.n_head=3"], r"cannot build a 'gpt2' model .*divisible by num_heads"),
        (["model.config.model_type=bert"], r"BertLMHeadModel \(model_type='bert'\) cannot be split"),
        (["model.config.model_type=gpt3"], r"model\.config \(model_type='gpt3'\): Unrecognized model"),
        (["model.config={model_type: llama, hidden_size: 64, num_attention_heads: 3}"], r"not a multiple of"),
    ],
)
def test_pp_offload_train_stops_a_bad_config_in_one_line_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    config = _config(tmp_path)
    argv = ["train", "--nproc-per-node", "4", "--dp", "2", "--config", str(config), "--check"]
    for item in overrides:
        argv += ["--set", item]
    assert pp_offload_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("finetune: configuration error: ")
    assert __import__("re").search(message, captured.err), captured.err


def test_pp_offload_train_check_trains_the_tokenizer_the_ranks_then_reuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    assert pp_offload_main(["train", "--nproc-per-node", "2", "--config", str(config), "--check"]) == 0
    assert "configuration ok for 2 process(es)" in capsys.readouterr().out
    assert (tmp_path / "run" / "tokenizer" / "trained_on.json").is_file()


def test_a_configuration_error_is_printed_once_per_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 prints at once; another rank first waits (the launcher ends it there when rank 0 found the
    same error), then prints, naming itself: an error only it found is not lost."""
    from pp_offload.recipe import cli

    waited: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)
    cli.report_configuration_error(ConfigError("train.steps=0 must be an int >= 1"), "0")
    assert capsys.readouterr().err == "finetune: configuration error: train.steps=0 must be an int >= 1\n"
    assert not waited
    cli.report_configuration_error(ConfigError("rank 3 needs its own GPU"), "3")
    assert capsys.readouterr().err == "finetune: rank 3: configuration error: rank 3 needs its own GPU\n"
    assert waited == [cli.PEER_REPORT_DELAY_S]
