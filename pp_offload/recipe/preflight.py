"""Every check of a run that needs more than the config itself (the machine, the model's config and files,
the schedule catalog, the planner), made before any process group exists.

Why one module: a config is checked in two steps and only two. `RecipeConfig.validated` checks every key's
type and range and the keys that go together; `preflight` checks the config against what it names and
where it runs: devices, the model and tokenizer sources, the model's layers and positions, the schedule and
its options, the batch split. Every rank calls both (and ``pp-offload train`` before starting any), so a
bad config stops all ranks alike, at once, instead of leaving some waiting in a collective for a rank that
already died; and a maintainer who looks for where a value is refused finds it in one of the two.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pp_offload.recipe.config import TRAIN_TOKENIZER, ConfigError, RecipeConfig
from pp_offload.recipe.metrics import check_report_targets
from pp_offload.recipe.model_loading import hf_config_of
from pp_offload.recipe.optimizer import OPTIMIZERS
from pp_offload.recipe.topology import Topology
from pp_offload.runtime.catalog import ScheduleInfo, schedule_info

__all__ = ["check_model_sources", "check_pipeline", "check_positions", "model_positions", "preflight"]

_OURS_ONLY = ("costs", "memory_limit")
#: Files of which at least one is in a tokenizer's directory (fast, slow and sentencepiece tokenizers).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
#: Weight files of a transformers model directory (safetensors, sharded or not, or the older .bin).
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json")
# A model's position limit, by the config attribute that holds it (GPT-2 maps max_position_embeddings to
# n_positions itself; the first that a config has wins).
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def preflight(config: RecipeConfig, topo: Topology, *, per_node: int | None = None) -> ScheduleInfo:
    """Check a `RecipeConfig.validated` config for a run on ``topo``: devices (``per_node``: the processes
    on this node, whose GPUs the launcher counts; None on a rank, which checks its own GPU when it picks
    it), model and tokenizer sources, the pipeline against the model's layer count, the sequence length
    against its positions, the optimizer's implementation and the report targets' packages. Raises
    `ConfigError` with one line naming the keys and the fix."""
    _check_devices(config, per_node)
    _check_optimizer(config)
    check_report_targets(config)
    check_model_sources(config)
    hf_config = hf_config_of(config)
    layers = getattr(hf_config, "num_hidden_layers", None) if topo.distributed else None
    info = check_pipeline(config, topo, layers)
    check_positions(config, hf_config)
    return info


def check_pipeline(config: RecipeConfig, topo: Topology, num_layers: int | None) -> ScheduleInfo:
    """The pipeline section against the schedule catalog, ``topo`` and the model's ``num_layers`` (None:
    unknown, not checked): schedule name, batch split, layers against stages, options that go with the
    schedule."""
    spec = config.pipeline
    auto = str(spec.schedule).lower() == "auto"
    if auto:
        _check_auto_policies(spec)
        probe = dataclasses.replace(spec, schedule="ScheduleVMin", offload="full")
        config = dataclasses.replace(config, pipeline=probe)
        spec = config.pipeline
    try:
        info = schedule_info(spec.schedule)
    except ValueError as error:
        raise ConfigError(f"pipeline.schedule: {error}") from error
    try:
        per_rank = info.stages_per_rank(spec.stages_per_rank)
    except ValueError as error:
        raise ConfigError(f"pipeline.stages_per_rank: {error}") from error
    num_stages = topo.pp * per_rank
    local_batch = config.train.global_batch_size // topo.dp
    if config.train.global_batch_size % topo.dp or local_batch % spec.microbatches:
        raise ConfigError(
            f"train.global_batch_size={config.train.global_batch_size} must split into pipeline.dp="
            f"{topo.dp} replicas x pipeline.microbatches={spec.microbatches} microbatches; pick a batch "
            f"size that is a multiple of {topo.dp * spec.microbatches}"
        )
    if info.module != "pp_offload.runtime.schedules":
        given = [key for key in _OURS_ONLY if getattr(spec, key) is not None]
        if given:
            raise ConfigError(f"pipeline.{given[0]} applies to pp_offload's schedules only, not {info.name}")
    if spec.activation_budget_gib is not None and not auto:
        raise ConfigError(
            "pipeline.activation_budget_gib goes with pipeline.schedule=auto (which picks a schedule within "
            f"it); with a named schedule ({info.name}) use ScheduleVAdaptive's memory_limit or offload"
        )
    if (spec.memory_limit is not None) != (info.name == "ScheduleVAdaptive") and not auto:
        raise ConfigError(
            "pipeline.memory_limit (a fraction of 1F1B's activation memory, e.g. 0.5) goes with "
            f"pipeline.schedule=ScheduleVAdaptive and only with it (schedule: {info.name}, "
            f"memory_limit: {spec.memory_limit})"
        )
    if num_layers is not None and num_layers < num_stages:
        raise ConfigError(
            f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages "
            f"({topo.pp} ranks x {per_rank} stages per rank for {info.name}): "
            + _fewer_stages_fix(info, num_layers, topo.world)
        )
    if spec.layers_per_stage is not None and len(spec.layers_per_stage) != num_stages:
        raise ConfigError(
            f"pipeline.layers_per_stage has {len(spec.layers_per_stage)} entries but there are {num_stages} "
            "stages"
        )
    if spec.offload not in (None, "none") and not info.multi_stage:
        raise ConfigError(
            f"pipeline.offload needs a multi-stage schedule; {info.name} is single-stage: use e.g. "
            "ScheduleVHalf or ScheduleInterleaved1F1B"
        )
    if config.train.compile not in (False, None) and not spec.deferred_w and info.split_backward:
        # the runtime refuses it too (`pp_offload.runtime.deferred_w.refuse_compiled_split`), but only
        # after every rank loaded its weights
        which = f"schedule: auto (its probe runs {info.name})" if auto else info.name
        raise ConfigError(
            f"train.compile with pipeline.deferred_w=false on {which}: torch's retained-graph split runs a "
            "compiled layer's backward twice (in I and in W: wrong gradients); set pipeline.deferred_w=true "
            "(the default), turn train.compile off, or use a schedule without split backward "
            "(ScheduleInterleaved1F1B)"
        )
    return info


def _fewer_stages_fix(info: ScheduleInfo, num_layers: int, world: int) -> str:
    """What to change when the model has fewer layers than stages, for this schedule's placement; with
    ``world`` processes, the ``--dp`` that keeps them all busy with fewer pipeline ranks."""
    if info.placement == "loop":
        return "set fewer pipeline.stages_per_rank, use fewer pipeline ranks, or a model with more layers"
    v = info.placement == "v"
    ranks = num_layers // 2 if v else num_layers
    if ranks < 1:
        return "use a single-stage schedule (Schedule1F1B), or a model with more layers"
    why = " (a V schedule holds 2 stages per rank)" if v else " (one stage each)"
    fix = f"use at most {ranks} pipeline rank{'s' if ranks > 1 else ''}{why}"
    pp = max(d for d in range(1, min(ranks, world) + 1) if world % d == 0)
    if world > 1:
        dp = world // pp
        ranks_word = f"{pp} pipeline rank{'s' if pp > 1 else ''}"
        replicas = f"{dp} data-parallel replicas"
        fix += f": with {world} processes, --dp {dp} (pipeline.dp={dp}: {ranks_word} x {replicas})"
    return f"{fix}; or a model with more layers"


def _check_auto_policies(spec: Any) -> None:
    """``schedule: auto``'s list of offload policies, as the planner reads it (the planner's own check:
    `pp_offload.plan.auto.offload_candidates`)."""
    if isinstance(spec.offload, list):
        from pp_offload.plan.auto import offload_candidates

        try:
            offload_candidates(spec.offload)
        except ValueError as error:
            raise ConfigError(f"pipeline.offload (auto's candidates): {error}") from error


def _check_devices(config: RecipeConfig, per_node: int | None) -> None:
    """``train.device: cuda`` needs a GPU, and the launcher one per process it starts on this node."""
    if config.train.device != "cuda":
        return
    import torch

    count = torch.cuda.device_count()
    if per_node is not None and count < per_node:
        raise ConfigError(
            f"train.device=cuda with {per_node} processes needs {per_node} GPUs (one per rank), this machine "
            f"shows {count}: fewer processes, or train.device=cpu"
        )
    if not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu")


def _check_optimizer(config: RecipeConfig) -> None:
    """A fused AdamW needs torch's fused kernel for the run's device type: asked of torch itself, with a
    one-element optimizer (torch refuses at construction where it has none)."""
    if not OPTIMIZERS[config.train.optimizer].get("fused"):
        return
    import torch

    choice = config.train.device
    kind = "cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu"
    try:
        torch.optim.AdamW([torch.zeros(1, device=kind, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError) as error:
        reason = " ".join(str(error).split())
        raise ConfigError(
            f"train.optimizer={config.train.optimizer}: torch {torch.__version__} has no fused AdamW for "
            f"{kind} tensors ({reason}); use adamw or adamw_foreach"
        ) from None


def check_model_sources(config: RecipeConfig) -> None:
    """What ``model.path`` and ``model.tokenizer`` name must be there, checked in a second before anything
    loads: a local directory must hold a config, weights and (unless ``model.tokenizer`` is set) a
    tokenizer, each missing one named with the key that provides it; a hub id fails fast when the hub
    cannot be reached (offline mode uses the local cache) instead of after transformers' half minute of
    retries."""
    from pp_offload.hub import endpoint, hub_reachable, offline_mode

    spec = config.model
    if spec.path is not None:
        _check_model_dir(spec.path, tokenizer_given=spec.tokenizer is not None)
    if spec.tokenizer not in (None, TRAIN_TOKENIZER):
        _check_tokenizer_dir(spec.tokenizer)
    remote = [
        (key, value)
        for key, value in (("model.path", spec.path), ("model.tokenizer", spec.tokenizer))
        if value is not None and value != TRAIN_TOKENIZER and not Path(value).exists()
    ]
    if remote and not offline_mode() and not hub_reachable():
        key, value = remote[0]
        raise ConfigError(
            f"{key}={value!r} is not a local path and the hub ({endpoint()}) is unreachable: download it "
            "first and give its directory, or set HF_HUB_OFFLINE=1 to use a copy in your Hugging Face cache"
        )


def _looks_local(value: str) -> bool:
    """A path the user clearly meant as a directory, so a missing one is a typo, not a hub id to look up."""
    return value.startswith(("/", "./", "../", "~"))


def _check_model_dir(path: str, *, tokenizer_given: bool) -> None:
    local = Path(path).expanduser()
    if not local.exists():
        if _looks_local(path):
            raise ConfigError(f"model.path={path!r}: no such directory")
        return  # a hub id
    if not local.is_dir():
        raise ConfigError(
            f"model.path={path!r} is a file; give the model's directory (config.json, weights, tokenizer)"
        )
    if not (local / "config.json").is_file():
        raise ConfigError(
            f"model.path={path!r} holds no config.json: give a transformers model directory (as written by "
            "save_pretrained), or build a new model from its config with model.config: {model_type: ...}"
        )
    if not any(next(local.glob(pattern), None) for pattern in _WEIGHT_PATTERNS):
        raise ConfigError(
            f"model.path={path!r} holds a config.json but no weights (model.safetensors): to train a new "
            "model from that config, give its entries as model.config (e.g. model.config: {model_type: gpt2, "
            "n_layer: 4}) instead of model.path, with model.tokenizer (a tokenizer directory, or train)"
        )
    if not tokenizer_given and not _has_tokenizer(local):
        raise ConfigError(
            f"model.path={path!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): set "
            "model.tokenizer to a tokenizer's directory or hub id"
        )


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _TOKENIZER_FILES)


def _check_tokenizer_dir(value: str) -> None:
    local = Path(value).expanduser()
    if not local.exists():
        if _looks_local(value):
            raise ConfigError(f"model.tokenizer={value!r}: no such directory")
        return  # a hub id
    if not local.is_dir() or not _has_tokenizer(local):
        raise ConfigError(
            f"model.tokenizer={value!r} is not a tokenizer directory (none of "
            f"{', '.join(_TOKENIZER_FILES)}): give the directory a tokenizer's save_pretrained wrote, a hub "
            "id, or train (a byte-level BPE trained on data.path)"
        )


def model_positions(hf_config: Any) -> tuple[str, int] | None:
    """(the config key, the count) of the positions ``hf_config`` supports, or None when it names none."""
    given = hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}
    for key in _POSITION_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            # the key as the user wrote it: GPT-2's config stores n_positions for max_position_embeddings
            named = key if key in given else next((k for k in _POSITION_KEYS if given.get(k) == value), key)
            return named, value
    return None


def check_positions(config: RecipeConfig, hf_config: Any) -> None:
    """Refuse a ``data.seq_len`` longer than the model's positions (``max_position_embeddings``, GPT-2's
    ``n_positions``), naming both keys: otherwise the position embedding is indexed out of range in the
    first forward (a 154-line ``IndexError``) or, for rotary models, the model runs on positions it never
    saw."""
    found = model_positions(hf_config)
    if found is None or config.data.seq_len <= found[1]:
        return
    key, positions = found
    where = f"model.config.{key}" if config.model.config is not None else f"{key} of model.path's config.json"
    fix = (
        f"raise model.config.{key}" if config.model.config is not None else "use a model with more positions"
    )
    raise ConfigError(
        f"data.seq_len={config.data.seq_len} is longer than the model's positions ({where}={positions}): "
        f"set data.seq_len <= {positions}, or {fix}"
    )
