"""The fine-tuning recipe end to end: pipelined runs on 2 gloo ranks reproduce single-process training,
resume reproduces an uninterrupted run, the export loads with from_pretrained, bad configs fail early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist import run_on_ranks
from _tiny_hf import RECIPE_LLAMA
from _tolerance import assert_trajectory_close

from pp_offload.recipe import ConfigError, RecipeConfig, load_config
from pp_offload.recipe.preflight import check_pipeline
from pp_offload.recipe.topology import Topology

LLAMA = {**RECIPE_LLAMA, "tie_word_embeddings": True}
GPT2 = {
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 4,
    "n_head": 4,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
REL, ABS = 1e-5, 1e-6  # fp32, the same layout and order (a resumed run against an uninterrupted one)


def _config(
    out: Path, *, model: dict = LLAMA, schedule: str = "ScheduleVHalf", steps: int = 4, **extra
) -> dict:
    config = {
        "model": {"config": model},
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 400},
        "pipeline": {"schedule": schedule, "microbatches": 4},
        "train": {"steps": steps, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 2},
        "output": {"dir": str(out), "report_to": ["csv"], "log_every": 0},
    }
    for key, value in extra.items():
        section, name = key.split("__")
        config[section][name] = value
    return config


def _run(config: dict, cache: str) -> list[float]:
    from pp_offload.recipe.train import run

    return run(RecipeConfig.from_dict(config), cache_dir=cache, progress=False).losses


def _worker(rank: int, world: int, configs: list[dict], cache: str) -> list[list[float]]:
    return [_run(config, cache) for config in configs]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("recipe_cache"))


def _close(got: list[float], want: list[float]) -> None:
    """The same computation in the same order (a resumed run against an uninterrupted one): tight."""
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=REL, atol=ABS)


def _matches_one_process(got: list[float], want: list[float], what: str = "loss") -> None:
    """A pipelined trajectory against one process: step 0 tight, later steps within the drift that
    another summation order causes (tests/_tolerance.py, measured by bench/bench_trajectory_drift.py)."""
    assert_trajectory_close(got, want, what)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_llama_v_half_resume_and_export(tmp_path: Path, cache: str) -> None:
    """One spawn: an uninterrupted V-Half run, and a run stopped after 2 steps then resumed to 4."""
    full = _config(tmp_path / "full", output__save_every=0)
    first = _config(tmp_path / "resumed", steps=2)
    resumed = _config(tmp_path / "resumed", output__resume=True)
    results = run_on_ranks(_worker, 2, [full, first, resumed], cache, timeout=240)
    pipelined, head, tail = results[0]
    reference = _run(_config(tmp_path / "reference"), cache)
    _matches_one_process(pipelined, reference)
    assert reference[-1] < reference[0]
    # warm-up covers steps 0-1, so the 2-step run's learning rates are the 4-step run's
    _close(head + tail, pipelined)
    assert len(tail) == 2
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["resumed_from"] == 2

    # the export (written by both ranks) is the checkpointed model, and transformers loads it
    from torch.distributed.checkpoint import load
    from transformers import AutoModelForCausalLM

    export = tmp_path / "full" / "export"
    assert (export / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(export).eval()
    fresh = AutoModelForCausalLM.from_config(loaded.config).eval()
    state = fresh.state_dict()
    load({"model": state}, checkpoint_id=str(tmp_path / "full" / "checkpoints" / "step_00000004"))
    fresh.load_state_dict(state)
    ids = torch.randint(0, loaded.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(ids).logits, fresh(ids).logits, rtol=0, atol=0)
    assert loaded.model.embed_tokens.weight.data_ptr() == loaded.lm_head.weight.data_ptr()
    reference_export = AutoModelForCausalLM.from_pretrained(tmp_path / "reference" / "export").eval()
    torch.testing.assert_close(loaded(ids).logits, reference_export(ids).logits, rtol=1e-4, atol=1e-4)


def _pretrained_gpt2(where: Path, cache: str) -> dict:
    """A GPT-2 saved as the hub's GPT-2 checkpoints are: the base model only (no "transformer." prefix,
    no lm_head: it is tied), in bf16 (so the recipe loads it by part), with the embedded tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pp_offload.data import embedded_assets, embedded_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_assets(embedded_dir(Path(cache))).tokenizer_dir)
    values = {k: v for k, v in GPT2.items() if k != "model_type"}
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", vocab_size=len(tokenizer), **values)
    )
    model.transformer.to(torch.bfloat16).save_pretrained(where, max_shard_size="200KB")  # as on the hub
    tokenizer.save_pretrained(where)
    return {"path": str(where)}


def test_gpt2_loop_placement_and_offload(tmp_path: Path, cache: str) -> None:
    """Interleaved-1F1B puts GPT-2's tied embedding and head on different ranks, each rank reading only
    its own tensors of a pretrained checkpoint (meta skeleton + safetensors by name); V-Min offloads
    fully; V-Half moves GPT-2's layers (``h``) one by one (budget offload). All equal one process (which
    loads the whole checkpoint with from_pretrained)."""
    pretrained = _pretrained_gpt2(tmp_path / "pretrained", cache)
    from pp_offload.models.loading import check_checkpoint, empty_model

    check_checkpoint(empty_model(pretrained["path"]), pretrained["path"])  # so the ranks load by part
    gpt2 = _config(tmp_path / "gpt2", schedule="ScheduleInterleaved1F1B", steps=3, output__export=False)
    gpt2["model"] = pretrained
    offload = _config(
        tmp_path / "offload", schedule="ScheduleVMin", steps=3, pipeline__offload="full", output__export=False
    )
    budget = _config(
        tmp_path / "budget",
        schedule="ScheduleVHalf",
        steps=3,
        pipeline__offload="budget:1",
        output__export=False,
    )
    budget["model"] = pretrained
    gpt2_losses, offload_losses, budget_losses = run_on_ranks(
        _worker, 2, [gpt2, offload, budget], cache, timeout=240
    )[0]
    reference = _config(tmp_path / "gpt2_ref", steps=3, output__export=False)
    reference["model"] = pretrained
    reference_losses = _run(reference, cache)
    _matches_one_process(gpt2_losses, reference_losses)
    _matches_one_process(budget_losses, reference_losses)
    offload_reference = _config(tmp_path / "offload_ref", steps=3, output__export=False)
    _matches_one_process(offload_losses, _run(offload_reference, cache))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hybrid_pp2_dp2_matches_single_process_with_sharded_resume_and_export(
    tmp_path: Path, cache: str
) -> None:
    """4 ranks as 2 pipeline ranks x 2 FSDP replicas: V-Half (tied weight replicated on rank 0) with a
    sharded checkpoint resumed; GPT-2 under Interleaved1F1B (tie across ranks, sharded) with offload and
    selective activation checkpointing (full checkpointing: tests/test_eval_lora.py, test_fsdp_gloo.py).
    Losses and grad norms equal one process; the export is one HF model."""
    dp2 = {"pipeline__dp": 2}
    full = _config(tmp_path / "full", output__save_every=0, **dp2)
    first = _config(tmp_path / "resumed", steps=2, output__export=False, **dp2)
    resumed = _config(tmp_path / "resumed", output__resume=True, output__export=False, **dp2)
    gpt2 = _config(
        tmp_path / "gpt2",
        model=GPT2,
        schedule="ScheduleInterleaved1F1B",
        steps=3,
        pipeline__offload="full",
        train__activation_checkpointing="selective",
        output__export=False,
        **dp2,
    )
    dropout = {k: v for k, v in GPT2.items() if not k.endswith("pdrop")}  # GPT-2's default 0.1
    keyed = _config(
        tmp_path / "dropout",
        model=dropout,
        steps=2,
        train__activation_checkpointing="mlp",
        output__export=False,
        **dp2,
    )
    results = run_on_ranks(_worker, 4, [full, first, resumed, gpt2, keyed], cache, timeout=300)
    assert all(r == results[0] for r in results)  # every rank reports the same losses
    pipelined, head, tail, gpt2_losses, dropout_losses = results[0]
    # dropout masks keyed to the global microbatch (dp rank x 4 + local): one process running the same 8
    # microbatches of one sample in order draws the same masks
    one = _config(
        tmp_path / "dropout_ref", model=dropout, steps=2, output__export=False, pipeline__microbatches=8
    )
    _matches_one_process(dropout_losses, _run(one, cache))
    reference = _run(_config(tmp_path / "reference"), cache)
    _matches_one_process(pipelined, reference)
    _close(head + tail, pipelined)
    _matches_one_process(
        gpt2_losses, _run(_config(tmp_path / "gpt2_ref", model=GPT2, steps=3, output__export=False), cache)
    )
    norms = [
        json.loads((tmp_path / d / "summary.json").read_text())["grad_norms"] for d in ("full", "reference")
    ]
    _matches_one_process(norms[0], norms[1], "grad_norm")  # the norm over pp and dp counts each grad once
    shards = sorted(p.name for p in (tmp_path / "full" / "checkpoints" / "step_00000004").glob("*.distcp"))
    assert len(shards) == 4  # sharded state: every rank wrote its part

    from torch.distributed.checkpoint import load
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "export").eval()
    fresh = AutoModelForCausalLM.from_config(loaded.config).eval()
    state = fresh.state_dict()
    load({"model": state}, checkpoint_id=str(tmp_path / "full" / "checkpoints" / "step_00000004"))
    fresh.load_state_dict(state)  # the sharded checkpoint, resharded to whole tensors by DCP
    ids = torch.randint(0, loaded.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(ids).logits, fresh(ids).logits, rtol=0, atol=0)
    # 4 AdamW steps amplify the last-bit differences of summation order in near-zero gradients
    reference_export = AutoModelForCausalLM.from_pretrained(tmp_path / "reference" / "export").eval()
    torch.testing.assert_close(loaded(ids).logits, reference_export(ids).logits, rtol=1e-3, atol=1e-3)


def _auto_worker(rank: int, world: int, configs: list[dict], cache: str) -> list[tuple[list[float], dict]]:
    from pp_offload.recipe.train import run

    results = [run(RecipeConfig.from_dict(c), cache_dir=cache, progress=False) for c in configs]
    return [(r.losses, r.auto) for r in results]


def test_auto_schedule_probes_chooses_the_same_everywhere_and_trains_exactly(
    tmp_path: Path, cache: str
) -> None:
    """schedule: auto within half of 1F1B's activation memory: the probe leaves no trace (losses equal one
    process), every rank gets the same decision, it fits, and a resumed run reuses it."""
    auto = {"pipeline__schedule": "auto", "pipeline__memory_limit": 0.5, "output__export": False}
    full = _config(tmp_path / "full", output__save_every=0, **auto)
    first = _config(tmp_path / "resumed", steps=2, **auto)
    resumed = _config(tmp_path / "resumed", output__resume=True, **auto)
    results = run_on_ranks(_auto_worker, 2, [full, first, resumed], cache, timeout=300)
    assert results[0] == results[1]
    (losses, decision), (head, probed), (tail, again) = results[0]
    _matches_one_process(losses, _run(_config(tmp_path / "reference", output__export=False), cache))
    _close(head + tail, losses)
    assert again == probed  # the resumed run took the recorded choice, not a new probe's
    budget = decision["budget_bytes"]
    assert budget is not None and all(p <= b for p, b in zip(decision["peak_bytes"], budget, strict=True))
    recorded = json.loads((tmp_path / "full" / "auto.json").read_text())
    assert recorded["decision"]["schedule"] == decision["schedule"]
    assert recorded["measurement"]["stages"]
    # the probe measured what each candidate recompute mode costs on one of the model's layers
    assert set(recorded["measurement"]["recompute_costs"]["modes"]) == {"mlp", "selective", "full"}


def test_auto_judges_recompute_only_when_unset_and_applies_its_pick(tmp_path: Path) -> None:
    """schedule: auto offers MLP-only, selective (on half, three quarters and all of each stage's layers;
    on half and three quarters with MLP-only on the others) and full recompute of this model's layers to
    `choose` (kept byte shares from the planner's formulas) unless train.activation_checkpointing is set,
    and the chosen mode reaches the real pipeline's config; a decision without recompute keeps the user's
    setting."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from pp_offload.plan.auto import DEFAULT_RECOMPUTE
    from pp_offload.recipe.auto import chosen_config, machine_preset, recompute_candidates, recompute_modes

    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"}))
    auto = {"pipeline__schedule": "auto", "pipeline__memory_limit": 0.5}
    config = RecipeConfig.from_dict(_config(tmp_path, **auto))
    options = recompute_candidates(config, model, torch.device("cpu"))
    assert [o.label for o in options] == list(DEFAULT_RECOMPUTE)  # two-mode plans included
    assert recompute_modes(options) == ("mlp", "selective", "full")  # what the probe times
    by_label = {o.label: o for o in options}
    mlp, selective, full = by_label["mlp"], by_label["selective"], by_label["full"]
    assert by_label["selective:0.75,mlp"].rest == "mlp"
    assert 0 < full.kept_share < selective.kept_share < mlp.kept_share < 1 and full.forward_share == 1
    set_by_user = RecipeConfig.from_dict(_config(tmp_path, train__activation_checkpointing="full", **auto))
    assert recompute_candidates(set_by_user, model, torch.device("cpu")) == []
    assert machine_preset(torch.device("cpu")) == "H100"

    decision = SimpleNamespace(
        schedule="ScheduleVMin",
        offload="budget",
        memory_limit=None,
        costs={"F": 1.0},
        recompute="selective:0.75",
    )
    chosen = chosen_config(config, decision)
    assert (chosen.pipeline.schedule, chosen.pipeline.offload) == ("ScheduleVMin", "budget")
    assert chosen.train.activation_checkpointing == "selective:0.75"
    without = SimpleNamespace(**{**vars(decision), "recompute": "none"})
    assert chosen_config(set_by_user, without).train.activation_checkpointing == "full"


def _spied_worker(rank: int, world: int, config: dict, cache: str) -> tuple[list[float], list]:
    """`_worker` for one config, recording each call of the runtime's activation checkpointing (the mode
    it was given, the layers it wrapped on this rank)."""
    import pp_offload.parallel as parallel

    applied, real = [], parallel.activation_checkpointing

    def spy(split, **kw):
        wrapped = real(split, **kw)
        applied.append((kw["mode"], wrapped))
        return wrapped

    parallel.activation_checkpointing = spy
    try:
        return _run(config, cache), applied
    finally:
        parallel.activation_checkpointing = real


def _spied_pair(rank: int, world: int, configs: list[dict], cache: str) -> list[tuple[list[float], list]]:
    return [_spied_worker(rank, world, config, cache) for config in configs]


def test_auto_two_mode_recompute_pick_runs_end_to_end(tmp_path: Path, cache: str) -> None:
    """A two-mode plan as `choose` names it (``"selective:0.5,mlp"``; tests/test_auto.py has a planner
    setting where auto picks one) goes through `chosen_config`, the recipe's config check and the pipeline
    build of 2 ranks to the runtime: each rank's 2 layers are both checkpointed (one selectively, one
    MLP-only), and the losses equal the same decision's run without recompute (recompute is exact)."""
    from types import SimpleNamespace

    from pp_offload.recipe.auto import chosen_config

    config = RecipeConfig.from_dict(_config(tmp_path / "plan", steps=2, output__export=False))
    COSTS = {"F": 1.0, "I": 1.0, "W": 1.0, "comm": 0.0, "transfer": 0.0}  # noqa: N806
    decision = SimpleNamespace(
        schedule="ScheduleVHalf",
        offload="none",
        memory_limit=None,
        costs=COSTS,
        recompute="selective:0.5,mlp",
    )
    chosen = chosen_config(config, decision).to_dict()
    assert chosen["train"]["activation_checkpointing"] == "selective:0.5,mlp"
    plain = chosen_config(config, SimpleNamespace(**{**vars(decision), "recompute": "none"})).to_dict()
    plain["output"]["dir"] = str(tmp_path / "plain")
    assert plain["train"]["activation_checkpointing"] is False
    (losses, applied), (plain_losses, none_applied) = run_on_ranks(
        _spied_pair, 2, [chosen, plain], cache, timeout=240
    )[0]
    assert applied == [("selective:0.5,mlp", 2)] and none_applied == []
    _close(losses, plain_losses)  # the same order and layers: recompute changes nothing


def _preflight(config: dict, pp: int = 2, layers: int | None = 4) -> None:
    """The config checks a rank makes before joining the group, with the model's layer count given."""
    topo = Topology(rank=0, world=pp, local_rank=0, pp=pp, dp=1)
    check_pipeline(RecipeConfig.from_dict(config).validated(), topo, layers)


@pytest.mark.parametrize(
    ("changes", "layers", "message"),
    [
        ({"pipeline__schedule": "VFast"}, 4, "unknown schedule 'VFast'; known schedules: ScheduleVMin"),
        (
            {"pipeline__microbatches": 3},
            4,
            "global_batch_size=8 must split into .*microbatches=3 microbatches",
        ),
        ({}, 3, "the model has 3 layers, fewer than the 4 pipeline stages"),
        ({"pipeline__memory_limit": 0.5}, 4, "memory_limit .* goes with pipeline.schedule=ScheduleVAdaptive"),
        (
            {"pipeline__schedule": "Schedule1F1B", "pipeline__offload": "full"},
            4,
            "offload needs a multi-stage",
        ),
        ({"pipeline__layers_per_stage": [2, 2]}, 4, "layers_per_stage has 2 entries but there are 4 stages"),
        (
            {"pipeline__schedule": "auto", "pipeline__offload": "full"},
            4,
            "pipeline.offload cannot be set with pipeline.schedule=auto",
        ),
        (
            {"pipeline__schedule": "auto", "pipeline__memory_limit": 1.5},
            4,
            r"memory_limit=1.5 must be a number in \(0, 1\], or null; a fraction",
        ),
        (
            {"pipeline__activation_budget_gib": 1.0},
            4,
            "activation_budget_gib goes with pipeline.schedule=auto",
        ),
        ({"pipeline__schedule": "auto"}, 3, "the model has 3 layers, fewer than the 4 pipeline stages"),
    ],
)
def test_bad_configs_fail_before_any_process_group(
    tmp_path: Path, changes: dict, layers: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _preflight(_config(tmp_path, **changes), layers=layers)


def test_config_reader_names_unknown_keys_and_world_mismatch(
    tmp_path: Path, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("pipeline:\n  micro_batches: 4\n")
    with pytest.raises(ConfigError, match="unknown key pipeline.micro_batches .did you mean 'microbatches'"):
        load_config(path)
    with pytest.raises(ConfigError, match="override 'steps=3' must look like section.key=value"):
        load_config(None, ["steps=3"])
    config = load_config(None, ["train.steps=3", "pipeline.schedule=VMin"])
    assert config.train.steps == 3 and config.pipeline.schedule == "VMin"
    from pp_offload.recipe.topology import topology

    with pytest.raises(ConfigError, match="world size 1 is not pipeline.pp x pipeline.dp = 2 x 1"):
        topology(load_config(None, ["pipeline.pp=2"]))
    with pytest.raises(ConfigError, match=r"world size 1 is not a multiple of pipeline.dp=2 .*among \[1\]"):
        topology(load_config(None, ["pipeline.dp=2"]))
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match=r"pipeline.dp_replicate=3 must divide pipeline.dp=4 .*\[1, 2, 4\]"):
        topology(load_config(None, ["pipeline.dp=4", "pipeline.dp_replicate=3"]))
    topo = topology(load_config(None, ["pipeline.dp=4", "pipeline.dp_replicate=2"]))
    assert (topo.pp, topo.dp) == (2, 4)
    hybrid = RecipeConfig.from_dict(_config(tmp_path, pipeline__dp=2, train__global_batch_size=6))
    with pytest.raises(ConfigError, match="must split into pipeline.dp=2 replicas x pipeline.microbatches=4"):
        check_pipeline(hybrid, Topology(rank=0, world=4, local_rank=0, pp=2, dp=2), 4)


def test_config_dict_reads_back_to_the_same_config(tmp_path: Path) -> None:
    """``to_dict`` -> ``from_dict`` gives the config back, with and without LoRA: a config dumped without
    LoRA (summary.json, `chosen_config(...).to_dict()`) must not come back as a LoRA run (a ``lora``
    section, even empty, turns LoRA on)."""
    plain = RecipeConfig.from_dict(_config(tmp_path))
    assert plain.lora is None and "lora" not in plain.to_dict()
    assert RecipeConfig.from_dict(plain.to_dict()) == plain
    with_lora = RecipeConfig.from_dict({**_config(tmp_path), "lora": {"r": 4}})
    back = RecipeConfig.from_dict(with_lora.to_dict())
    assert back == with_lora and back.lora is not None and back.lora.r == 4


def test_set_reaches_into_mappings_at_any_depth(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  config:\n    model_type: llama\n    num_hidden_layers: 8\n    hidden_size: 64\n"
    )
    config = load_config(
        path,
        [
            "model.config.num_hidden_layers=4",
            "model.config.rope_scaling.factor=8.0",  # new sub-keys, and the mapping between them, are created
            "model.config.rope_scaling.rope_type=linear",
            "pipeline.costs.W=0.5",  # unset (None) so far but a mapping by type: one is started
            "train.steps=3",
        ],
    )
    assert config.model.config == {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    }
    assert config.pipeline.costs == {"W": 0.5} and config.train.steps == 3
    assert load_config(path, ["model.config={model_type: gpt2}"]).model.config == {"model_type": "gpt2"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.confg.num_hidden_layers=4", r"unknown key model.confg .did you mean 'config'"),
        ("modle.config.x=1", r"unknown section 'modle' .did you mean 'model'"),
        ("train.stepz=3", r"unknown key train.stepz .did you mean 'steps'"),
        ("train.steps.x=3", r"train.steps is not a mapping, so it has no sub-key 'x'"),
        ("model.config.num_hidden_layers.x=3", r"model.config.num_hidden_layers is 8, not a mapping"),
        ("model..x=3", "must look like section.key=value"),
        ("model.config.x", "must look like section.key=value"),
    ],
)
def test_set_stays_strict_outside_mappings(tmp_path: Path, override: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  config:\n    model_type: llama\n    num_hidden_layers: 8\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override])


def test_set_prompt_formatting_of_the_data_section() -> None:
    template = "### Instruction:\n{prompt}\n\n### Response:\n"
    sft = ["data.prompt_column=instruction", "data.response_column=output"]
    config = load_config(
        None, [*sft, 'data.prompt_template="### Instruction:\\n{prompt}\\n\\n### Response:\\n"']
    )
    assert config.data.prompt_template == template
    assert load_config(None, [*sft, "data.chat_template=true"]).data.chat_template is True
    with pytest.raises(ConfigError, match="data: prompt_template formats the prompt .* needs prompt_column"):
        load_config(None, ["data.prompt_template='{prompt}'"])
    with pytest.raises(ConfigError, match="data.prompt_template=.* must be a string.*quote"):
        load_config(None, [*sft, "data.prompt_template={prompt}"])


def test_missing_dataset_column_is_named(tmp_path: Path, cache: str) -> None:
    from pp_offload.data import DataError

    config = _config(tmp_path, data__text_column="body")
    with pytest.raises(DataError, match="body"):
        _run(config, cache)


def test_unreachable_hub_fails_fast_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pp_offload.hub as hub
    from pp_offload.recipe.preflight import check_model_sources

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    remote = RecipeConfig.from_dict({"model": {"path": "org/some-model"}})
    with pytest.raises(
        ConfigError, match="model.path='org/some-model' is not a local path and the hub .* unreachable"
    ):
        check_model_sources(remote)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # what a local model dir must hold
        (tmp_path / name).write_text("{}")
    check_model_sources(RecipeConfig.from_dict({"model": {"path": str(tmp_path)}}))  # local: no question
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_model_sources(remote)  # offline mode: the local cache decides


def test_gpt2_default_dropout_gives_the_same_losses_on_every_schedule(tmp_path: Path, cache: str) -> None:
    """GPT-2's default dropout (0.1 everywhere): V-Half, Interleaved1F1B with full offload, and V-ZB with
    selective recompute give one process's losses; the masks are keyed to (seed, step, microbatch, layer),
    not to the order each rank draws them in (`pp_offload.runtime.dropout_keys`)."""
    dropout = {k: v for k, v in GPT2.items() if not k.endswith("pdrop")}
    runs = [
        _config(tmp_path / "vhalf", model=dropout, steps=2, output__export=False),
        _config(
            tmp_path / "loop",
            model=dropout,
            schedule="ScheduleInterleaved1F1B",
            steps=2,
            pipeline__offload="full",
            output__export=False,
        ),
        _config(
            tmp_path / "vzb",
            model=dropout,
            schedule="ScheduleVZB",
            steps=2,
            train__activation_checkpointing="selective",
            output__export=False,
        ),
    ]
    results = run_on_ranks(_worker, 2, runs, cache, timeout=240)[0]
    reference = _run(_config(tmp_path / "one", model=dropout, steps=2, output__export=False), cache)
    for losses in results:
        _matches_one_process(losses, reference)
    torch.testing.assert_close(torch.tensor([r[0] for r in results]), torch.tensor([reference[0]] * 3))
