"""The recipe's command line turns the failures users commonly hit into a message with the fix
(docs/troubleshooting.md quotes them)."""

from __future__ import annotations

import pytest
import torch

import pp_offload.recipe.train as train
from pp_offload.models.families import UnsupportedModelError
from pp_offload.recipe import cli
from pp_offload.recipe.preflight import _fewer_stages_fix
from pp_offload.runtime.catalog import schedule_info


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."), cli.OUT_OF_MEMORY_HINT),
        (
            RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"),
            cli.OUT_OF_MEMORY_HINT,
        ),
        (
            torch.distributed.DistStoreError("Timed out after 16 seconds waiting for clients. 1/2 clients"),
            cli.MISSING_RANK_HINT,
        ),
        (
            RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv"),
            cli.TIMEOUT_HINT,
        ),
        (
            RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"),
            cli.PEER_EXITED_HINT,
        ),
        (ValueError("something else"), None),
    ],
)
def test_failure_hint_names_the_fix(error: BaseException, hint: str | None) -> None:
    assert cli.failure_hint(error) == hint


def test_out_of_memory_is_reported_with_the_config_keys_that_avoid_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(config, progress):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(train, "run", run)
    monkeypatch.setenv("RANK", "1")
    assert cli.main([]) == 1
    err = capsys.readouterr().err
    assert "finetune: rank 1 failed:" in err and "torch.OutOfMemoryError" in err
    assert "finetune: rank 1: out of memory. Each of these lowers a rank's peak: pipeline.offload=full" in err


def test_an_unsupported_model_is_a_configuration_error_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(config, progress):
        raise UnsupportedModelError("OPTForCausalLM (model_type='opt') cannot be split")

    monkeypatch.setattr(train, "run", run)
    monkeypatch.setenv("RANK", "0")
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err == "finetune: configuration error: OPTForCausalLM (model_type='opt') cannot be split\n"


def test_too_few_layers_fix_depends_on_the_placement() -> None:
    v_half = schedule_info("ScheduleVHalf")
    assert _fewer_stages_fix(v_half, 3, 4) == (
        "use at most 1 pipeline rank (a V schedule holds 2 stages per rank): with 4 processes, --dp 4 "
        "(pipeline.dp=4: 1 pipeline rank x 4 data-parallel replicas); or a model with more layers"
    )
    assert "--dp 2 (pipeline.dp=2: 2 pipeline ranks x 2" in _fewer_stages_fix(v_half, 6, 4)  # 3 ranks: no
    assert "stages_per_rank" in _fewer_stages_fix(schedule_info("ScheduleInterleaved1F1B"), 3, 4)
    assert _fewer_stages_fix(schedule_info("Schedule1F1B"), 3, 4).startswith(
        "use at most 3 pipeline ranks (one stage each): with 4 processes, --dp 2"
    )


def test_a_misspelt_schedule_name_gets_the_closest_one() -> None:
    with pytest.raises(ValueError, match="did you mean 'ScheduleVHalf'"):
        schedule_info("ScheduleVHlaf")


def test_offline_mode_with_a_model_missing_from_the_cache_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub.constants

    from pp_offload.recipe.config import ConfigError, load_config
    from pp_offload.recipe.model_loading import load_model
    from pp_offload.recipe.sources import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what pp_offload.hub reads
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import by the hub client
    config = load_config(None, ["model.path=no-such-org/no-such-model-pp-offload"])
    missing = "model.path='no-such-org/no-such-model-pp-offload' is not a local path and not in your"
    with pytest.raises(ConfigError, match=missing):
        load_tokenizer(config, None)
    with pytest.raises(ConfigError, match=missing):
        load_model(config, None, partial=True)
