"""The recipe's config key reference, rendered from the config dataclasses' docstrings.

Why: a hand-written key table drifts from the code the first time someone adds a field. Here the one source
is each dataclass's Google-style ``Attributes:`` section (one ``name: text`` entry per field, continuation
lines indented further); ``docs/config.md`` is generated from it, and a test fails when the page is stale or
a field has no entry. Regenerate with ``python -m pp_offload.recipe.config_doc``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pp_offload.recipe.config import RecipeConfig, TrainConfig
from pp_offload.recipe.lr import lr_at

__all__ = [
    "DOC_PATH",
    "REGENERATE",
    "TRAINER_DEFAULTS",
    "TrainerDefault",
    "attribute_docs",
    "missing_docs",
    "render",
    "sections",
]

#: Where the generated page lives, relative to the repository root.
DOC_PATH = Path("docs") / "config.md"
REGENERATE = "python -m pp_offload.recipe.config_doc"

_HEADER = f"""# Config keys

<!-- Generated from the docstrings of pp_offload/recipe/config.py and pp_offload/data/config.py by
`{REGENERATE}`: edit the dataclasses' `Attributes:` sections, not this page. -->

Every key of the recipe's YAML config, by section, with its default. Every section and key is checked: a
typo is an error naming the closest valid key, and a value of the wrong type or out of range (`null`
included, where the key does not allow it) is an error naming the key and what it may be
(`pp_offload/recipe/config_types.py`). `--set section.key=value` overrides any key (the value is read as
YAML: `3` is an int, `1e-4` a float, as YAML 1.2 reads it, `[csv, tensorboard]` a list, `null` None), and
a key holding a mapping (`model.config`, `pipeline.costs`) can be reached into at any depth, changing one
entry and keeping the rest: `--set model.config.num_hidden_layers=4 --set model.config.rope_scaling.factor=8`.
See [recipe.md](recipe.md) for what the recipe does with them.
"""

_ENTRY = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*): ?(?P<text>.*)$")


@dataclass(frozen=True)
class TrainerDefault:
    """A recipe key whose default is not ``transformers.TrainingArguments``' (``arguments``: Trainer's
    fields, whose defaults are ``trainer``; tests/test_config_doc.py checks them against the installed
    transformers), and why."""

    key: str
    arguments: tuple[str, ...]
    trainer: tuple[Any, ...]
    why: str


#: Where the recipe's defaults are not Trainer's. The same as Trainer's: ``train.adam_eps`` (1e-8),
#: ``train.max_grad_norm`` (1.0), the loss's normalization (the accumulated batch's target tokens, Trainer's
#: ``num_items_in_batch``) and the weight-decay groups.
TRAINER_DEFAULTS = (
    TrainerDefault(
        "train.lr",
        ("learning_rate",),
        (5e-05,),
        "the examples train small models from scratch; fine-tune a pretrained model with 1e-5 to 5e-5",
    ),
    TrainerDefault(
        "train.betas",
        ("adam_beta1", "adam_beta2"),
        (0.9, 0.999),
        "beta2 0.95 is the usual setting for language models (Llama, OLMo): the second moment forgets a "
        "spike sooner, so one large gradient damps fewer of the steps after it",
    ),
    TrainerDefault(
        "train.weight_decay",
        ("weight_decay",),
        (0.0,),
        "a little decay of the weights (never of the norms and biases: the same groups as Trainer) is the "
        "usual setting for language models",
    ),
    TrainerDefault(
        "train.lr_schedule",
        ("lr_scheduler_type",),
        ("linear",),
        "cosine to a floor (`train.min_lr_ratio`, where Trainer's linear ends at 0) is the usual schedule "
        "for language models; `linear` with `min_lr_ratio: 0` is Trainer's",
    ),
    TrainerDefault(
        "train.warmup_steps",
        ("warmup_steps",),
        (0,),
        "a short warm-up keeps AdamW's first updates, made from a second moment of one or two gradients, "
        "small; the convention differs too (below)",
    ),
    TrainerDefault(
        "train.optimizer",
        ("optim",),
        ("adamw_torch_fused",),
        "torch's default AdamW runs on every device and torch version the recipe supports; "
        "`adamw_fused` is Trainer's",
    ),
    TrainerDefault(
        "train.seed",
        ("seed",),
        (42,),
        "the seed of every run so far (initialisation and batch order): another default would change all",
    ),
    TrainerDefault(
        "output.report_to",
        ("report_to",),
        ("none",),
        "`metrics.csv` needs no package and no account; add `tensorboard`, `wandb`, `mlflow` or `trackio`",
    ),
)


def _split_doc(cls: type) -> tuple[str, list[str]]:
    """The docstring before ``Attributes:`` and the lines of the section itself (dedented)."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return "\n".join(lines).strip(), []
    indent = len(lines[start]) - len(lines[start].lstrip())
    body: list[str] = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return "\n".join(lines[:start]).strip(), body


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field name: text}`` from ``cls``'s ``Attributes:`` section, continuation lines joined."""
    _, body = _split_doc(cls)
    entries: dict[str, str] = {}
    entry_indent: int | None = None
    current: str | None = None
    for line in body:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if entry_indent is None:
            entry_indent = indent
        match = _ENTRY.match(line.strip())
        if indent == entry_indent and match:
            current = match["name"]
            entries[current] = match["text"].strip()
        elif indent > entry_indent and current is not None:
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            raise ValueError(
                f"{cls.__name__}'s Attributes: section has a line that is neither 'name: text' nor an "
                f"indented continuation: {line.strip()!r}"
            )
    return entries


def sections() -> list[tuple[str, type]]:
    """The YAML sections in order, with their dataclass (from `RecipeConfig`'s fields), so a section added
    there is documented here without a change. A section is either always there (a dataclass with a
    ``default_factory``) or optional (``SomeConfig | None = None``: writing the section turns it on)."""
    hints = typing.get_type_hints(RecipeConfig)
    found = []
    for f in dataclasses.fields(RecipeConfig):
        cls = f.default_factory
        if cls is dataclasses.MISSING and f.default is None:
            members = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
            cls = members[0] if len(members) == 1 else None
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(
                f"RecipeConfig.{f.name} must be a section dataclass with a default_factory, or an "
                "optional one (`SomeConfig | None = None`)"
            )
        found.append((f.name, cls))
    return found


def _optional(section: str) -> bool:
    return next(f for f in dataclasses.fields(RecipeConfig) if f.name == section).default is None


def missing_docs(of: list[tuple[str, type]] | None = None) -> list[str]:
    """Fields without an ``Attributes:`` entry, and entries naming no field (``section.key: why``), over
    ``of`` (``(section, dataclass)`` pairs; default: the recipe's sections)."""
    problems: list[str] = []
    if of is None:  # the sections themselves are documented in RecipeConfig's docstring
        of = [("recipe", RecipeConfig), *sections()]
    for section, cls in of:
        docs = attribute_docs(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        for name in names:
            if name not in docs:
                problems.append(f"{section}.{name}: no entry in {cls.__name__}'s Attributes: section")
        for name in docs:
            if name not in names:
                problems.append(f"{section}.{name}: documented but {cls.__name__} has no such field")
    return problems


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _yaml(value: Any) -> str:
    """A default as it would be written in the YAML config."""
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _markdown(text: str) -> str:
    """reST-style ``literal`` to markdown `literal`; pipes escaped for a table cell."""
    return re.sub(r"``(.+?)``", r"`\1`", text).replace("|", "\\|")


def render() -> str:
    """The whole ``docs/config.md`` page."""
    parts = [_HEADER]
    for section, cls in sections():
        summary, _ = _split_doc(cls)
        docs = attribute_docs(cls)
        parts.append(f"## `{section}`\n")
        parts.append(re.sub(r"``(.+?)``", r"`\1`", summary) + "\n")
        if _optional(section):
            parts.append(
                f"Optional: without a `{section}:` section it is off; the section, even empty, "
                "turns it on with the defaults below.\n"
            )
        parts.append("| key | default | type | meaning |\n|---|---|---|---|")
        for f in dataclasses.fields(cls):
            default = _yaml(_default(f)).replace("|", "\\|")
            kind = str(f.type).replace("|", "\\|")
            parts.append(
                f"| `{section}.{f.name}` | `{default}` | `{kind}` | {_markdown(docs.get(f.name, ''))} |"
            )
        parts.append("")
    parts += _trainer_section()
    parts += _forms_section()
    return "\n".join(parts).rstrip() + "\n"


def _trainer_section() -> list[str]:
    """The defaults that are not Trainer's, and the first steps' learning rate under both warm-up
    conventions (ours from `pp_offload.recipe.lr.lr_at`, Trainer's from transformers' own scheduler)."""
    defaults = {f"{name}.{f.name}": _default(f) for name, cls in sections() for f in dataclasses.fields(cls)}
    parts = [
        "## Coming from transformers' Trainer\n",
        "The loss is normalized as Trainer's (the sum over the accumulated batch's target tokens divided by\n"
        "their count, Trainer's `num_items_in_batch`), weight decay skips the parameters Trainer's default\n"
        "groups skip, and `train.adam_eps` and `train.max_grad_norm` default to Trainer's values. With the\n"
        "same rows, initial weights and settings (`train.lr_schedule: linear`, `train.min_lr_ratio: 0`,\n"
        "`train.warmup_steps: 0`, `train.betas: [0.9, 0.999]`, `train.optimizer: adamw_fused`) a run\n"
        "reproduces `transformers.Trainer`'s losses and weights, in one process and pipelined\n"
        "(`tests/test_trainer_parity.py`). These defaults differ:\n",
        "| key | default | Trainer's argument | Trainer's default | why |",
        "|---|---|---|---|---|",
    ]
    for entry in TRAINER_DEFAULTS:
        ours = _yaml(defaults[entry.key])
        theirs = ", ".join(_yaml(v) for v in entry.trainer)
        arguments = ", ".join(f"`{a}`" for a in entry.arguments)
        parts.append(f"| `{entry.key}` | `{ours}` | {arguments} | `{theirs}` | {_markdown(entry.why)} |")
    parts += ["", *_warmup_table(), ""]
    return parts


def _warmup_table(lr: float = 1e-3, warmup: int = 4, steps: int = 6) -> list[str]:
    """The learning rate of the first ``steps`` steps with ``warmup`` steps of warm-up to ``lr`` (a
    constant rate after it), under the recipe's convention and Trainer's."""
    import torch
    from transformers import get_scheduler

    config = RecipeConfig(train=TrainConfig(lr=lr, warmup_steps=warmup, steps=100, lr_schedule="constant"))
    ours = [lr_at(config, k) for k in range(steps)]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup)
    theirs = []
    for _ in range(steps):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return [
        "The warm-up: step k (counted from 1) runs at `lr * k / warmup_steps`, so the first step learns and\n"
        "step `warmup_steps` runs at `lr`; Trainer's runs at `lr * (k - 1) / warmup_steps`, its first step\n"
        "at 0, and reaches `lr` one step later. The recipe keeps its convention: a step at rate 0 spends a\n"
        "batch and moves no weight, and every checkpoint written so far continues on this curve. With\n"
        f"`train.lr: {lr:g}`, `train.warmup_steps: {warmup}` (and a constant rate after it):\n",
        "| step | " + " | ".join(str(k + 1) for k in range(steps)) + " |",
        "|" + "---|" * (steps + 1),
        "| recipe | " + " | ".join(f"{v:.3g}" for v in ours) + " |",
        "| Trainer | " + " | ".join(f"{v:.3g}" for v in theirs) + " |",
    ]


def _forms_section() -> list[str]:
    """The value catalogs of ``pipeline.offload`` and ``train.activation_checkpointing``, from the tables
    the parsers themselves read (`pp_offload.order.offload.OFFLOAD_FORMS`,
    `pp_offload.recompute_plan.RECOMPUTE_FORMS`), so a form the parser learns is listed here, with which
    picker tries it by default (`pp-offload plan`'s and `schedule: auto`'s own default lists) and when it
    wins."""
    from pp_offload.order.offload import OFFLOAD_FORMS, resolve_offload
    from pp_offload.plan import auto, planner
    from pp_offload.recompute_plan import RECOMPUTE_FORMS, parse_recompute

    parts = [
        "## Offload policies (`pipeline.offload`)\n",
        "Every value `pipeline.offload` takes with a named schedule (with `schedule: auto`, a list of them\n"
        "is what auto may choose from). `pp-offload plan` compares them and prints the one to write.\n"
        '"Tried by default" names the pickers whose default candidates include it (`plan`:\n'
        "`pp-offload plan`, `auto`: `schedule: auto`); either takes any form it is given (`--offload`,\n"
        "a list in `pipeline.offload`).\n",
    ]
    parts += _form_rows(
        OFFLOAD_FORMS, {"plan": planner.DEFAULT_OFFLOAD, "auto": auto.DEFAULT_OFFLOAD}, resolve_offload
    )
    parts += [
        "",
        "## Recompute plans (`train.activation_checkpointing`)\n",
        "Every value `train.activation_checkpointing` takes besides `false` and `true`; modes, least\n"
        "recompute first: `none`, `mlp`, `selective`, `full`. `schedule: auto` judges recompute only when\n"
        "`train.activation_checkpointing` is unset.\n",
    ]
    recompute = {
        "plan": planner.DEFAULT_RECOMPUTE,
        "auto": ("none", *auto.DEFAULT_RECOMPUTE),
    }  # none: its base
    parts += _form_rows(RECOMPUTE_FORMS, recompute, parse_recompute)
    parts.append("")
    return parts


def _form_rows(forms: Any, pickers: dict[str, tuple[str, ...]], parse: Any) -> list[str]:
    """The table of ``forms``: each form, its example, what it does, the pickers among ``pickers`` whose
    default candidates hold the example (compared as parsed: ``selective`` is ``selective:0.5``), and when
    the planner picks it."""
    rows = ["| form | example | what it does | tried by default | when the planner picks it |"]
    rows.append("|---|---|---|---|---|")
    for f in forms:
        found = [
            name for name, defaults in pickers.items() if any(parse(f.example) == parse(d) for d in defaults)
        ]
        tried = ", ".join(f"`{name}`" for name in found) or "no"
        rows.append(
            f"| `{f.form}` | `{f.example}` | {_markdown(f.meaning)} | {tried} | {_markdown(f.picked)} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root (default: cwd)")
    parser.add_argument("--check", action="store_true", help="fail if the page is stale; write nothing")
    args = parser.parse_args(argv)
    problems = missing_docs()
    if problems:
        print("config fields without documentation:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    path = args.root / DOC_PATH
    text = render()
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is out of date: regenerate with `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
