"""What data to train on and how to cut it: the `data:` section of a recipe.

Kept apart from the loading code so a recipe can be parsed and validated without importing `datasets`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pp_offload.data.errors import DataError


@dataclass
class DataConfig:
    """Where the examples come from, which columns hold the text, and the block length.

    ``path`` is ``"embedded"`` (the offline corpus of `pp_offload.data.embedded`), a `datasets` builder name
    (``"text"``, ``"json"``, ``"parquet"``, ``"csv"``; give ``data_files``), a local file (the builder is
    chosen by its extension), a local directory, or a Hugging Face hub dataset name (``name`` picks its
    config).

    Plain language modelling reads ``text_column``. Supervised fine-tuning sets both ``prompt_column`` and
    ``response_column``: each example is prompt + response and only the response is learned.
    """

    path: str = "embedded"
    data_files: str | list[str] | None = None
    name: str | None = None
    split: str = "train"
    text_column: str = "text"
    prompt_column: str | None = None
    response_column: str | None = None
    seq_len: int = 128
    max_examples: int | None = None

    def __post_init__(self) -> None:
        # Fail at recipe-parsing time, not after minutes of tokenization.
        if (self.prompt_column is None) != (self.response_column is None):
            raise DataError(
                "set both prompt_column and response_column (supervised fine-tuning) or neither "
                "(plain text); "
                f"got prompt_column={self.prompt_column!r}, response_column={self.response_column!r}"
            )
        if self.seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.max_examples is not None and self.max_examples < 1:
            raise DataError(f"max_examples must be >= 1 or None, got {self.max_examples}")

    @property
    def is_sft(self) -> bool:
        """Whether examples are prompt + response pairs (prompt tokens masked from the loss)."""
        return self.prompt_column is not None

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns the examples must have."""
        if self.prompt_column is not None and self.response_column is not None:
            return (self.prompt_column, self.response_column)
        return (self.text_column,)
