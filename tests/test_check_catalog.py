"""``--check`` builds what the ranks build (`pp_offload.recipe.dry_build`), walked over the catalogs.

Every offload policy and recompute plan the parsers read (their own catalogs: `offload_examples`,
`recompute_examples`) on a schedule of each family (ours V-Half; torch's split-backward ZBV; torch's looped
Interleaved1F1B) builds offline; what the config checks refuse is refused in one line; the recipe YAML
`pp-offload plan` prints for a test shape, and ``schedule: auto``'s pick, build; the planner's pick for
Llama-3-8B builds on the meta device; and a representative subset (budget:sublayer with recompute plans,
on V-Half and ZBV) trains on 2 gloo ranks exactly as the same schedule without offload.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from _dist import run_on_ranks
from test_recipe import LLAMA  # the recipe tests' tiny Llama

from pp_offload.order.offload import offload_examples, resolve_offload
from pp_offload.parallel import checkpointing_mode
from pp_offload.recipe import ConfigError, RecipeConfig
from pp_offload.recipe.dry_build import DryBuild, dry_build
from pp_offload.recipe.preflight import check_pipeline
from pp_offload.recipe.topology import Topology
from pp_offload.recompute_plan import recompute_examples
from pp_offload.runtime.catalog import schedule_info, schedule_names

pytestmark = pytest.mark.usefixtures("one_thread")

# a schedule of each family: our V, torch's V with split backward, torch's looped (full backward)
SCHEDULES = ("ScheduleVHalf", "ScheduleZBVZeroBubble", "ScheduleInterleaved1F1B")
TOPO = Topology(rank=0, world=2, local_rank=0, pp=2, dp=1)


def _config(
    out: Path, schedule: str, offload: Any, recompute: Any, *, model: dict = LLAMA, **sections
) -> dict:
    config = {
        "model": {"config": model},
        "data": {"path": "embedded", "seq_len": 32, "max_examples": 100},
        "pipeline": {"schedule": schedule, "microbatches": 4, "offload": offload},
        "train": {
            "steps": 1,
            "global_batch_size": 8,
            "activation_checkpointing": recompute,
            "warmup_steps": 1,
        },
        "output": {"dir": str(out), "report_to": ["csv"], "log_every": 0, "export": False},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    return config


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("check_catalog")


@pytest.fixture(scope="module")
def tokenizer(cache: Path) -> Any:
    """The tokenizer the ranks would use (trained once on the embedded corpus, cached)."""
    from pp_offload.data import embedded_assets, embedded_dir, load_examples
    from pp_offload.recipe.sources import load_tokenizer

    config = RecipeConfig.from_dict(_config(cache, "ScheduleVHalf", None, False))
    examples = load_examples(config.data, cache_dir=cache / "cache")
    return load_tokenizer(config, embedded_assets(embedded_dir(cache / "cache")).tokenizer_dir, examples)


def _check(config: dict, tokenizer: Any, topo: Topology = TOPO) -> DryBuild:
    """What ``--check`` runs for a pipelined config after the data checks: the config checks every rank makes
    (preflight), then the dry build; its stdout (rank 0's lines) swallowed."""
    recipe = RecipeConfig.from_dict(config).validated()
    check_pipeline(recipe, topo, recipe.model.config["num_hidden_layers"] if recipe.model.config else None)
    with contextlib.redirect_stdout(io.StringIO()):
        return dry_build(recipe, topo, tokenizer)


def _assert_built(build: DryBuild, offload: Any, recompute: Any, *, moves: bool = True) -> None:
    """Every rank built its stages, wrapped the recompute plan's layers and lowered its order, with OFFLOAD
    and RELOAD actions where the policy is on (``moves``: and where it moves something; a budget may find
    nothing that hides within its slowdown)."""
    assert len(build.ranks) == TOPO.pp and all(r.actions > 0 for r in build.ranks), build.summary()
    wrapped = sum(r.recomputed for r in build.ranks)
    assert (wrapped > 0) == (checkpointing_mode(recompute) is not None), (recompute, build.summary())
    copies = sum(r.copy_actions for r in build.ranks)
    enabled = resolve_offload(offload).enabled
    assert copies == 0 if not enabled else (copies > 0 or not moves), (offload, build.summary())
    assert copies >= 2 * sum(r.offloaded_chunks for r in build.ranks), build.summary()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_offload_policy_and_recompute_plan_passes_check(
    tmp_path: Path, tokenizer: Any, schedule: str
) -> None:
    """Each offload policy (no recompute), then each recompute plan under ``budget:sublayer`` (the policy
    that hooks the most: sub-layer units inside the recompute wrappers), builds on every rank."""
    for offload in offload_examples():
        _assert_built(_check(_config(tmp_path, schedule, offload, False), tokenizer), offload, False)
    for plan in recompute_examples():
        build = _check(_config(tmp_path, schedule, "budget:sublayer", plan), tokenizer)
        _assert_built(build, "budget:sublayer", plan)


def test_sublayer_offload_plans_around_a_stage_without_layers() -> None:
    """The planner's split of a short model can leave the LM head's stage without decoder layers (no sub-layer
    units, ``unit_compute`` None): ``--check`` of ``schedule: auto`` plans on such a split."""
    from pp_offload.plan.evaluate import build_orders, offload_plan
    from pp_offload.plan.handoff import planner_setup

    shape = {**LLAMA, "vocab_size": 512}
    setup = planner_setup(
        shape, schedule="ScheduleVHalf", pp=2, seq_len=32, microbatch_size=2, num_microbatches=4
    )
    assert 0 in setup.layers
    order = build_orders(setup, [4], search="full", virtual_stages=2).orders[4]
    plan = offload_plan(setup, order, "budget:sublayer")
    assert plan.layered and all(setup.layers[stage] for stage, _ in plan.layered)


def test_check_refuses_what_every_rank_refuses_in_one_line(tmp_path: Path, tokenizer: Any) -> None:
    """Walking every schedule with every offload policy: ``--check`` passes or refuses with one line, and
    refuses exactly where the ranks' own checks do (offload on a single-stage schedule, V-Adaptive without its
    memory limit); a split the model cannot take (layers that do not add up) is refused by the dry build,
    which the config checks alone let through."""
    refused = set()
    for name in schedule_names():
        for offload in offload_examples():
            try:
                _check(_config(tmp_path, name, offload, False), tokenizer)
            except ConfigError as error:
                assert "\n" not in str(error), str(error)
                refused.add((name, offload))
    single = {n for n in schedule_names() if not schedule_info(n).multi_stage}
    expected = {(n, o) for n in single for o in offload_examples() if resolve_offload(o).enabled}
    expected |= {("ScheduleVAdaptive", o) for o in offload_examples()}
    assert refused == expected
    bad_split = _config(
        tmp_path, "ScheduleVHalf", "budget:sublayer", "mlp", pipeline={"layers_per_stage": [1, 1, 1, 2]}
    )
    with pytest.raises(ConfigError, match="pipeline rank 0 cannot build the pipeline .*split") as error:
        _check(bad_split, tokenizer)
    assert "\n" not in str(error.value)


def test_cli_check_builds_and_refuses_with_exit_2(tmp_path: Path, cache: Path, capsys) -> None:
    """``pp-offload train --check``: the fixed budget:sublayer config the issue reported passes and says what
    it built; a split that cannot be built ends in one line on stderr and exit code 2."""
    from pp_offload.recipe import train_command

    def run(config: dict) -> int:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        parser = argparse.ArgumentParser()
        train_command.add_arguments(parser)
        return train_command.run_from_args(
            parser.parse_args(["--nproc-per-node", "2", "--config", str(path), "--check"])
        )

    good = _config(cache, "ScheduleZBVZeroBubble", "budget:sublayer", "mlp")
    assert run(good) == 0
    out = capsys.readouterr().out
    assert "built on the meta device" in out and "OFFLOAD/RELOAD actions lowered" in out
    bad = _config(
        cache, "ScheduleVHalf", "budget:sublayer", False, pipeline={"layers_per_stage": [1, 1, 1, 2]}
    )
    assert run(bad) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "cannot build the pipeline" in err[0], err


# --- what the planner and schedule: auto print ------------------------------------------------------------

SHAPE = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8}
SHAPE |= {"num_attention_heads": 4, "num_key_value_heads": 2}  # the hidden model's size, seq 256


def test_every_yaml_the_planner_prints_for_the_test_shape_passes_check(
    tmp_path: Path, tokenizer: Any
) -> None:
    """The recipe YAML `pp-offload plan` prints (`recipe_yaml`) for every candidate it evaluates on the test
    shape (each schedule family; whole-chunk, layer and sub-layer offload; one-mode and two-mode recompute
    plans), loaded as the user would paste it into a config, passes ``--check``."""
    from pp_offload.plan import plan
    from pp_offload.plan.report import recipe_yaml

    model = SHAPE | {"vocab_size": len(tokenizer)}
    result = plan(
        model,
        seq_len=256,
        microbatch_size=2,
        num_microbatches=4,
        pp=2,
        schedules=SCHEDULES,
        jobs=1,
        offload=["none", "full", "budget:close-w", "budget:sublayer"],
        recompute=["none", "mlp", "selective:0.75,mlp"],
        evaluate_dominated=True,
    )
    candidates = [c for c in result.candidates if c.evaluated]
    assert {resolve_offload(c.offload).granularity for c in candidates} == {"layer", "sublayer"}
    moved = set()
    for candidate in candidates:
        printed = yaml.safe_load(recipe_yaml(result, candidate))
        config = _config(tmp_path, "-", None, False, model=model)
        for section, values in printed.items():
            config[section] = {**config[section], **values}
        build = _check(config, tokenizer)
        _assert_built(build, candidate.offload, candidate.recompute, moves=False)
        if sum(r.copy_actions for r in build.ranks):
            moved.add(candidate.offload)
    assert "budget:sublayer" in moved and "full" in moved, moved


def test_auto_builds_its_probe_and_the_planners_pick(tmp_path: Path, tokenizer: Any) -> None:
    """``schedule: auto``: the probe pipeline and the pick the planner's model predicts build, and the check
    says the pick is the planner's, not a measurement; a budget nothing fits in builds the probe only."""
    model = SHAPE | {"vocab_size": len(tokenizer)}
    auto = {"offload": ["none", "budget", "budget:sublayer"], "activation_budget_gib": 0.02}
    config = _config(tmp_path, "auto", None, "mlp", model=model, pipeline=auto, data={"seq_len": 256})
    build = _check(config, tokenizer)
    assert build.schedule in SCHEDULES + ("ScheduleVAdaptive", "ScheduleVMin", "ScheduleVZB")
    assert build.ranks and "not a measurement" in build.notes[-1]
    config["pipeline"]["activation_budget_gib"] = 0.001
    probe_only = _check(config, tokenizer)
    assert probe_only.schedule == "auto (probe)" and "picks nothing" in probe_only.notes[-1]


def test_planner_pick_for_llama_3_8b_passes_check_on_the_meta_device(tmp_path: Path, tokenizer: Any) -> None:
    """``pp-offload plan --model llama-3-8b --machine H100 --seq-len 8192 --pp 4 --microbatches 16`` picks
    ScheduleInterleavedZeroBubble + budget + mlp recompute (budget:sublayer before the planner counted the
    deferred-W queue; docs/planner.md). Planned here among that schedule with and without budget:sublayer
    and mlp recompute only (the full plan takes minutes; sub-layer units are the harder build), its YAML
    with a config-built model of that shape passes ``--check`` on the meta device in seconds."""
    from pp_offload.plan import plan
    from pp_offload.plan.report import recipe_yaml
    from pp_offload.plan.shapes import SHAPES

    result = plan(
        "llama-3-8b",
        seq_len=8192,
        microbatch_size=1,
        num_microbatches=16,
        pp=4,
        machine="H100",
        schedules=["ScheduleInterleavedZeroBubble"],
        offload=["none", "budget:sublayer"],
        recompute=["mlp"],
        jobs=1,
    )
    printed = yaml.safe_load(recipe_yaml(result))
    assert printed["pipeline"]["offload"] == "budget:sublayer", printed
    model = SHAPES["llama-3-8b"] | {"max_position_embeddings": 8192}
    config = _config(tmp_path, "-", None, False, model=model)
    for section, values in printed.items():
        config[section] = {**config[section], **values}
    build = _check(config, tokenizer, Topology(rank=0, world=4, local_rank=0, pp=4, dp=1))
    assert len(build.ranks) == 4 and sum(r.copy_actions for r in build.ranks) > 0
    assert build.seconds < 30, build.summary()  # a few seconds on an idle machine; loose for a busy one


# --- a representative subset trains (2 gloo ranks) ---------------------------------------------------------

TRAINED = (
    ("ScheduleVHalf", "budget:sublayer", "selective:0.75,mlp"),
    ("ScheduleZBVZeroBubble", "budget:sublayer", "mlp"),
    ("ScheduleZBVZeroBubble", "budget:close-w:sublayer", "full"),
)


def _train(rank: int, world: int, configs: list[dict], cache: str) -> list[list[float]]:
    from pp_offload.recipe.train import run

    return [run(RecipeConfig.from_dict(c), cache_dir=cache, progress=False).losses for c in configs]


def test_budget_sublayer_with_recompute_plans_trains_as_without_offload(
    tmp_path: Path, tokenizer: Any
) -> None:
    """Each case passes ``--check``, then trains 2 steps through the recipe on 2 gloo ranks with the losses of
    its schedule without offload or recompute (both move or recompute bytes, never change them: the second
    step's loss carries the first step's gradients)."""
    plain = {schedule: _config(tmp_path / schedule, schedule, None, False) for schedule, _, _ in TRAINED}
    cases = [_config(tmp_path / str(i), *case) for i, case in enumerate(TRAINED)]
    runs = [*plain.values(), *cases]
    for config in runs:
        config["train"]["steps"] = 2
        _check(config, tokenizer)
    losses = run_on_ranks(_train, 2, runs, str(tmp_path / "cache"), timeout=300)[0]
    want = dict(zip(plain, losses, strict=False))
    for case, got in zip(TRAINED, losses[len(plain) :], strict=True):
        assert len(got) == 2 and got == pytest.approx(want[case[0]], rel=1e-5, abs=1e-6), (case, got)
