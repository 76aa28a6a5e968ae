"""Check every recipe config value against its dataclass field's type hint, and numbers against their range.

Why generic: a value of the wrong type (``train.eval_every: null``, ``train.lr: fast``) used to pass the
reader and fail minutes later, on every rank, deep in the code that first used it (``TypeError: '<' not
supported between NoneType and int``). Driven by the type hints of the config dataclasses, every key is
checked the day it is added, and the error is one line naming the key, the value and what it may be.

Numbers are read leniently where that is unambiguous: an int where a float is expected, a string that
parses as the number (``"1e-4"``: YAML 1.1, which PyYAML implements, reads an exponent without a dot as a
string), a float with an integral value where an int is expected (``1e3``), an int where a string is
expected (``name: 2019``). Everything else is strict.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

__all__ = ["CHOICES", "RANGES", "ConfigTypeError", "Range", "check_section", "describe"]


class ConfigTypeError(ValueError):
    """A config value of the wrong type or out of range; the message is one line naming the key."""


@dataclass(frozen=True)
class Range:
    """Allowed numbers: ``low`` to ``high`` (None: unbounded), each end open or closed."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def describe(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_POSITIVE = Range(1)
_NON_NEGATIVE = Range(0)
_ABOVE_ZERO = Range(0, low_open=True)
_FRACTION = Range(0, 1)

#: Numeric ranges by ``section.key`` (for a list, tuple or mapping: each of its numbers).
RANGES: dict[str, Range] = {
    "data.seq_len": _POSITIVE,
    "data.max_examples": _POSITIVE,
    "data.eval_max_examples": _POSITIVE,
    "data.num_proc": _POSITIVE,
    "model.tokenizer_vocab_size": Range(257),
    "pipeline.microbatches": _POSITIVE,
    "pipeline.pp": _POSITIVE,
    "pipeline.dp": _POSITIVE,
    "pipeline.dp_replicate": _POSITIVE,
    "pipeline.stages_per_rank": _POSITIVE,
    "pipeline.layers_per_stage": _POSITIVE,
    "pipeline.memory_limit": Range(0, 1, low_open=True),
    "pipeline.activation_budget_gib": _ABOVE_ZERO,
    "pipeline.auto_probe_steps": _POSITIVE,
    "pipeline.costs": _NON_NEGATIVE,
    "train.steps": _POSITIVE,
    "train.global_batch_size": _POSITIVE,
    "train.lr": _NON_NEGATIVE,
    "train.min_lr_ratio": _FRACTION,
    "train.warmup_steps": _NON_NEGATIVE,
    "train.warmup_ratio": Range(0, 1, high_open=True),
    "train.weight_decay": _NON_NEGATIVE,
    "train.betas": Range(0, 1, high_open=True),
    "train.adam_eps": _ABOVE_ZERO,
    "train.max_grad_norm": _ABOVE_ZERO,
    "train.seed": _NON_NEGATIVE,
    "train.timeout_s": _ABOVE_ZERO,
    "train.eval_every": _NON_NEGATIVE,
    "train.eval_batches": _POSITIVE,
    "train.max_bad_steps": _POSITIVE,
    "train.stall_timeout": _ABOVE_ZERO,
    "output.save_every": _NON_NEGATIVE,
    "output.keep": _POSITIVE,
    "output.log_every": _NON_NEGATIVE,
    "lora.r": _POSITIVE,
    "lora.alpha": _ABOVE_ZERO,
    "lora.dropout": Range(0, 1, high_open=True),
}

#: Allowed strings by ``section.key`` (for a list: each of its strings).
CHOICES: dict[str, tuple[str, ...]] = {
    "train.lr_schedule": ("cosine", "linear", "constant"),
    "train.optimizer": ("adamw", "adamw_foreach", "adamw_fused", "adamw_torch", "adamw_torch_fused"),
    "train.extend_lr": ("continue", "recompute"),
    "train.precision": ("fp32", "bf16"),
    "train.device": ("auto", "cpu", "cuda"),
    "output.report_to": ("csv", "tensorboard", "wandb", "mlflow", "trackio"),
}

#: A few words more for keys whose type alone does not say enough (or whose usual mistake is a YAML habit).
_HINTS = {
    "data.prompt_template": "quote it in YAML: an unquoted {prompt} is read as a mapping",
    "pipeline.memory_limit": "a fraction of 1F1B's activation memory, e.g. 0.5",
    "train.max_bad_steps": "consecutive non-finite steps skipped before the run stops",
    "train.stall_timeout": "seconds a step may make no progress; null: no stall watch",
}


class _Mismatch(Exception):
    """Internal: the value does not fit the hint."""


def check_section(cls: type, section: str, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (raw, from YAML) of dataclass ``cls`` checked against its type hints and `RANGES` /
    `CHOICES`, numbers converted to the field's type. Raises `ConfigTypeError` naming the first bad key."""
    hints = typing.get_type_hints(cls)
    checked = dict(values)
    for field in dataclasses.fields(cls):
        if field.name not in values:
            continue
        key = f"{section}.{field.name}"
        value = values[field.name]
        hint = hints[field.name]
        try:
            checked[field.name] = _coerce(value, hint, key)
        except _Mismatch:
            allowed = describe(hint, key)
            hint_text = f"; {_HINTS[key]}" if key in _HINTS else ""
            raise ConfigTypeError(f"{key}={_show(value)} must be {allowed}{hint_text}") from None
    return checked


def describe(hint: Any, key: str = "") -> str:
    """What a value of ``hint`` may be, in words, with ``key``'s choices or range (``an int >= 1``,
    ``one of fp32, bf16``, ``a number in (0, 1], or null``)."""
    if hint is Any:
        return "anything"
    members = [m for m in _members(hint) if m is not type(None)]
    if key in CHOICES:
        listed = ", ".join(CHOICES[key])
        words = f"one of {listed}" if members == [str] else f"a list of: {listed}"
    else:
        words = " or ".join(_describe(m) for m in members)
    if key in RANGES:
        scalar = all(m in (int, float) for m in members)
        words += f" {RANGES[key].describe()}" if scalar else f", each {RANGES[key].describe()}"
    if _allows_none(hint):
        words += ", or null"
    return words


def _describe(hint: Any) -> str:
    if hint is Any:
        return "anything"
    if hint is type(None):
        return "null"
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an int"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in sorted(args, key=lambda a: a is type(None)))
    if origin is list:
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(args[0])}"
        return f"a list of {len(args)} {_plural(args[0])}" if len(set(args)) == 1 else f"a list {list(args)}"
    if origin is dict:
        return f"a mapping of {_plural(args[1])}" if args and args[1] is not Any else "a mapping"
    return getattr(hint, "__name__", str(hint))


def _plural(hint: Any) -> str:
    return {int: "ints", float: "numbers", str: "strings", bool: "booleans"}.get(hint, _describe(hint))


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _allows_none(hint: Any) -> bool:
    return type(None) in _members(hint)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """``value`` as ``hint`` (and within ``key``'s range / choices), or `_Mismatch`."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
        # exact types first: "3" for ``str | int`` stays a string, 3 for ``int | float`` stays an int
        for exact in (True, False):
            for member in members:
                try:
                    return _coerce_one(value, member, key, exact=exact)
                except _Mismatch:
                    pass
        raise _Mismatch
    return _coerce_one(value, hint, key, exact=False)


def _coerce_one(value: Any, hint: Any, key: str, *, exact: bool) -> Any:
    if hint is Any:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if value is None:
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint in (int, float):
        return _in_range(_number_of(value, hint, exact=exact), key)
    if hint is str:
        if isinstance(value, int) and not isinstance(value, bool) and not exact:
            value = str(value)  # ``name: 2019``: YAML reads an int where a name was meant
        if not isinstance(value, str):
            raise _Mismatch
        if key in CHOICES and value not in CHOICES[key]:
            raise _Mismatch
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        return [_coerce(v, args[0], key) for v in value] if args else list(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], key) for v in value)
        if len(value) != len(args):
            raise _Mismatch
        return tuple(_coerce(v, a, key) for v, a in zip(value, args, strict=True))
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        if not args:
            return dict(value)
        return {_coerce(k, args[0], ""): _coerce(v, args[1], key) for k, v in value.items()}
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch
    return value  # a hint this checker does not know: the dataclass's own checks decide


def _number_of(value: Any, hint: type, *, exact: bool) -> int | float:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, hint):
        return value
    if exact:
        raise _Mismatch
    if hint is float and isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            parsed = float(value.strip()) if hint is float else _int_text(value.strip())
        except ValueError:
            raise _Mismatch from None
        return parsed
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    raise _Mismatch


def _int_text(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        number = float(text)  # "1e3"
        if not number.is_integer():
            raise
        return int(number)


def _in_range(number: int | float, key: str) -> int | float:
    if key in RANGES and not RANGES[key].contains(float(number)):
        raise _Mismatch
    return number


def _show(value: Any) -> str:
    """``value`` as it would be written in YAML (``null``, ``true``, ``'text'``, ``[1, 2]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return repr(value)
