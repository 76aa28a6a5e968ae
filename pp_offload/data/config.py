"""What data to train on and how to cut it: the `data:` section of a recipe.

Kept apart from the loading code so a recipe can be parsed and validated without importing `datasets`.
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass
from typing import Any

from pp_offload.data.errors import DataError

#: The placeholder of ``prompt_template`` that stands for the value of ``prompt_column``.
PROMPT_FIELD = "prompt"


@dataclass
class DataConfig:
    """Where the examples come from, which columns hold the text, and the block length.

    ``path`` is ``"embedded"`` (the offline corpus of `pp_offload.data.embedded`), a `datasets` builder name
    (``"text"``, ``"json"``, ``"parquet"``, ``"csv"``; give ``data_files``), a local file (the builder is
    chosen by its extension), a local directory, or a Hugging Face hub dataset name (``name`` picks its
    config).

    Plain language modelling reads ``text_column``. Supervised fine-tuning sets both ``prompt_column`` and
    ``response_column``: each example is prompt + response and only the response (and the eos after it) is
    learned. Two ways to turn the prompt into text before tokenization, at most one of them:

    - ``prompt_template``: a Python format string in which ``{prompt}`` is the prompt column's value and any
      other ``{name}`` is the value of column ``name`` (missing values are empty; ``{{``/``}}`` are literal
      braces), e.g. ``"### Instruction:\\n{prompt}\\n\\n### Response:\\n"``. The whole formatted prompt,
      template text included, is masked from the loss.
    - ``chat_template: true``: the tokenizer's own chat template renders a user message (the prompt) and an
      assistant message (the response). Everything before the assistant's content (what the template renders
      for the user message alone with ``add_generation_prompt=True``) is masked; the rest of the rendering
      (the response and whatever the template closes the turn with) and the eos are learned.

    Attributes:
        path: ``embedded`` (the offline corpus), a hub dataset name, a `datasets` builder (``text``,
            ``json``, ``parquet``, ``csv``) with ``data_files``, or a local file or directory.
        data_files: The files of a builder (a path or a list of paths).
        name: The hub dataset's configuration name.
        split: The split to train on.
        text_column: Plain language modelling: the column holding the text.
        prompt_column: Supervised fine-tuning: the prompt's column (its tokens are masked from the loss).
            Set together with ``response_column``.
        response_column: Supervised fine-tuning: the response's column (learned, with an EOS after it).
        prompt_template: A format string for the prompt: ``{prompt}`` and any other ``{column}``; quote it
            in YAML. The formatted prompt, template text included, is masked.
        chat_template: Format prompt and response with the tokenizer's chat template (masked up to the
            assistant's content); not together with ``prompt_template``.
        seq_len: Tokens per packed block (documents are packed, each followed by an EOS).
        max_examples: Use only the first examples of the split; ``null``: all.
        eval_split: Held-out split evaluated during training: of ``path`` (the embedded corpus has
            ``validation``), or of ``eval_path`` when that is set (default there: ``train``, a file's
            only split). Must differ from ``split`` when it is a split of ``path``.
        eval_path: Held-out examples from another source (same forms as ``path``, same columns and
            formatting).
        eval_max_examples: Read at most this many held-out examples.
        cache_dir: Root of the data caches (tokenized and packed blocks, the `datasets` cache, the
            embedded corpus); ``null``: the shared defaults (``$HF_DATASETS_CACHE/pp_offload``, by default
            under ``~/.cache/huggingface``), so every run on the machine reuses one preparation.
        num_proc: Processes tokenizing the data when it is prepared; ``null``: one per 50,000 rows, at most
            the CPU count.
        streaming: Read the data as a stream and pack it on the fly instead of preparing it: for data too
            big to prepare (hub or local). In file order, each rank tokenizes the stream and keeps its
            share; a resume re-reads the rows before its step (docs/data.md). Held-out data is prepared.
    """

    path: str = "embedded"
    data_files: str | list[str] | None = None
    name: str | None = None
    split: str = "train"
    text_column: str = "text"
    prompt_column: str | None = None
    response_column: str | None = None
    prompt_template: str | None = None
    chat_template: bool = False
    seq_len: int = 128
    max_examples: int | None = None
    eval_split: str | None = None
    eval_path: str | None = None
    eval_max_examples: int | None = None
    cache_dir: str | None = None
    num_proc: int | None = None
    streaming: bool = False

    def __post_init__(self) -> None:
        # Fail at recipe-parsing time, not after minutes of tokenization.
        if (self.prompt_column is None) != (self.response_column is None):
            raise DataError(
                "set both prompt_column and response_column (supervised fine-tuning) or neither "
                "(plain text); "
                f"got prompt_column={self.prompt_column!r}, response_column={self.response_column!r}"
            )
        if self.prompt_template is not None and self.chat_template:
            raise DataError(
                "set prompt_template or chat_template, not both: the chat template already wraps the prompt"
            )
        formats = {"prompt_template": self.prompt_template is not None, "chat_template": self.chat_template}
        for option, used in formats.items():
            if used and not self.is_sft:
                raise DataError(
                    f"{option} formats the prompt of supervised fine-tuning: it needs prompt_column and "
                    "response_column (plain text from text_column is used as it is)"
                )
        if self.prompt_template is not None:
            self.template_fields()  # raises on a malformed template
        if self.seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.max_examples is not None and self.max_examples < 1:
            raise DataError(f"max_examples must be >= 1 or None, got {self.max_examples}")
        if self.eval_max_examples is not None and self.eval_max_examples < 1:
            raise DataError(f"eval_max_examples must be >= 1 or None, got {self.eval_max_examples}")
        if self.num_proc is not None and self.num_proc < 1:
            raise DataError(f"num_proc must be >= 1 or None, got {self.num_proc}")
        if self.eval_path is None and self.eval_split is not None and self.eval_split == self.split:
            raise DataError(
                f"eval_split={self.eval_split!r} is the training split: evaluation would score the training "
                "data; name a held-out split (the embedded corpus has 'validation') or give eval_path"
            )

    @property
    def has_eval(self) -> bool:
        """Whether held-out examples are configured (``eval_split`` or ``eval_path``)."""
        return self.eval_split is not None or self.eval_path is not None

    def eval_config(self) -> DataConfig:
        """The same columns and formatting, reading the held-out examples instead of the training ones.

        ``eval_path`` (a file, directory or dataset name like ``path``) is read at its ``eval_split`` (default
        ``train``: a file's only split); without it ``eval_split`` of ``path`` is read. Raises if neither is
        set.
        """
        if not self.has_eval:
            raise DataError("no evaluation data: set eval_split (a split of path) or eval_path")
        path = self.eval_path if self.eval_path is not None else self.path
        split = self.eval_split if self.eval_split is not None else "train"
        data_files = None if self.eval_path is not None else self.data_files
        return dataclasses.replace(
            self,
            streaming=False,  # held-out sets are small: prepared, and read again at no cost
            path=path,
            split=split,
            data_files=data_files,
            max_examples=self.eval_max_examples,
            eval_split=None,
            eval_path=None,
            eval_max_examples=None,
        )

    @property
    def is_sft(self) -> bool:
        """Whether examples are prompt + response pairs (prompt tokens masked from the loss)."""
        return self.prompt_column is not None

    def template_fields(self) -> tuple[str, ...]:
        """The placeholders of ``prompt_template`` in order of first use (empty without a template)."""
        if self.prompt_template is None:
            return ()
        if not isinstance(self.prompt_template, str):
            raise DataError(
                f"prompt_template must be a string, got {self.prompt_template!r} (in YAML, quote a template "
                "that starts with '{')"
            )
        try:
            parsed = list(string.Formatter().parse(self.prompt_template))
        except ValueError as error:
            raise DataError(
                f"prompt_template {self.prompt_template!r} is not a valid format string ({error}); "
                "write literal braces as {{ and }}"
            ) from error
        fields: list[str] = []
        for _, field, spec, conversion in parsed:
            if field is None:
                continue
            if not field.isidentifier() or spec or conversion:
                raise DataError(
                    f"prompt_template placeholder {{{field}{'!' + conversion if conversion else ''}"
                    f"{':' + spec if spec else ''}}} is not a plain name: use {{{PROMPT_FIELD}}} or "
                    "{column_name}, and {{ / }} for literal braces"
                )
            if field not in fields:
                fields.append(field)
        if PROMPT_FIELD not in fields:
            raise DataError(
                f"prompt_template {self.prompt_template!r} has no {{{PROMPT_FIELD}}} placeholder: the prompt "
                "column's text would be dropped"
            )
        return tuple(fields)

    @property
    def template_columns(self) -> tuple[str, ...]:
        """Columns other than the prompt column that ``prompt_template`` reads."""
        return tuple(f for f in self.template_fields() if f != PROMPT_FIELD and f != self.prompt_column)

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns the examples must have."""
        if self.prompt_column is not None and self.response_column is not None:
            return (self.prompt_column, self.response_column, *self.template_columns)
        return (self.text_column,)


def require_columns(dataset: Any, config: DataConfig) -> None:
    """Raise a `DataError` naming the first missing column and the columns the dataset does have."""
    for column in config.columns:
        if column not in dataset.column_names:
            if column in config.template_columns:  # checked after the prompt and response columns
                raise DataError(
                    f"prompt_template names column {column!r}, not found in dataset {config.path!r} (split "
                    f"{config.split!r}); its columns are {dataset.column_names} ({{prompt}} is prompt_column)"
                )
            role = "text_column" if not config.is_sft else "prompt_column/response_column"
            raise DataError(
                f"column {column!r} not found in dataset {config.path!r} (split {config.split!r}); "
                f"its columns are {dataset.column_names}: set {role} to one of them"
            )
