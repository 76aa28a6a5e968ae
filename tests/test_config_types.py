"""Every config key refuses a value of the wrong type, and null where null is not allowed, with one line
naming the key (pp_offload/recipe/config_types.py); numbers read as YAML 1.2."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import pytest

from pp_offload.recipe.config import RecipeConfig, load_config
from pp_offload.recipe.config import _section_class as section_class
from pp_offload.recipe.config_types import CHOICES, RANGES

SECTIONS = [f.name for f in dataclasses.fields(RecipeConfig)]


def _keys() -> list[tuple[str, str, Any]]:
    """(section, key, type hint) of every key of every section."""
    out = []
    for section in SECTIONS:
        cls = section_class(section)
        hints = typing.get_type_hints(cls)
        out += [(section, f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    return out


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _wrong_value(hint: Any) -> Any:
    """A YAML value no member of ``hint`` accepts: a mapping where strings are allowed (and no mapping
    is), a word where they are not."""
    members = _members(hint)
    takes_mapping = any(m is dict or typing.get_origin(m) is dict for m in members)
    return "[1, {a: 2}]" if takes_mapping else ("{a: 1}" if str in members else "not-a-number")


KEYS = _keys()
TYPED = [(s, k, h) for s, k, h in KEYS if h is not Any]


def test_the_walk_covers_every_key() -> None:
    assert len(KEYS) >= 60 and all(
        s in {"model", "data", "pipeline", "train", "output", "lora"} for s, _, _ in KEYS
    )
    assert {k for _, k, h in KEYS if h is Any} <= {"offload"}  # the one free-form key, checked by its parser


@pytest.mark.parametrize(("section", "key", "hint"), TYPED, ids=[f"{s}.{k}" for s, k, _ in TYPED])
def test_every_key_refuses_a_wrong_type_in_one_line(section: str, key: str, hint: Any) -> None:
    wrong = _wrong_value(hint)
    with pytest.raises(ValueError) as caught:
        load_config(None, [f"{section}.{key}={wrong}"])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{section}.{key}="), message
    assert " must be " in message, message


NOT_NULL = [(s, k, h) for s, k, h in TYPED if type(None) not in _members(h)]


@pytest.mark.parametrize(("section", "key", "hint"), NOT_NULL, ids=[f"{s}.{k}" for s, k, _ in NOT_NULL])
def test_null_is_refused_where_the_type_has_no_none(section: str, key: str, hint: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{section}\.{key}=null must be "):
        load_config(None, [f"{section}.{key}=null"])


def test_the_issue_cases_and_the_range_and_choice_tables() -> None:
    with pytest.raises(ValueError, match=r"^train\.eval_every=null must be an int >= 0$"):
        load_config(None, ["train.eval_every=null"])
    with pytest.raises(ValueError, match=r"^train\.precision='fp16' must be one of fp32, bf16$"):
        load_config(None, ["train.precision=fp16"])
    with pytest.raises(
        ValueError, match=r"^pipeline\.memory_limit=2 must be a number in \(0, 1\], or null; a fraction"
    ):
        load_config(None, ["pipeline.memory_limit=2"])
    with pytest.raises(
        ValueError,
        match=r"^output\.report_to=\['csv', 'comet'\] must be a list of: csv, tensorboard, wandb, mlflow",
    ):
        load_config(None, ["output.report_to=[csv, comet]"])
    with pytest.raises(ValueError, match=r"unknown key output\.metrics: it is now output\.report_to"):
        load_config(None, ["output.metrics=[csv]"])
    with pytest.raises(
        ValueError, match=r"^train\.betas=\[0\.9\] must be a list of 2 numbers, each in \[0, 1\)$"
    ):
        load_config(None, ["train.betas=[0.9]"])
    known = {f"{s}.{k}" for s, k, _ in KEYS} | {"model.tokenizer_vocab_size"}
    assert set(RANGES) <= known and set(CHOICES) <= known  # no stale entry


def test_numbers_read_as_yaml_1_2_and_convert_to_the_field_type(tmp_path) -> None:
    config = load_config(
        None,
        [
            "model.config={model_type: gpt2}",
            "model.config.initializer_range=1e20",  # YAML 1.1 (PyYAML): the string '1e20'
            "train.lr=3e-4",
            "train.steps=1e3",  # an int field given an integral float
            "train.timeout_s=60",  # a float field given an int
            "train.max_grad_norm='0.5'",  # a quoted number
        ],
    )
    assert config.model.config["initializer_range"] == 1e20
    assert config.train.lr == 3e-4 and config.train.steps == 1000 and isinstance(config.train.steps, int)
    assert isinstance(config.train.timeout_s, float) and config.train.max_grad_norm == 0.5
    path = tmp_path / "c.yaml"
    path.write_text(
        "train:\n  lr: 1e-5\n  seed: 7\nmodel:\n  config: {model_type: llama, rms_norm_eps: 1e-6}\n"
    )
    from_file = load_config(path)
    assert from_file.train.lr == 1e-5 and from_file.model.config["rms_norm_eps"] == 1e-6
    assert load_config(None, ["data.name=2019"]).data.name == "2019"  # an int where a name is meant


def test_a_config_built_in_python_is_checked_too() -> None:
    config = RecipeConfig()
    config.train.eval_every = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"^train\.eval_every=null must be an int >= 0$"):
        config.validated()
