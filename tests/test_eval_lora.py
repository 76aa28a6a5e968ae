"""Evaluation through the pipeline and LoRA fine-tuning: pipelined runs on gloo ranks equal one process."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from _dist import run_on_ranks
from _tolerance import assert_trajectory_close
from test_recipe import LLAMA

from pp_offload.recipe import RecipeConfig

REL, ABS = 1e-5, 1e-6  # fp32, the same layout and order (a resumed run vs an uninterrupted one)


def _config(
    out: Path, *, schedule: str = "ScheduleVHalf", steps: int = 2, lora: dict | None = None, **extra
) -> dict:
    config = {
        "model": {"config": LLAMA},
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 400, "eval_split": "validation"},
        "pipeline": {"schedule": schedule, "microbatches": 4},
        "train": {"steps": steps, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 1, "eval_batches": 2},
        "output": {"dir": str(out), "report_to": ["csv"], "log_every": 0, "export": False, "timeline": False},
    }
    if lora is not None:
        config["lora"] = dict(lora)
    for key, value in extra.items():
        section, name = key.split("__")
        config[section][name] = value
    return config


def _run(config: dict, cache: str) -> dict:
    from pp_offload.recipe.train import run

    result = run(RecipeConfig.from_dict(config), cache_dir=cache, progress=False)
    return {"losses": result.losses, "norms": result.grad_norms, "evals": result.evals}


def _worker(rank: int, world: int, configs: list[dict], cache: str) -> list[dict]:
    return [_run(config, cache) for config in configs]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("eval_lora_cache"))


def _close(got: list[float], want: list[float], rtol: float = REL, atol: float = ABS) -> None:
    assert len(got) == len(want) and got
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=atol)


def _eval_losses(result: dict) -> list[float]:
    return [e["loss"] for e in result["evals"]]


LORA = {"r": 4, "alpha": 8.0, "target_modules": None}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache: str) -> dict:
    """LoRA in one process (the unsplit peft model), evaluated after each step."""
    out = tmp_path_factory.mktemp("reference")
    return _run(_config(out, lora=LORA, train__eval_every=1), cache)


def _matches(got: dict, want: dict) -> None:
    """A pipelined run vs one process: tight at step 0, the trajectory rule after (tests/_tolerance.py)."""
    assert got["losses"] and got["norms"]
    assert_trajectory_close(got["losses"], want["losses"], "loss")
    assert_trajectory_close(got["norms"], want["norms"], "grad_norm")  # over every rank's adapter gradients


def _evals_match(got: dict, want: dict) -> None:
    """Evaluations after steps 1, 2, ...: the weights have taken that many optimizer steps."""
    assert got["evals"] and [e["step"] for e in got["evals"]] == [e["step"] for e in want["evals"]]
    first = got["evals"][0]["step"]
    assert_trajectory_close(_eval_losses(got), _eval_losses(want), "loss", first_step=first)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pipelined_lora_and_eval_match_one_process(tmp_path: Path, cache: str, reference: dict) -> None:
    """One 2-rank spawn: LoRA under V-Half (evaluated after each step, exported as adapter and merged),
    the same stopped after step 1 and resumed, LoRA under ZBV with full offload, under torch's
    single-stage GPipe (evaluated), and on a bf16 checkpoint each rank loads by part: losses, adapter
    gradient norms and evaluation losses equal one process; the exports reproduce the trained model."""
    lora_full = _config(
        tmp_path / "lora", lora=dict(LORA, merge=True), train__eval_every=1, output__export=True
    )
    first = _config(tmp_path / "resumed", steps=1, lora=LORA, output__save_every=1)
    resumed = _config(tmp_path / "resumed", lora=LORA, output__resume=True)
    zbv = _config(tmp_path / "zbv", schedule="ScheduleZBVZeroBubble", lora=LORA, pipeline__offload="full")
    gpipe = _config(tmp_path / "gpipe", schedule="ScheduleGPipe", lora=LORA, train__eval_every=1)
    by_part = _config(tmp_path / "by_part", lora=LORA)  # a bf16 checkpoint: each rank reads its share
    by_part["model"] = _pretrained_llama(tmp_path / "pretrained", cache)
    configs = [lora_full, first, resumed, zbv, gpipe, by_part]
    results = run_on_ranks(_worker, 2, configs, cache, timeout=300)
    assert results[0] == results[1]  # every rank reports the same losses and evaluations
    lora, head, tail, zbv_run, gpipe_run, by_part_run = results[0]
    for run in (lora, zbv_run, gpipe_run):
        _matches(run, reference)
    whole = _config(tmp_path / "by_part_ref", lora=LORA)  # one process: from_pretrained, whole model
    whole["model"] = by_part["model"]
    _matches(by_part_run, _run(whole, cache))
    for run in (lora, gpipe_run):  # through the pipeline (a V schedule, torch's single-stage) == one process
        _evals_match(run, reference)
    assert [e["step"] for e in lora["evals"]] == [1, 2] and zbv_run["evals"][0]["step"] == 2
    _close(head["losses"] + tail["losses"], lora["losses"])  # resumed from the adapter-only checkpoint

    summary = json.loads((tmp_path / "lora" / "summary.json").read_text())
    assert summary["final_eval"] == lora["evals"][-1] and summary["final_eval"]["perplexity"] > 1
    assert (tmp_path / "lora" / "eval.csv").read_text().count("\n") == 3  # header + 2 evaluations
    _check_exports(tmp_path / "lora")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_lora_pp2_dp2_matches_one_process(tmp_path: Path, cache: str, reference: dict) -> None:
    """4 ranks, 2 pipeline ranks x 2 FSDP replicas sharding stages whose base weights are frozen: V-Half
    with both exports (gathered from the shards) and Interleaved1F1B with offload and activation
    checkpointing equal one process."""
    vhalf = _config(
        tmp_path / "vhalf",
        lora=dict(LORA, merge=True),
        pipeline__dp=2,
        train__eval_every=1,
        output__export=True,
    )
    loop = _config(
        tmp_path / "loop",
        schedule="ScheduleInterleaved1F1B",
        lora=LORA,
        pipeline__dp=2,
        pipeline__offload="full",
        train__activation_checkpointing=True,
    )
    results = run_on_ranks(_worker, 4, [vhalf, loop], cache, timeout=400)
    assert all(r == results[0] for r in results)
    for got in results[0]:
        _matches(got, reference)
    _evals_match(results[0][0], reference)
    _check_exports(tmp_path / "vhalf")


def _pretrained_llama(where: Path, cache: str) -> dict:
    """A Llama saved as hub checkpoints are (bf16, sharded) with the embedded tokenizer: pipelined runs
    load it by part (meta skeleton, own tensors only), one process with from_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pp_offload.data import embedded_assets, embedded_dir
    from pp_offload.models.loading import check_checkpoint, empty_model

    tokenizer = AutoTokenizer.from_pretrained(embedded_assets(embedded_dir(Path(cache))).tokenizer_dir)
    values = {k: v for k, v in LLAMA.items() if k != "model_type"}
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", vocab_size=len(tokenizer), **values)
    )
    model.to(torch.bfloat16).save_pretrained(where, max_shard_size="100KB")
    tokenizer.save_pretrained(where)
    check_checkpoint(empty_model(where), where)  # so the ranks load by part
    return {"path": str(where)}


def _check_exports(out: Path) -> None:
    """The exported adapter and the merged model reproduce the trained model: the seed's base model with
    the checkpoint's adapters (the checkpoint holds only those)."""
    import copy

    from peft import PeftModel
    from torch.distributed.checkpoint import load
    from transformers import AutoModelForCausalLM

    from pp_offload.models.lora import apply_lora

    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    torch.manual_seed(0)  # train.seed: the recipe's base model
    base = AutoModelForCausalLM.from_config(merged.config).eval()
    trained = apply_lora(copy.deepcopy(base), r=4, alpha=8.0).eval()
    adapters = {k: v for k, v in trained.get_base_model().state_dict().items() if ".lora_" in k}
    load({"model": adapters}, checkpoint_id=str(out / "checkpoints" / "step_00000002"))
    trained.get_base_model().load_state_dict(adapters, strict=False)
    with warnings.catch_warnings():  # peft's load reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), out / "export").eval()
    # the base was built from model.config: the export carries it, and the adapter names it
    exported_base = AutoModelForCausalLM.from_pretrained(out / "export" / "base").eval()
    adapter_config = json.loads((out / "export" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((out / "export" / "base").resolve())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        rebuilt = PeftModel.from_pretrained(exported_base, out / "export").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        assert not torch.allclose(base(ids).logits, want)  # the adapters were trained
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=0)
        torch.testing.assert_close(rebuilt(input_ids=ids).logits, want, rtol=0, atol=0)
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- bad input fails before training


def _tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in LLAMA.items() if k != "model_type"}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=64, **values))


def test_lora_targets_default_to_the_layers_projections_and_typos_fail() -> None:
    from pp_offload.models.lora import LoraError, apply_lora, default_target_modules

    model = _tiny_llama()
    assert default_target_modules(model) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"
    ]  # fmt: skip
    with pytest.raises(LoraError, match=r"\['qproj'\] not found in LlamaForCausalLM.*q_proj"):
        apply_lora(model, target_modules=["q_proj", "qproj"])
    with pytest.raises(LoraError, match="lora.r=0"):
        apply_lora(model, r=0)
    peft_model = apply_lora(model, r=2, target_modules=["q_proj"])
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and "q_proj" in n for n in trainable)
    from pp_offload.models import split_model

    split = split_model(peft_model, num_stages=2, stage_indices=[1])  # split under the wrapper
    names = [n for n, _ in split.module.named_parameters()]
    assert "model.layers.3.self_attn.q_proj.lora_A.default.weight" in names
    assert not any(n.startswith("base_model.") for n in names)


def test_lora_on_a_model_that_cannot_be_pipelined_is_refused() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pp_offload.models import UnsupportedModelError
    from pp_offload.models.lora import apply_lora

    config = AutoConfig.for_model(
        "bert", hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        vocab_size=64, is_decoder=True,
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="no base_model_pp_plan"):
        apply_lora(AutoModelForCausalLM.from_config(config))


def test_recipe_rejects_bad_lora_and_eval_settings(tmp_path: Path, cache: str) -> None:
    from pp_offload.data import DataError
    from pp_offload.recipe import ConfigError
    from pp_offload.recipe.train import run

    def fails(config: dict, match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            run(RecipeConfig.from_dict(config), cache_dir=cache, progress=False)

    no_eval = _config(tmp_path / "a", train__eval_every=5)
    del no_eval["data"]["eval_split"]
    fails(no_eval, "need held-out data: set data.eval_split")
    fails(_config(tmp_path / "b", data__eval_split="test"), r"evaluation data.*Unknown split \"test\"")
    fails(_config(tmp_path / "c", lora={"target_modules": ["q_prj"]}), r"lora: .*\['q_prj'\] not found")
    with pytest.raises(ConfigError, match="is the training split"):
        RecipeConfig.from_dict(_config(tmp_path / "d", data__eval_split="train"))
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)


# ---------------------------------------------------------------- the planner knows LoRA


def test_planner_lora_state_and_weight_pass_match_a_real_lora_model() -> None:
    """Parameters, gradients and AdamW state of a real LoRA model equal the planner's bytes; W shrinks to
    the adapters' weight gradient and the frozen head has none."""
    import dataclasses

    from pp_offload.models.lora import apply_lora
    from pp_offload.plan.costs import head_flops, layer_flops
    from pp_offload.plan.memory import state_bytes
    from pp_offload.plan.model import model_spec

    model = apply_lora(_tiny_llama(), r=4, alpha=8.0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    sizes = [(p.numel(), p.grad is not None) for p in model.parameters()]
    spec = dataclasses.replace(model_spec(model.get_base_model().config), lora_rank=4)
    est = state_bytes(spec, "fp32", [(LLAMA["num_hidden_layers"], True, True)])
    assert est.params == 4 * sum(n for n, _ in sizes)
    assert est.grads == 4 * sum(n for n, has in sizes if has)
    assert est.optimizer == sum(
        t.numel() * 4 for s in optimizer.state.values() for t in s.values() if t.dim()
    )

    full = layer_flops(dataclasses.replace(spec, lora_rank=0), seq_len=32)
    lora = layer_flops(spec, seq_len=32)
    assert lora.W < 0.25 * full.W and lora.F > full.F and head_flops(spec).W == 0
    with pytest.raises(ValueError, match="lora_rank"):
        dataclasses.replace(spec, lora_rank=-1)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_merged_state_is_the_peft_model(model_type: str) -> None:
    """Folding the adapters into the base weights (GPT-2's Conv1D is stored input-major) gives a plain
    transformers model with the PeftModel's logits; the default GPT-2 targets are its projections."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pp_offload.models import apply_lora, default_target_modules, merged_state, unwrap_peft

    if model_type == "gpt2":
        config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    else:
        values = {k: v for k, v in LLAMA.items() if k != "model_type"}
        config = AutoConfig.for_model("llama", vocab_size=64, **values)
    model = apply_lora(AutoModelForCausalLM.from_config(config), r=4, alpha=8.0).eval()
    if model_type == "gpt2":
        assert default_target_modules(model) == ["c_attn", "c_fc", "c_proj"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # peft starts B at 0: make the adapters matter
    inner = unwrap_peft(model)
    merged = AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = merged.load_state_dict(merged_state(inner, inner.state_dict()), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # a tied head is the embedding
    merged.tie_weights()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_lora_section_from_overrides(tmp_path: Path) -> None:
    from pp_offload.recipe import LoraConfig, load_config

    config = load_config(None, ["lora.r=16", "lora.target_modules=[q_proj, v_proj]", "train.eval_every=5"])
    assert config.lora == LoraConfig(r=16, target_modules=["q_proj", "v_proj"])
    assert load_config(None, []).lora is None  # no section: full fine-tuning
    assert "Attributes:" in LoraConfig.__doc__ and all(
        f"{name}:" in LoraConfig.__doc__ for name in LoraConfig.__dataclass_fields__
    )


def test_lora_on_a_bf16_checkpoint_is_a_skeleton_until_split(tmp_path: Path, cache: str) -> None:
    """Pipelined runs read a bf16 checkpoint by part with LoRA too: the wrapped model is a meta skeleton,
    and a rank's split gets the checkpoint's tensors and adapters initialised by name, as the whole model
    gets them (the adapters do not depend on what a rank holds)."""
    from transformers import AutoTokenizer

    from pp_offload.models import is_peft_model, split_model
    from pp_offload.models.loading import load_split_weights
    from pp_offload.models.lora import init_adapters, unwrap_peft
    from pp_offload.recipe.model_loading import load_model

    config = _config(tmp_path / "out", lora=LORA)
    config["model"] = _pretrained_llama(tmp_path / "pretrained", cache)
    recipe = RecipeConfig.from_dict(config)
    tokenizer = AutoTokenizer.from_pretrained(config["model"]["path"])
    skeleton = load_model(recipe, tokenizer, partial=True)
    assert is_peft_model(skeleton) and all(p.is_meta for p in skeleton.parameters())
    split = split_model(skeleton, num_stages=4, stage_indices=[1, 2])
    load_split_weights(split, unwrap_peft(skeleton), config["model"]["path"])
    assert init_adapters(split.module, seed=0) == 2 * 7 * 2  # layers 1-2: 7 projections, A and B
    whole = unwrap_peft(load_model(recipe, tokenizer, partial=False)).state_dict()
    for name, tensor in split.module.state_dict().items():
        torch.testing.assert_close(tensor, whole[name], rtol=0, atol=0)
