"""Data at scale: chunked packing gives the blocks of the whole stream, preparation is cached by content and
shared (waiting ranks, a failing preparer), rows with nothing to learn are counted once."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pp_offload.data import DataConfig, DataError, PackedBatches, load_examples, pack_examples
from pp_offload.data.blocks import PACKED_COLUMNS, PackedBlocks
from pp_offload.data.packing import SkipCounts, pack_tokenized, tokenize_examples
from pp_offload.data.prepared import prepare

pytestmark = pytest.mark.usefixtures("quiet_datasets")

WORDS = "a b c d e f g h".split()
VOCAB = {"<eos>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}


def _tokenizer(vocab: dict[str, int] = VOCAB) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) for _ in range(n)]


def _sft_file(path: Path, n: int = 60, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 5)))
            response = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
            f.write(json.dumps({"q": prompt, "r": response}) + "\n")
    return path


def _all_rows(blocks: PackedBlocks) -> dict[str, np.ndarray]:
    return blocks.rows(np.arange(len(blocks)))


@pytest.mark.parametrize("chunk_rows", [1, 3, 7])
def test_chunked_packing_equals_packing_the_whole_stream(chunk_rows: int) -> None:
    # Blocks are cut from one stream: carrying each chunk's tail over must not move a single token.
    examples = datasets.Dataset.from_dict({"text": _documents(50)})
    config = DataConfig(seq_len=5)
    tokenized = tokenize_examples(examples, _tokenizer(), config)
    whole = PackedBlocks(
        pa.Table.from_batches(list(pack_tokenized(tokenized, 5, SkipCounts(), chunk_rows=10**6)))
    )
    chunked = PackedBlocks(
        pa.Table.from_batches(list(pack_tokenized(tokenized, 5, SkipCounts(), chunk_rows=chunk_rows)))
    )
    assert len(whole) == len(chunked) > 10
    for name, rows in _all_rows(whole).items():
        assert np.array_equal(rows, _all_rows(chunked)[name]), name
    assert np.array_equal(whole.targets, chunked.targets)
    # The stored target counts are the labels' own count.
    assert np.array_equal(whole.targets, (_all_rows(whole)["labels"] != -100).sum(axis=1))
    # And the stream, read back from the blocks, is the documents each followed by eos.
    stream = np.concatenate([_all_rows(whole)["input_ids"].reshape(-1)])
    ids = [VOCAB[w] for doc in examples["text"] for w in [*doc.split(), "<eos>"]]
    assert stream.tolist() == ids[: len(stream)]


def test_prepared_cache_is_shared_by_runs_and_keyed_by_content(tmp_path: Path) -> None:
    file = _sft_file(tmp_path / "sft.jsonl")
    config = DataConfig(path=str(file), prompt_column="q", response_column="r", seq_len=8)
    loads = []

    def examples() -> datasets.Dataset:
        loads.append(1)
        return load_examples(config, cache_dir=tmp_path / "ds")

    cache = tmp_path / "prepared"
    first = prepare(config, _tokenizer(), examples, cache_dir=cache)
    assert loads == [1] and first.info["rows"] == 60 and first.note() is None
    again = prepare(config, _tokenizer(), examples, cache_dir=cache)  # a new run, same data: nothing redone
    assert loads == [1] and again.path == first.path
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary leftovers

    # The batches read from the memory-mapped file are those of packing in memory.
    in_memory = pack_examples(examples(), _tokenizer(), config)
    for step in (0, 3):
        expect = PackedBatches(in_memory, 4, seed=5).batch(step)
        got = PackedBatches(again.blocks, 4, seed=5).batch(step)
        for name, value in expect.items():
            assert torch.equal(value, got[name]), name

    # seq_len, the tokenizer and the data file each key another entry.
    other_len = prepare(
        DataConfig(**{**config.__dict__, "seq_len": 6}), _tokenizer(), examples, cache_dir=cache
    )
    other_vocab = {**VOCAB, "a": 8, "h": 1}
    other_tok = prepare(config, _tokenizer(other_vocab), examples, cache_dir=cache)
    time.sleep(0.01)
    _sft_file(file, seed=1)
    other_data = prepare(config, _tokenizer(), examples, cache_dir=cache)
    paths = {first.path, other_len.path, other_tok.path, other_data.path}
    assert len(paths) == 4


def test_resume_on_another_dp_size_reads_the_same_global_batches(tmp_path: Path) -> None:
    config = DataConfig(
        path=str(_sft_file(tmp_path / "sft.jsonl", n=120)), prompt_column="q", response_column="r"
    )
    config.seq_len = 6
    prepared = prepare(
        config, _tokenizer(), lambda: load_examples(config, cache_dir=tmp_path), cache_dir=tmp_path
    )
    for step in (0, 7, 13):  # crosses an epoch end
        whole = PackedBatches(prepared.blocks, 8, seed=3).batch(step)
        for dp in (2, 4):
            parts = [
                PackedBatches(prepared.blocks, 8, dp_rank=r, dp_size=dp, seed=3).batch(step)
                for r in range(dp)
            ]
            for name in PACKED_COLUMNS:
                assert torch.equal(torch.cat([p[name] for p in parts]), whole[name])
            assert {int(p["num_target_tokens"]) for p in parts} == {int((whole["labels"] != -100).sum())}


def test_waiting_rank_gets_the_build_or_the_preparers_error(tmp_path: Path) -> None:
    config = DataConfig(path=str(_sft_file(tmp_path / "sft.jsonl")), prompt_column="q", response_column="r")
    config.seq_len = 8

    def examples() -> datasets.Dataset:
        return load_examples(config, cache_dir=tmp_path)

    with pytest.raises(DataError, match=r"waited 0.3 s \(train.timeout_s\) for local rank 0"):
        prepare(config, _tokenizer(), examples, cache_dir=tmp_path / "c", preparer=False, timeout_s=0.3)

    def broken() -> datasets.Dataset:
        raise DataError("column 'q' not found in dataset")

    with pytest.raises(DataError, match="^column 'q' not found in dataset$"):  # from its forked child
        prepare(config, _tokenizer(), broken, cache_dir=tmp_path / "c", in_child=True)
    # A rank that waits sees the failure the preparer left, instead of waiting out its timeout.
    start = time.monotonic()
    failed = next((tmp_path / "c").glob("*.failed"))
    os.utime(failed)  # written "now", during this rank's wait
    with pytest.raises(DataError, match="the process preparing the data failed: column 'q' not found"):
        prepare(config, _tokenizer(), examples, cache_dir=tmp_path / "c", preparer=False, timeout_s=30)
    assert time.monotonic() - start < 5
    built = prepare(config, _tokenizer(), examples, cache_dir=tmp_path / "c", in_child=True)
    assert not failed.exists() and built.info["rows"] == 60
    waited = prepare(config, _tokenizer(), examples, cache_dir=tmp_path / "c", preparer=False, timeout_s=1)
    assert waited.path == built.path


def test_null_and_empty_rows_are_counted_once(tmp_path: Path) -> None:
    file = tmp_path / "sft.parquet"
    prompts = ["a b", None, "c", "d e", ""] * 400
    responses = ["c d", "e f", None, "", "g h"] * 400
    pq.write_table(pa.table({"q": prompts, "r": responses}), file)
    config = DataConfig(path=str(file), prompt_column="q", response_column="r", seq_len=4)
    prepared = prepare(
        config, _tokenizer(), lambda: load_examples(config, cache_dir=tmp_path), cache_dir=tmp_path
    )
    assert prepared.note() == "skipped 800 of 2,000 rows: empty or null response"
    # Plain text: null and empty texts.
    text = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a b c", None, "", "d e"] * 5}), text)
    plain = DataConfig(path=str(text), seq_len=3)
    prepared = prepare(
        plain, _tokenizer(), lambda: load_examples(plain, cache_dir=tmp_path), cache_dir=tmp_path
    )
    assert prepared.note() == "skipped 10 of 20 rows: empty or null text"


def test_fast_encoding_gives_the_tokenizers_own_ids() -> None:
    from pp_offload.data.packing import _encode
    from pp_offload.data.tokenizer import train_tokenizer

    texts = ["héllo wörld  twice", "", "tabs\tand\nnewlines", "<|endoftext|> inside", "emoji 🙂 ok"] * 3
    tokenizer = train_tokenizer(texts, vocab_size=300)
    assert _encode(tokenizer, texts) == tokenizer(texts, add_special_tokens=False)["input_ids"]
    tokenizer.backend_tokenizer.enable_truncation(3)  # a backend that truncates: the tokenizer's own call
    assert _encode(tokenizer, texts) == tokenizer(texts, add_special_tokens=False)["input_ids"]


def test_trained_tokenizer_is_shared_by_runs_on_the_same_data(tmp_path: Path, monkeypatch) -> None:
    from pp_offload.data import tokenizer as tokenizer_module
    from pp_offload.data.prepared import data_identity, data_key

    config = DataConfig(path=str(_sft_file(tmp_path / "sft.jsonl")), prompt_column="q", response_column="r")
    key = data_key(data_identity(config))
    loads = []

    def examples() -> datasets.Dataset:
        loads.append(1)
        return load_examples(config, cache_dir=tmp_path)

    first = tokenizer_module.trained_tokenizer(
        examples, config, tmp_path / "run1", vocab_size=300, data_key=key, cache_dir=tmp_path / "cache"
    )
    assert loads == [1]

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", no_training)
    second = tokenizer_module.trained_tokenizer(
        examples, config, tmp_path / "run2", vocab_size=300, data_key=key, cache_dir=tmp_path / "cache"
    )
    assert loads == [1] and second.get_vocab() == first.get_vocab()  # copied: no load, no training
    assert (tmp_path / "run2" / "tokenizer" / "trained_on.json").is_file()
    _sft_file(tmp_path / "sft.jsonl", seed=3)  # other data: another key, so another tokenizer
    assert data_key(data_identity(config)) != key


def test_the_launcher_names_a_malformed_line_in_one_line_from_its_checking_child(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real launch (no --check): the checks run in a forked child, which must still report in one line,
    # with the file and the line, and start no rank.
    import subprocess

    from pp_offload.__main__ import main as pp_offload_main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "a b", "r": "c"}\n{"q": "a", "r": "b"\n')
    config = tmp_path / "c.yaml"
    data = f"{{path: {bad}, prompt_column: q, response_column: r, seq_len: 8, cache_dir: {tmp_path / 'c'}}}"
    config.write_text(
        "model:\n  config: {model_type: gpt2, n_layer: 4, n_embd: 16, n_head: 2}\n  tokenizer: train\n"
        f"data: {data}\ntrain: {{steps: 2, global_batch_size: 4}}\npipeline: {{microbatches: 2}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a rank was started"))
    assert pp_offload_main(["train", "--nproc-per-node", "2", "--config", str(config)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("finetune: configuration error: could not load"), err
    assert f"{bad}:2: malformed JSON line" in err[-1]


def test_tokenizer_fingerprint_is_the_same_in_another_process() -> None:
    # Every rank names the cache entry by it: a hash that differs between processes (set order, object
    # ids) would leave the waiting ranks waiting for an entry nobody writes.
    import subprocess
    import sys

    from pp_offload.data.prepared import tokenizer_fingerprint

    code = (
        "from tests.test_data_scale import _tokenizer\n"
        "from pp_offload.data.prepared import tokenizer_fingerprint\n"
        "print(tokenizer_fingerprint(_tokenizer()))"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": "123"}
    other = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert other.stdout.strip() == tokenizer_fingerprint(_tokenizer()), other.stderr
    assert tokenizer_fingerprint(_tokenizer({**VOCAB, "a": 8, "h": 1})) != tokenizer_fingerprint(_tokenizer())
