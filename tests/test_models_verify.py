"""The split-time proof and the family sweep: every family splits exactly or is refused, never wrong.

The families of issue 12's table (non-default Granite scalings, Cohere logit scales, Gemma3/Olmo3
per-layer-type rotary embeddings, DeepSeek-V3's MLA) split exactly; a split that misses a family's
operation is refused by the proof; the committed full sweep (bench/results/families.json) is fresh and
has no wrong split and no crash.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import transformers

from pp_offload.models import UnsupportedModelError, families, split_model, verify
from pp_offload.models.sweep import causal_lm_types, chained_difference, sweep, tiny_model

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "families.json"
TIGHT = 1e-5  # chained stages run the unsplit model's ops in its order: only rounding may differ

ISSUE_FAMILIES = {
    "granite": dict(embedding_multiplier=3.0, logits_scaling=5.0),
    "cohere": dict(logit_scale=0.3),
    "cohere2": dict(logit_scale=0.3),
    "gemma3_text": dict(final_logit_softcapping=2.0),
    "olmo3": {},
    "deepseek_v3": {},
    "gpt2": {},
    "gpt_neox": {},
    "granitemoe": dict(embedding_multiplier=2.0, logits_scaling=4.0),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
}


@pytest.fixture(autouse=True)
def _fresh_proofs() -> None:
    verify._cache.clear()


@pytest.mark.parametrize("model_type", list(ISSUE_FAMILIES))
def test_issue_families_split_exactly(model_type: str) -> None:
    model = tiny_model(model_type, **ISSUE_FAMILIES[model_type])
    logits_rel, grad_rel = chained_difference(model, split_model)  # 4 stages, fresh weights and batch
    assert logits_rel <= TIGHT and grad_rel <= TIGHT, (logits_rel, grad_rel)
    split_model(model, num_stages=2, stage_indices=[0, 1])  # and the proof accepts it


def test_falcon_with_alibi_is_refused_with_the_reason() -> None:
    model = tiny_model("falcon", alibi=True)
    with pytest.raises(UnsupportedModelError, match="alibi=True cannot be split"):
        split_model(model, num_stages=2, stage_indices=[0])


def test_families_that_do_not_separate_packed_documents_get_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe packs documents and separates them by position ids; a family whose installed forward builds
    its masks without them (Falcon before transformers 5.24) gets a note, and its split does the same."""
    from pp_offload.recipe.model_loading import packing_note

    falcon = tiny_model("falcon", new_decoder_architecture=True, num_kv_heads=2)
    reads = families._mask_reads_positions(falcon.transformer)
    assert reads is not None  # the installed FalconModel.forward was read
    assert families.family_of(falcon).mask_positions is reads
    assert (packing_note(falcon) is None) is reads
    monkeypatch.setattr(families, "_mask_reads_positions", lambda base: False)
    assert "FalconForCausalLM builds its attention masks without position ids" in packing_note(falcon)
    assert packing_note(tiny_model("llama")) is None


def create_causal_mask(**kwargs: object) -> None:  # what the parsed forwards below call
    return None


class _MaskWithPositions:
    def forward(self, x: object, position_ids: object) -> None:
        create_causal_mask(config=None, inputs_embeds=x, position_ids=position_ids)


class _MaskWithoutPositions:
    def forward(self, x: object, position_ids: object) -> None:
        create_causal_mask(config=None, inputs_embeds=x)  # position_ids not passed on
        return position_ids


class _NoMask:
    def forward(self, x: object) -> object:
        return x


def test_the_mask_call_of_a_forward_is_read_for_position_ids() -> None:
    assert families._mask_reads_positions(_MaskWithPositions()) is True
    assert families._mask_reads_positions(_MaskWithoutPositions()) is False
    assert families._mask_reads_positions(_NoMask()) is None
    assert families._mask_reads_positions(None) is None


def test_the_proof_refuses_a_split_that_misses_an_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(families.FAMILY_OPS, "granite", ((), (), ()))  # forget Granite's scalings
    model = tiny_model("granite", embedding_multiplier=3.0, logits_scaling=5.0)
    with pytest.raises(UnsupportedModelError, match=r"model_type='granite'.*logits by [0-9.]+") as err:
        split_model(model, num_stages=2, stage_indices=[0])
    assert "verify=False" in str(err.value)
    split_model(model, num_stages=2, stage_indices=[0], verify=False)  # the documented opt-out


def test_the_proof_is_cached_per_config(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = verify.check_split
    monkeypatch.setattr(verify, "check_split", lambda m, f: calls.append("x") or real(m, f))
    model = tiny_model("llama")
    split_model(model, num_stages=2, stage_indices=[0])
    split_model(model, num_stages=2, stage_indices=[1])
    assert calls == ["x"]
    other = tiny_model("llama", rms_norm_eps=1e-3)  # another config: proven again
    split_model(other, num_stages=2, stage_indices=[0])
    assert calls == ["x", "x"]


REPRESENTATIVE = {
    "llama": "exact",
    "mixtral": "exact",
    "cohere2": "exact",
    "gemma2": "exact",
    "falcon": "exact",  # no pp plan: a row of its own (alibi=None, mask without positions)
    "gpt_bigcode": "exact",  # refused on transformers 5.23, exact since 5.24
    "lara_mini": "exact",  # its rotary embedding for sliding-window layers only (families._ROTARY_KINDS)
    "bert": "refused",  # not a decoder-only LM
}


@pytest.fixture(scope="module")
def representative() -> dict:
    """The representative families swept live on the installed transformers."""
    return {r.model_type: r for r in sweep(REPRESENTATIVE)}


def test_a_representative_sweep_is_exact_or_refused(representative: dict) -> None:
    got = {t: r.status for t, r in representative.items()}
    assert got == REPRESENTATIVE, {t: r.reason for t, r in representative.items()}


def test_committed_sweep_is_never_wrong_and_meets_its_targets(representative: dict) -> None:
    """The committed sweep (docs/families.md's table) has no wrong or crashed family. It describes the
    transformers it was made with (recorded in it); another transformers (pip takes the latest) warns
    here only where a verdict changed: a family swept live above that now splits otherwise, or model types
    the installed transformers adds or drops (not swept yet). split_model proves every split at run time
    anyway."""
    data = json.loads(RESULTS.read_text())
    rows = {row["model_type"]: row for row in data["families"]}
    changed = [
        f"{t}: {rows[t]['status']} -> {r.status}"
        for t, r in representative.items()
        if t in rows and rows[t]["status"] != r.status
    ]
    installed = causal_lm_types()
    changed += [f"{t}: new, not swept" for t in installed if t not in rows]
    changed += [f"{t}: gone" for t in rows if t not in installed]
    if changed:
        warnings.warn(
            f"bench/results/families.json (transformers {data['transformers']}) differs on the installed "
            f"transformers {transformers.__version__}: {'; '.join(changed)}. Re-run bench/bench_families.py "
            "to refresh docs/families.md",
            stacklevel=1,
        )
    bad = {t: r["status"] for t, r in rows.items() if r["status"] not in ("exact", "refused", "untested")}
    assert not bad, bad
    exact = [t for t, r in rows.items() if r["status"] == "exact"]
    assert max(rows[t]["proof_cpu_s"] for t in exact) < 1.0  # the target; wall clock adds the neighbours
    plan = [t for t, r in rows.items() if r["has_pp_plan"]]
    assert sum(rows[t]["status"] == "exact" for t in plan) >= 0.9 * len(plan)


def test_a_requested_router_aux_loss_is_carried_not_dropped() -> None:
    """The proof includes the router aux loss (tests/test_router_aux.py has its exactness tests)."""
    model = tiny_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    split = split_model(model, num_stages=2, stage_indices=[0])
    assert split.router_aux is not None and split.router_aux.coef == 0.02
    model.config.output_router_logits = False
    assert split_model(model, num_stages=2, stage_indices=[0]).router_aux is None


def test_a_gpu_only_attention_kernel_is_proven_with_a_cpu_one() -> None:
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # as loaded for a GPU run; not built here
    assert verify.check_split(model, split_model).ok


def test_families_command_prints_the_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pp_offload.__main__ import main

    assert main(["families", "llama", "bert", "--json", str(tmp_path / "f.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^llama\s+LlamaForCausalLM\s+yes\s+exact\s+\d+ms\s+\d+ms", out, flags=re.M), out
    assert re.search(r"^bert\s+BertLMHeadModel\s+no\s+refused .*base_model_pp_plan", out, flags=re.M), out
    assert "1 exact, 1 refused, 0 untested, 0 wrong, 0 crashed, of 2" in out
    saved = json.loads((tmp_path / "f.json").read_text())
    assert [r["status"] for r in saved["families"]] == ["exact", "refused"]
