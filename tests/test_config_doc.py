"""docs/config.md is generated from the config dataclasses' docstrings, and every field is documented."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pp_offload.recipe.config_doc import DOC_PATH, REGENERATE, attribute_docs, missing_docs, render

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_field_has_a_doc_entry() -> None:
    assert missing_docs() == []


def test_docs_config_page_is_up_to_date() -> None:
    page = ROOT / DOC_PATH
    stale = f"{DOC_PATH} is out of date: regenerate with `{REGENERATE}`"
    assert page.is_file() and page.read_text() == render(), stale


@dataclass
class _Toy:
    """A toy section.

    Attributes:
        alpha: First line
            continued here.
        beta: One line.
    """

    alpha: int = 1
    beta: str = "x"
    gamma: bool = False


def test_attribute_entries_join_continuation_lines_and_missing_fields_are_named() -> None:
    assert attribute_docs(_Toy) == {"alpha": "First line continued here.", "beta": "One line."}
    assert missing_docs([("toy", _Toy)]) == ["toy.gamma: no entry in _Toy's Attributes: section"]


def test_a_malformed_attributes_line_is_an_error() -> None:
    @dataclass
    class Bad:
        """Bad.

        Attributes:
            alpha: fine.
          stray text at a smaller indent
        """

        alpha: int = 0

    with pytest.raises(ValueError, match="neither 'name: text'"):
        attribute_docs(Bad)


def test_rendered_page_lists_every_key_with_its_default() -> None:
    text = render()
    assert "| `pipeline.schedule` | `ScheduleVHalf` |" in text
    assert "| `train.betas` | `[0.9, 0.95]` |" in text
    assert "| `data.seq_len` | `128` |" in text


def test_every_offload_policy_and_recompute_plan_form_is_listed_and_parses() -> None:
    """The page's two value tables come from the catalogs the parsers read: each example parses, each form
    is on the page and in the parser's error message."""
    from pp_offload.order.offload import OFFLOAD_FORMS, resolve_offload
    from pp_offload.parallel import checkpointing_mode
    from pp_offload.recompute_plan import RECOMPUTE_FORMS, parse_recompute

    page = (ROOT / DOC_PATH).read_text()
    with pytest.raises(ValueError) as bad_offload:
        resolve_offload("sometimes")
    for form in OFFLOAD_FORMS:
        resolve_offload(form.example)
        assert f"| `{form.form}` | `{form.example}` |" in page
        assert f"'{form.form}'" in str(bad_offload.value)
    assert resolve_offload("budget:auto:0.1:sublayer").granularity == "sublayer"
    with pytest.raises(ValueError) as bad_recompute:
        parse_recompute("partial")
    for form in RECOMPUTE_FORMS:
        assert parse_recompute(form.example).label == form.example
        if form.example != "none":
            assert checkpointing_mode(form.example) == form.example  # what the recipe applies
        assert f"| `{form.form}` | `{form.example}` |" in page
        assert f"'{form.form}'" in str(bad_recompute.value)
