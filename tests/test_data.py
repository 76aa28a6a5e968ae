"""The data pipeline: loading, packing math (checked by hand), batching, and the offline embedded assets."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pp_offload.data import (
    DataConfig,
    DataError,
    EmbeddedAssets,
    PackedBatches,
    default_cache_dir,
    embedded_assets,
    embedded_dir,
    format_examples,
    load_examples,
    loading,
    pack_examples,
)

pytestmark = pytest.mark.usefixtures("quiet_datasets")

# A word-level vocabulary small enough to pack by hand: "a b c" is [1, 2, 3].
VOCAB = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 7, "h": 8, "Q": 9, "R": 10}


def _word_tokenizer(*, eos: bool = True) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>" if eos else None)


def _texts(*texts: str | None) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": list(texts)})


def _rows(packed: datasets.Dataset) -> list[dict[str, list[int]]]:
    return [packed[i] for i in range(len(packed))]


# ---------------------------------------------------------------- packing


def test_pack_plain_blocks_by_hand():
    # Stream: a b c <eos> | d e <eos> | f g h a b <eos>  = [1 2 3 0 4 5 0 6 7 8 1 2 0], 13 tokens.
    # seq_len 4: block i is stream[4i : 4i + 5]; (13 - 1) // 4 = 3 blocks, nothing left over.
    packed = pack_examples(_texts("a b c", "d e", "f g h a b"), _word_tokenizer(), DataConfig(seq_len=4))
    assert packed.column_names == ["input_ids", "labels", "position_ids"]
    assert _rows(packed) == [
        # "d" opens document 2: no target for it. Document 1 is at positions 0..3.
        {"input_ids": [1, 2, 3, 0], "labels": [2, 3, 0, -100], "position_ids": [0, 1, 2, 3]},
        # "d e <eos>" continues from block 0 (positions restart at the block start), then "f" opens doc 3.
        {"input_ids": [4, 5, 0, 6], "labels": [5, 0, -100, 7], "position_ids": [0, 1, 2, 0]},
        # Doc 3 started in block 1, so its positions restart at this block's start; the last label is eos.
        {"input_ids": [7, 8, 1, 2], "labels": [8, 1, 2, 0], "position_ids": [0, 1, 2, 3]},
    ]


def test_pack_position_ids_make_transformers_see_separate_documents():
    from transformers.masking_utils import find_packed_sequence_indices

    packed = pack_examples(_texts("a b c", "d e", "f g h a b"), _word_tokenizer(), DataConfig(seq_len=4))
    position_ids = torch.tensor(packed[1]["position_ids"])[None]
    assert find_packed_sequence_indices(position_ids).tolist() == [[0, 0, 0, 1]]


def test_pack_sft_masks_prompt_targets_only():
    examples = datasets.Dataset.from_dict({"q": ["a b", "Q"], "r": ["c d", "R R"]})
    config = DataConfig(prompt_column="q", response_column="r", seq_len=4)
    # Stream: [a b | c d <eos>] [Q | R R <eos>] = [1 2 3 4 0 9 10 10 0]; prompts a b and Q; 2 blocks.
    assert _rows(pack_examples(examples, _word_tokenizer(), config)) == [
        # Target "b" is a prompt token: masked. "c" (the first response token, predicted from the prompt)
        # is learned.
        {"input_ids": [1, 2, 3, 4], "labels": [-100, 3, 4, 0], "position_ids": [0, 1, 2, 3]},
        # "Q" opens the next example and is a prompt token; "R R <eos>" is learned.
        {"input_ids": [0, 9, 10, 10], "labels": [-100, 10, 10, 0], "position_ids": [0, 0, 1, 2]},
    ]


# A chat template in the word vocabulary: the user turn is "Q ...", the assistant turn "R ... h".
WORD_CHAT = (
    "{% for m in messages %}{% if m['role'] == 'user' %}Q {{ m['content'] }} "
    "{% else %}R {{ m['content'] }} h {% endif %}{% endfor %}{% if add_generation_prompt %}R {% endif %}"
)


def _chat_tokenizer(template: str | None = WORD_CHAT) -> PreTrainedTokenizerFast:
    tokenizer = _word_tokenizer()
    tokenizer.name_or_path = "tiny-words"
    tokenizer.chat_template = template
    return tokenizer


def test_pack_sft_prompt_template_is_masked_with_the_prompt():
    examples = datasets.Dataset.from_dict({"q": ["a b", "c"], "r": ["d", "e f"]})
    config = DataConfig(prompt_column="q", response_column="r", prompt_template="Q\n{prompt} R\n", seq_len=11)
    # Stream: [Q a b R | d <eos>] [Q c R | e f <eos>] = [9 1 2 10 4 0 9 3 10 5 6 0]: the template's Q and R
    # are prompt tokens like a and b; only d, e f and the eos after them are learned.
    assert _rows(pack_examples(examples, _word_tokenizer(), config)) == [
        {
            "input_ids": [9, 1, 2, 10, 4, 0, 9, 3, 10, 5, 6],
            "labels": [-100, -100, -100, 4, 0, -100, -100, -100, 5, 6, 0],
            "position_ids": [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4],
        }
    ]


def test_pack_sft_prompt_template_reads_other_columns():
    examples = datasets.Dataset.from_dict({"q": ["a", "a"], "ctx": ["b c", None], "r": ["d", "d"]})
    config = DataConfig(
        prompt_column="q", response_column="r", prompt_template="Q {prompt} {ctx} R", seq_len=11
    )
    # [Q a b c R | d <eos>] [Q a R | d <eos>]: a missing (None) value is empty text.
    assert _rows(pack_examples(examples, _word_tokenizer(), config)) == [
        {
            "input_ids": [9, 1, 2, 3, 10, 4, 0, 9, 1, 10, 4],
            "labels": [-100, -100, -100, -100, 4, 0, -100, -100, -100, 4, 0],
            "position_ids": [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
        }
    ]
    formatted = format_examples(examples, config)
    assert formatted.to_dict() == {"prompt": ["Q a b c R", "Q a  R"], "response": ["d", "d"]}
    # The formatted texts, packed as plain prompt/response columns, are exactly what the template packs.
    plain = DataConfig(prompt_column="prompt", response_column="response", seq_len=11)
    assert _rows(pack_examples(formatted, _word_tokenizer(), plain)) == _rows(
        pack_examples(examples, _word_tokenizer(), config)
    )


def test_pack_sft_chat_template_masks_up_to_the_assistant_content():
    examples = datasets.Dataset.from_dict({"q": ["a b", "c"], "r": ["d", "e f"]})
    config = DataConfig(prompt_column="q", response_column="r", chat_template=True, seq_len=13)
    # Prompt: the user turn plus the generation prompt, "Q a b R"; learned: the assistant's content, the
    # template's end of turn "h" and the eos. Stream [9 1 2 10 | 4 8 0] [9 3 10 | 5 6 8 0].
    assert _rows(pack_examples(examples, _chat_tokenizer(), config)) == [
        {
            "input_ids": [9, 1, 2, 10, 4, 8, 0, 9, 3, 10, 5, 6, 8],
            "labels": [-100, -100, -100, 4, 8, 0, -100, -100, -100, 5, 6, 8, 0],
            "position_ids": [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5],
        }
    ]
    assert format_examples(examples, config, _chat_tokenizer()).to_dict() == {
        "prompt": ["Q a b R ", "Q c R "],
        "response": ["d h ", "e f h "],
    }


def test_pack_sft_chat_template_with_a_bpe_tokenizer(assets):
    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    examples = datasets.Dataset.from_dict({"q": ["What is a lambda?"], "r": ["An anonymous function."]})
    head = "<|im_start|>user\nWhat is a lambda?<|im_end|>\n<|im_start|>assistant\n"
    tail = "An anonymous function.<|im_end|>\n"
    n_head = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    n_tail = len(tokenizer(tail, add_special_tokens=False)["input_ids"])
    config = DataConfig(prompt_column="q", response_column="r", chat_template=True, seq_len=n_head + n_tail)
    [row] = _rows(pack_examples(examples, tokenizer, config))
    assert row["labels"][: n_head - 1] == [-100] * (n_head - 1)
    learned = row["labels"][n_head - 1 :]
    assert -100 not in learned and tokenizer.decode(learned) == tail + tokenizer.eos_token
    assert tokenizer.decode(row["input_ids"][:n_head]) == head


def test_prompt_formatting_errors():
    sft = {"prompt_column": "q", "response_column": "r"}
    with pytest.raises(DataError, match="prompt_template or chat_template, not both"):
        DataConfig(prompt_template="{prompt}", chat_template=True, **sft)
    for option in ({"prompt_template": "Q {prompt}"}, {"chat_template": True}):
        with pytest.raises(DataError, match="needs prompt_column and response_column"):
            DataConfig(**option)
    with pytest.raises(DataError, match=r"has no \{prompt\} placeholder"):
        DataConfig(prompt_template="Q {q}", **sft)
    with pytest.raises(DataError, match="not a valid format string"):
        DataConfig(prompt_template="Q {prompt", **sft)
    for bad in ("{prompt} {0}", "{prompt.upper}", "{prompt!r}", "{prompt:>9}", "{prompt} {}"):
        with pytest.raises(DataError, match="not a plain name"):
            DataConfig(prompt_template=bad, **sft)
    with pytest.raises(DataError, match="must be a string.*quote"):
        DataConfig(prompt_template={"prompt": None}, **sft)  # YAML's reading of an unquoted {prompt}
    assert DataConfig(prompt_template="{{literal}} {prompt}", **sft).columns == ("q", "r")


def test_prompt_template_missing_column_is_named(tmp_path):
    examples = datasets.Dataset.from_dict({"q": ["a"], "r": ["b"]})
    config = DataConfig(
        prompt_column="q", response_column="r", prompt_template="{prompt} {context}", seq_len=1
    )
    assert config.columns == ("q", "r", "context")
    with pytest.raises(DataError, match=r"prompt_template names column 'context'.*\['q', 'r'\]"):
        pack_examples(examples, _word_tokenizer(), config)
    file = _write_jsonl(tmp_path / "d.jsonl", [{"q": "a", "r": "b"}])
    with pytest.raises(DataError, match=r"prompt_template names column 'context'.*\['q', 'r'\]"):
        load_examples(DataConfig(**{**config.__dict__, "path": str(file)}), cache_dir=tmp_path)


def test_chat_template_errors():
    examples = datasets.Dataset.from_dict({"q": ["a"], "r": ["b"]})
    config = DataConfig(prompt_column="q", response_column="r", chat_template=True, seq_len=1)
    with pytest.raises(DataError, match="tokenizer 'tiny-words' has no chat template; use prompt_template"):
        pack_examples(examples, _chat_tokenizer(None), config)
    # The generation prompt is "S", the assistant turn "R": the conversation does not start with the prompt.
    odd = WORD_CHAT.replace("{% if add_generation_prompt %}R", "{% if add_generation_prompt %}S")
    with pytest.raises(DataError, match="chat template of tokenizer 'tiny-words' does not render"):
        pack_examples(examples, _chat_tokenizer(odd), config)


def _stream_and_starts(docs: list[list[int]]) -> tuple[list[int], set[int]]:
    stream, starts = [], set()
    for doc in docs:
        starts.add(len(stream))
        stream += [*doc, 0]
    return stream, starts


def test_pack_loses_no_token_and_masks_exactly_the_document_starts():
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 9, size=rng.integers(1, 12))) for _ in range(40)]
    text = [" ".join("abcdefgh"[t - 1] for t in doc) for doc in docs]
    seq_len = 7
    packed = pack_examples(_texts(*text), _word_tokenizer(), DataConfig(seq_len=seq_len))
    stream, starts = _stream_and_starts(docs)
    assert len(packed) == (len(stream) - 1) // seq_len
    for i, row in enumerate(_rows(packed)):
        block = stream[i * seq_len : i * seq_len + seq_len + 1]
        assert row["input_ids"] == block[:-1]
        expected = [-100 if i * seq_len + j + 1 in starts else t for j, t in enumerate(block[1:])]
        assert row["labels"] == expected
        for j, position in enumerate(row["position_ids"]):
            at = i * seq_len + j
            doc_start = max(s for s in starts if s <= at)
            assert position == at - max(doc_start, i * seq_len)


def test_pack_skips_empty_and_missing_texts():
    with_blanks = pack_examples(_texts("a b", "", None, "c d e"), _word_tokenizer(), DataConfig(seq_len=3))
    without = pack_examples(_texts("a b", "c d e"), _word_tokenizer(), DataConfig(seq_len=3))
    assert _rows(with_blanks) == _rows(without)


def test_pack_too_little_data_says_how_much():
    with pytest.raises(DataError, match=r"3 tokens .* seq_len=4 needs at least 5"):
        pack_examples(_texts("a b"), _word_tokenizer(), DataConfig(seq_len=4))


def test_pack_needs_an_eos_token():
    with pytest.raises(DataError, match="no eos token"):
        pack_examples(_texts("a b c d e f"), _word_tokenizer(eos=False), DataConfig(seq_len=2))


def test_pack_checks_columns():
    with pytest.raises(DataError, match=r"'body'.*\['text'\]"):
        pack_examples(_texts("a b c"), _word_tokenizer(), DataConfig(text_column="body", seq_len=2))


# ---------------------------------------------------------------- config and loading


def test_config_needs_both_sft_columns():
    with pytest.raises(DataError, match="both prompt_column and response_column"):
        DataConfig(prompt_column="q")
    with pytest.raises(DataError, match="seq_len"):
        DataConfig(seq_len=0)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_load_local_files_by_extension(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["first document", "second one", "third"]
    (tmp_path / "d.txt").write_text("\n".join(texts) + "\n")
    _write_jsonl(tmp_path / "d.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)])
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("text,id\n" + "".join(f"{t},{i}\n" for i, t in enumerate(texts)))
    cache = tmp_path / "cache"
    for name in ("d.txt", "d.jsonl", "d.parquet", "d.csv"):
        dataset = load_examples(DataConfig(path=str(tmp_path / name)), cache_dir=cache)
        assert dataset["text"] == texts, name
    assert (cache / "datasets").is_dir()  # the datasets cache went where it was told


def test_load_builder_name_dir_and_max_examples(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _write_jsonl(data / "train.jsonl", [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(5)])
    sft = {"prompt_column": "prompt", "response_column": "response"}
    by_builder = load_examples(
        DataConfig(path="json", data_files=str(data / "train.jsonl"), max_examples=2, **sft),
        cache_dir=tmp_path,
    )
    assert by_builder["prompt"] == ["p0", "p1"]
    by_dir = load_examples(DataConfig(path=str(data), **sft), cache_dir=tmp_path)
    assert by_dir["response"] == [f"r{i}" for i in range(5)]


def test_load_missing_column_names_the_existing_ones(tmp_path):
    file = _write_jsonl(tmp_path / "d.jsonl", [{"content": "x", "source": "y"}])
    with pytest.raises(DataError, match=r"column 'text' not found.*\['content', 'source'\]"):
        load_examples(DataConfig(path=str(file)), cache_dir=tmp_path)
    with pytest.raises(DataError, match=r"'answer'.*\['content', 'source'\]"):
        load_examples(
            DataConfig(path=str(file), prompt_column="content", response_column="answer"), cache_dir=tmp_path
        )


def test_load_bad_paths(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_examples(DataConfig(path=str(tmp_path / "missing.jsonl")), cache_dir=tmp_path)
    with pytest.raises(DataError, match="no such file"):
        load_examples(DataConfig(path="./typo.parquet"), cache_dir=tmp_path)
    (tmp_path / "d.xyz").write_text("text\n")
    with pytest.raises(DataError, match="cannot tell the format"):
        load_examples(DataConfig(path=str(tmp_path / "d.xyz")), cache_dir=tmp_path)
    with pytest.raises(DataError, match="needs data_files"):
        load_examples(DataConfig(path="json"), cache_dir=tmp_path)
    with pytest.raises(DataError, match="Unknown split"):
        file = _write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
        load_examples(DataConfig(path=str(file), split="test"), cache_dir=tmp_path)


def test_malformed_json_line_is_named(tmp_path):
    """datasets says only "An error occurred while generating the dataset"; the error names file and line,
    also when the file comes through a glob of several."""
    data = tmp_path / "data"
    data.mkdir()
    _write_jsonl(data / "a.jsonl", [{"text": "fine"}])
    (data / "b.jsonl").write_text('{"text": "one"}\n\n{"text": two}\n{"text": "four"}\n')
    with pytest.raises(DataError, match=r"b\.jsonl:3: malformed JSON line \(Expecting value"):
        load_examples(DataConfig(path=str(data / "b.jsonl")), cache_dir=tmp_path)
    with pytest.raises(DataError, match=r"b\.jsonl:3: malformed JSON line"):
        load_examples(DataConfig(path="json", data_files=str(data / "*.jsonl")), cache_dir=tmp_path)
    (tmp_path / "bad.csv").write_text('text\n"a"\n"b\n')
    with pytest.raises(DataError, match=r"cause: ParserError: .*row 2"):
        load_examples(DataConfig(path=str(tmp_path / "bad.csv")), cache_dir=tmp_path)


def test_load_hub_name_offline_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="not found locally and the hub is unreachable.*pass a local file"):
        load_examples(DataConfig(path="someone/no-such-dataset"), cache_dir=tmp_path)


def test_load_hub_name_unreachable_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(loading, "_hub_reachable", lambda: False)
    with pytest.raises(DataError, match="not found locally and the hub is unreachable.*HF_HUB_OFFLINE=1"):
        load_examples(DataConfig(path="no-such-dataset"), cache_dir=tmp_path)


def test_hub_probe_sees_a_closed_endpoint(monkeypatch):
    from pp_offload import hub

    for name in hub._PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
    assert hub.hub_reachable(timeout=2.0) is False


# ---------------------------------------------------------------- batches


def _packed(n_blocks: int, seq_len: int = 3) -> datasets.Dataset:
    """Block i holds tokens 100*i + j, its first (i % seq_len) labels masked (so counts differ by block)."""
    ids = [[100 * i + j for j in range(seq_len)] for i in range(n_blocks)]
    labels = [[-100 if j < i % seq_len else t for j, t in enumerate(row)] for i, row in enumerate(ids)]
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "labels": labels, "position_ids": [list(range(seq_len))] * n_blocks}
    )


def _block_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 0] // 100).tolist()


def test_batches_shapes_and_dtypes():
    batches = PackedBatches(_packed(10), 4, dp_rank=1, dp_size=2)
    batch = batches.batch(0)
    assert len(batches) == 2  # 10 blocks // 4, the incomplete third batch dropped
    for name in ("input_ids", "labels", "position_ids"):
        assert batch[name].dtype == torch.int64 and batch[name].shape == (2, 3)
    assert batch["num_target_tokens"].dtype == torch.int64 and batch["num_target_tokens"].dim() == 0


def test_batches_are_deterministic_and_resumable():
    packed = _packed(20)
    run = PackedBatches(packed, 4, seed=7)
    uninterrupted = [run.batch(step) for step in range(12)]  # 5 steps an epoch: crosses two epoch ends
    resumed = PackedBatches(packed, 4, seed=7)
    for step in (8, 9, 10, 11, 3):  # from a checkpoint at step 8, then a look back
        for name, value in resumed.batch(step).items():
            assert torch.equal(value, uninterrupted[step][name]), (step, name)
    assert _block_ids(PackedBatches(packed, 4, seed=8).batch(0)) != _block_ids(uninterrupted[0])


def test_batches_epochs_cover_the_blocks_in_a_new_order():
    batches = PackedBatches(_packed(13), 4, seed=0)
    assert len(batches) == 3
    epochs = [
        [block for step in range(e * 3, e * 3 + 3) for block in _block_ids(batches.batch(step))]
        for e in range(3)
    ]
    for order in epochs:
        assert len(order) == len(set(order)) == 12 and set(order) <= set(range(13))
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize("dp_size", [2, 4])
def test_batches_dp_ranks_split_one_global_batch(dp_size):
    packed = _packed(24)
    for step in (0, 5, 7):
        whole = PackedBatches(packed, 8, seed=3).batch(step)
        parts = [
            PackedBatches(packed, 8, dp_rank=r, dp_size=dp_size, seed=3).batch(step) for r in range(dp_size)
        ]
        for name in ("input_ids", "labels", "position_ids"):
            assert torch.equal(torch.cat([part[name] for part in parts]), whole[name])
        global_count = int((whole["labels"] != -100).sum())
        assert [int(part["num_target_tokens"]) for part in parts] == [global_count] * dp_size
        assert int(whole["num_target_tokens"]) == global_count


def test_batches_reject_bad_sizes():
    with pytest.raises(ValueError, match="multiple of dp_size=3"):
        PackedBatches(_packed(12), 8, dp_size=3)
    with pytest.raises(DataError, match="only 5 packed blocks, fewer than one global batch of 8"):
        PackedBatches(_packed(5), 8)
    with pytest.raises(ValueError, match="dp_rank"):
        PackedBatches(_packed(12), 8, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="step"):
        PackedBatches(_packed(12), 8).batch(-1)
    with pytest.raises(DataError, match="not a packed dataset"):
        PackedBatches(_texts(*"abcdefgh"), 2)


# ---------------------------------------------------------------- embedded assets


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def assets(cache_root) -> EmbeddedAssets:
    return embedded_assets(embedded_dir(cache_root))


def test_embedded_assets_are_reused(assets, cache_root):
    stamp = assets.corpus_file.parent / "stamp.json"
    built_at = stamp.stat().st_mtime_ns
    again = embedded_assets(embedded_dir(cache_root))
    assert again == assets and stamp.stat().st_mtime_ns == built_at
    assert [p.name for p in embedded_dir(cache_root).iterdir()] == [assets.corpus_file.parent.name]


def test_embedded_tokenizer_loads_and_round_trips(assets):
    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer_dir)
    assert len(tokenizer) == 2048 and tokenizer.eos_token == "<|endoftext|>"
    documents = [json.loads(line)["text"] for line in assets.corpus_file.read_text().splitlines()]
    assert len(documents) > 1000 and all(len(d) >= 64 for d in documents)
    for text in (documents[0], documents[-1], "Unicode ✓ and   spaces\n\ttoo <|endoftext|>"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert len(tokenizer(documents[0])["input_ids"]) < len(documents[0]) / 2  # BPE merges really happened


def test_embedded_is_the_default_data_and_packs(assets, cache_root):
    config = DataConfig(seq_len=128)
    examples = load_examples(config, cache_dir=cache_root)
    assert examples.column_names[0] == "text" and len(examples) > 1000
    packed = pack_examples(examples, AutoTokenizer.from_pretrained(assets.tokenizer_dir), config)
    assert len(packed) > 500
    batch = PackedBatches(packed, 8).batch(0)
    assert batch["input_ids"].shape == (8, 128)
    learned = batch["labels"][:, :-1] != -100
    assert torch.equal(batch["labels"][:, :-1][learned], batch["input_ids"][:, 1:][learned])


def test_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PP_OFFLOAD_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path and embedded_dir() == tmp_path / "embedded"
    monkeypatch.delenv("PP_OFFLOAD_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "pp_offload"


def test_embedded_assets_replace_a_broken_build(tmp_path):
    built = embedded_assets(tmp_path, vocab_size=300)
    stamp = built.corpus_file.parent / "stamp.json"
    stamp.write_text("{}")  # as if hand-edited or left by a buggy version
    rebuilt = embedded_assets(tmp_path, vocab_size=300)
    assert rebuilt == built and json.loads(stamp.read_text())["vocab_size"] == 300
    assert len(AutoTokenizer.from_pretrained(rebuilt.tokenizer_dir)) == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == [built.corpus_file.parent.name]  # no leftovers


def _build_after(barrier, out_dir: str, queue) -> None:
    barrier.wait()
    assets = embedded_assets(out_dir, vocab_size=300)
    queue.put((str(assets.corpus_file), (assets.tokenizer_dir / "tokenizer.json").read_bytes()))


def test_embedded_assets_concurrent_builders_agree(tmp_path):
    # Two fresh processes (like two ranks) start building at the same moment; both must succeed and see the
    # same complete files, and no temporary directory may be left behind.
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_build_after, args=(barrier, str(tmp_path), queue)) for _ in range(2)]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert results[0] == results[1]
    assert os.listdir(tmp_path) == [Path(results[0][0]).parent.name]
    assert json.loads((Path(results[0][0]).parent / "stamp.json").read_text())["vocab_size"] == 300
