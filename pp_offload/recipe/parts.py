"""The pieces a recipe run is built from: process group, model, tokenizer, pipeline.

Why separate from the training loop: each piece validates its own input and fails with a clear error
before any collective call, so a bad configuration stops every rank the same way instead of leaving some
ranks waiting in a collective for a rank that already died.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pp_offload.models import ModelSplit, TokenCrossEntropy, split_model
from pp_offload.parallel import ShardedStages
from pp_offload.recipe.config import ConfigError, RecipeConfig
from pp_offload.runtime.catalog import ScheduleInfo, build_schedule, schedule_info, stage_indices
from pp_offload.runtime.dropout_keys import DropoutKeys, key_pipeline_dropout, unkeyed_dropout

__all__ = [
    "Pipeline",
    "Topology",
    "build_pipeline",
    "check_config_model",
    "check_model_sources",
    "device_for",
    "init_process_group",
    "launcher_store",
    "load_model",
    "load_tokenizer",
    "num_layers_of",
    "preflight",
    "restart_count",
    "topology",
]

_OURS_ONLY = ("costs", "memory_limit")


@dataclass(frozen=True)
class Topology:
    """Where this process sits: ``rank`` of ``world`` processes, ``pp`` pipeline ranks x ``dp`` replicas."""

    rank: int
    world: int
    local_rank: int
    pp: int
    dp: int

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp

    @property
    def distributed(self) -> bool:
        return self.world > 1


def topology(config: RecipeConfig, *, world: int | None = None) -> Topology:
    """Read rank and world size from the launcher's environment (torchrun, accelerate launch) and check them
    against the config's pipeline and data-parallel sizes. ``world``: check for that many processes
    instead, as rank 0 (a launcher checking a config before it starts them)."""
    if world is not None:
        rank = 0
    elif dist.is_available() and dist.is_initialized():  # the caller made the group (tests, notebooks)
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dp = int(config.pipeline.dp)
    if dp < 1:
        raise ConfigError(f"pipeline.dp must be >= 1, got {dp}")
    if config.pipeline.pp is None and world % dp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(
            f"world size {world} is not a multiple of pipeline.dp={dp} (pipeline ranks = world size / dp): "
            f"launch a multiple of {dp} processes, or use a pipeline.dp among {divisors}"
        )
    pp = config.pipeline.pp if config.pipeline.pp is not None else world // dp
    if pp < 1 or pp * dp != world:
        raise ConfigError(
            f"world size {world} is not pipeline.pp x pipeline.dp = {config.pipeline.pp} x {dp}: launch "
            f"{max(pp, 1) * dp} processes or change pipeline.pp / pipeline.dp"
        )
    replicate = int(config.pipeline.dp_replicate)
    if replicate < 1 or dp % replicate:
        raise ConfigError(
            f"pipeline.dp_replicate={replicate} must divide pipeline.dp={dp} (HSDP: dp = dp_replicate x "
            f"dp_shard); pick one of {[d for d in range(1, dp + 1) if dp % d == 0]}"
        )
    return Topology(rank=rank, world=world, local_rank=local_rank, pp=pp, dp=dp)


def device_for(config: RecipeConfig, topo: Topology) -> torch.device:
    """``train.device``: ``auto`` picks this rank's GPU when there is one, else the CPU."""
    choice = config.train.device
    if choice not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        # joined before the recipe ran (a test harness, a notebook): gloo carries no CUDA tensors
        if choice == "cuda":
            raise ConfigError(
                "train.device=cuda, but the process group was initialized with the gloo backend, which "
                "cannot send CUDA tensors between pipeline stages; initialize it with nccl, or let the "
                "recipe do it"
            )
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if topo.local_rank >= count:
        raise ConfigError(
            f"rank {topo.rank} (local rank {topo.local_rank}) needs its own GPU, cuda:{topo.local_rank}, but "
            f"this machine shows {count} CUDA device(s): launch at most {count} process(es) per node "
            "(torchrun --nproc-per-node), or train.device=cpu; ranks cannot share a GPU (NCCL refuses a "
            "communicator between two ranks on one device)"
        )
    torch.cuda.set_device(topo.local_rank)
    return torch.device("cuda", topo.local_rank)


def init_process_group(config: RecipeConfig, topo: Topology, device: torch.device) -> bool:
    """Join the job's process group (gloo on CPU, NCCL on CUDA) with the configured collective timeout.

    Returns whether it created the group (and so should destroy it at the end)."""
    if not topo.distributed or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=float(config.train.timeout_s))
    store = launcher_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=topo.rank, world_size=topo.world, timeout=timeout)
    return True


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
#: ``model.tokenizer``'s value that trains a byte-level BPE on the training data.
TRAIN_TOKENIZER = "train"


def launcher_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun: the agent's key-value store, with keys private to this restart; else None.

    Why: torchrun's workers share the store its agent hosts (``TORCHELASTIC_USE_AGENT_STORE``), and that
    store lives across ``--max-restarts`` rounds, so the keys by which the gloo (or NCCL) ranks of round
    0 found each other are still there when the workers of round 1 start. A restarted rank that reads
    them before its peer has written its new address connects to the dead one (gloo's ``connectFullMesh``:
    connection refused) or waits for a peer that never answers; a plain script whose ranks start within
    milliseconds of each other rarely loses that race, the recipe (seconds of data loading first) often
    does. Prefixing every key with the restart count gives each round a clean namespace.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"pp_offload/{run_id}/restart_{restart}", store)


def restart_count() -> int:
    """How many times torchrun restarted this job's workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def check_model_sources(config: RecipeConfig) -> None:
    """What ``model.path`` and ``model.tokenizer`` name must be there, checked in a second before anything
    loads: a local directory must hold a config, weights and (unless ``model.tokenizer`` is set) a
    tokenizer, each missing one named with the key that provides it; a hub id fails fast when the hub
    cannot be reached (offline mode uses the local cache) instead of after transformers' half minute of
    retries."""
    from pp_offload.hub import endpoint, hub_reachable, offline_mode

    spec = config.model
    if spec.tokenizer == TRAIN_TOKENIZER and spec.path is not None:
        raise ConfigError(
            f"model.tokenizer=train trains a new tokenizer, whose token ids the pretrained model.path="
            f"{spec.path!r} has never seen: use its own tokenizer (leave model.tokenizer unset), or build a "
            "new model from model.config"
        )
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


def load_tokenizer(config: RecipeConfig, embedded_tokenizer: Path | None, examples: Any = None) -> Any:
    """The tokenizer: ``model.tokenizer``, else ``model.path``, else the embedded one. With
    ``model.tokenizer: train``, the byte-level BPE of the training ``examples``
    (`pp_offload.data.tokenizer.trained_tokenizer`, kept in ``<output.dir>/tokenizer``)."""
    from transformers import AutoTokenizer

    if config.model.tokenizer == TRAIN_TOKENIZER:
        from pp_offload.data import DataError
        from pp_offload.data.tokenizer import trained_tokenizer

        if examples is None:
            raise ValueError("model.tokenizer=train needs the training examples")
        try:
            return trained_tokenizer(
                examples,
                config.data,
                config.output.dir,
                vocab_size=config.model.tokenizer_vocab_size,
                keep_existing=config.output.resume,
            )
        except DataError as error:
            raise ConfigError(f"model.tokenizer=train: {error}") from error
    source = config.model.tokenizer or config.model.path
    if source is None:
        if embedded_tokenizer is None:
            raise ConfigError(
                "no tokenizer: set model.tokenizer to a tokenizer's directory or hub id, or to train (a "
                "byte-level BPE trained on data.path, for a model built from model.config)"
            )
        source = str(embedded_tokenizer)
    key = "model.tokenizer" if config.model.tokenizer else "model.path"
    with _missing_from_cache(key, source):
        return AutoTokenizer.from_pretrained(source)


@contextlib.contextmanager
def _missing_from_cache(key: str, value: str) -> Iterator[None]:
    """Offline, transformers reports a hub id missing from the cache as a failed connection, with a
    traceback on every rank: say which key names it and what to do, as a configuration error."""
    from pp_offload.hub import offline_mode

    try:
        yield
    except OSError as error:
        if not offline_mode() or Path(value).exists():
            raise
        raise ConfigError(
            f"{key}={value!r} is not a local path and not in your Hugging Face cache, and offline mode "
            f"(HF_HUB_OFFLINE) forbids downloading it: download it first (`hf download {value}` where the "
            f"hub is reachable) and give its directory, or unset HF_HUB_OFFLINE (transformers: "
            f"{str(error).splitlines()[0] if str(error) else type(error).__name__})"
        ) from error


def load_model(config: RecipeConfig, tokenizer: Any, *, partial: bool = False) -> nn.Module:
    """The causal LM on the CPU in fp32: from ``model.path``, or randomly initialised from ``model.config``.

    Every rank builds the same model (same seed); each then keeps the stages it holds. The vocabulary of
    a config-only model defaults to the tokenizer's. ``partial`` (pipelined runs): a pretrained model whose
    checkpoint is not in fp32 (bf16 on the hub) is returned as a skeleton on the meta device and
    `build_pipeline` reads only the rank's own tensors (`pp_offload.models.loading`: an fp32 checkpoint
    is memory-mapped by ``from_pretrained`` and costs no more); when the checkpoint cannot be read by part
    (no safetensors, names that do not match), the whole model is loaded, as without ``partial``.
    With a ``lora`` section the model (or the skeleton) comes back wrapped in a peft ``PeftModel``; its
    adapters are initialised by name (`pp_offload.models.lora.init_adapters`), so a rank that loads by part
    gets the same adapters as the unsplit model.
    """
    spec = config.model
    if (spec.path is None) == (spec.config is None):
        raise ConfigError("set exactly one of model.path (hub id or local dir) and model.config (a dict)")
    model = _load_model(config, tokenizer, partial=partial)
    return _with_lora(config, model) if config.lora is not None else model


def packing_note(model: nn.Module) -> str | None:
    """A line to print when ``model``'s family cannot keep packed documents apart, else None.

    The recipe packs several documents into each ``data.seq_len`` block and separates them through the
    position ids (they restart at 0 for each document). GPT-OSS, AFMoE and Falcon build their attention
    masks without the position ids in transformers' own forward, so their documents attend to the earlier
    documents of the same block; the split model does exactly what the unsplit one does (that is what
    ``split_model`` proves), so this is a property of the family, which the user should know about.
    """
    from pp_offload.models.families import UnsupportedModelError, family_of
    from pp_offload.models.lora import unwrap_peft

    try:
        family = family_of(unwrap_peft(model))
    except UnsupportedModelError:
        return None
    if family.mask_positions:
        return None
    return (
        f"note: {type(model).__name__} builds its attention masks without position ids, so documents packed "
        "into one data.seq_len block attend to the earlier documents of that block (transformers' own "
        "forward does the same); set data.seq_len near your documents' length to keep them mostly apart"
    )


def _with_lora(config: RecipeConfig, model: nn.Module) -> nn.Module:
    """``model`` wrapped by peft with the ``lora`` section's adapter, initialised from ``train.seed`` and
    each adapter's name: the same on every rank, whatever it holds, and on resume."""
    from pp_offload.models.families import UnsupportedModelError
    from pp_offload.models.lora import LoraError, apply_lora, init_adapters, unwrap_peft

    lora = config.lora
    assert lora is not None
    try:
        wrapped = apply_lora(
            model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
        )
    except (LoraError, UnsupportedModelError) as error:
        raise ConfigError(f"lora: {error}") from error
    init_adapters(unwrap_peft(wrapped), seed=config.train.seed)  # a meta skeleton's: after its load
    return wrapped


def _load_model(config: RecipeConfig, tokenizer: Any, *, partial: bool) -> nn.Module:
    spec = config.model
    torch.manual_seed(config.train.seed)
    kwargs = {"attn_implementation": spec.attn_implementation, "dtype": torch.float32}
    if spec.path is not None:
        with _missing_from_cache("model.path", spec.path):
            return _load_pretrained(spec.path, kwargs, partial)
    return _config_model(config, tokenizer, kwargs)


def check_config_model(config: RecipeConfig, tokenizer: Any, *, pipelined: bool) -> None:
    """Build ``model.config``'s model on the meta device (no memory, no time): entries that its config
    class accepts but its modules refuse (``n_embd`` not divisible by ``n_head``), or a family that
    cannot be pipelined, fail here as a configuration error instead of on every rank."""
    if config.model.config is None:
        return
    from transformers.utils import logging as hf_logging

    from pp_offload.models.families import family_of

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a trial build: its notes would come again from every rank
    try:
        with torch.device("meta"):
            model = _config_model(
                config, tokenizer, {"attn_implementation": config.model.attn_implementation}
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    if pipelined:
        family_of(model)  # UnsupportedModelError: a configuration error


def _config_model(config: RecipeConfig, tokenizer: Any, kwargs: dict[str, Any]) -> nn.Module:
    from transformers import AutoModelForCausalLM

    values = dict(config.model.config or {})
    values.setdefault("vocab_size", len(tokenizer))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        values.setdefault(key, getattr(tokenizer, key, None))
    hf_config = _hf_config(values)
    try:
        return AutoModelForCausalLM.from_config(hf_config, **kwargs)
    except (ValueError, TypeError, AssertionError) as error:
        if isinstance(error, ValueError) and "Unrecognized configuration class" in str(error):
            raise ConfigError(
                f"model.config: model_type={hf_config.model_type!r} has no causal LM in transformers"
            ) from error
        raise ConfigError(
            f"model.config: transformers cannot build a {hf_config.model_type!r} model from these entries: "
            f"{_short(error)}"
        ) from error


def _hf_config(values: dict[str, Any]) -> Any:
    """The transformers config of ``model.config``'s entries; a missing or unknown ``model_type`` or an
    entry its config class refuses is a configuration error naming it."""
    from transformers import AutoConfig

    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model.config needs a model_type (e.g. llama, qwen2, gpt2)")
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as error:  # ValueError, TypeError, huggingface_hub's StrictDataclassError: the entries
        cause = error.__cause__ if isinstance(error.__cause__, (ValueError, TypeError)) else error
        raise ConfigError(f"model.config (model_type={model_type!r}): {_short(cause)}") from error


def _short(error: BaseException, limit: int = 300) -> str:
    """A dependency's error message on one line, cut to ``limit`` characters."""
    reason = " ".join(str(error).split()) or type(error).__name__
    return reason if len(reason) <= limit else reason[:limit] + "..."


def _load_pretrained(path: str, kwargs: dict[str, Any], partial: bool) -> nn.Module:
    """``model.path``'s model: a meta-device skeleton to be read by part (see `load_model`), or whole."""
    from transformers import AutoModelForCausalLM

    if partial:
        from pp_offload.models.loading import (
            PartialLoadError,
            check_checkpoint,
            checkpoint_dtypes,
            empty_model,
        )

        try:
            if checkpoint_dtypes(path) - {"F32", "I64", "I32", "BOOL"}:  # converted: load by part
                skeleton = empty_model(path, **kwargs)
                check_checkpoint(skeleton, path)
                return skeleton
        except PartialLoadError as error:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"loading the whole model on every rank: {error}", flush=True)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


@dataclass
class Pipeline:
    """This rank's share of the pipelined model: stages, schedule, loss and the tied-weight fix-up.

    ``mesh``: the job's ``("dp", "pp")`` mesh (``pp`` inner); ``sharded``: the FSDP2 roots when
    ``pipeline.dp > 1`` (None otherwise: every pipeline replica would hold whole stages).
    """

    info: ScheduleInfo
    split: ModelSplit
    schedule: Any
    loss_fn: TokenCrossEntropy
    tied: _TiedAcrossRanks | None
    has_first: bool
    has_last: bool
    mesh: DeviceMesh
    sharded: ShardedStages | None = None
    dropout: DropoutKeys | None = None  # the training loop sets .step (pp_offload.runtime.dropout_keys)

    @property
    def module(self) -> nn.Module:
        return self.split.module

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    def skip_in_norm(self) -> set[int]:
        """Ids of parameters not counted in the global gradient norm (the second copy of a tied weight)."""
        return self.tied.skip_in_norm() if self.tied is not None else set()


class _TiedAcrossRanks:
    """An input embedding tied to the LM head when the first and last stages sit on different ranks.

    Each of the two ranks holds its own copy; after backward the copies' gradients are summed between the
    two ranks of each pipeline replica, so both take the same optimizer step and stay equal, exactly as
    the one shared weight of the unsplit model would. The last-stage copy is left out of the gradient norm
    and of the export. Under FSDP both copies are sharded the same way over the data-parallel ranks, so
    the two ranks' local shards cover the same slice and summing them is right.
    """

    def __init__(self, model: nn.Module, split: ModelSplit, topo: Topology, num_stages: int, placement: str):
        last = _rank_of(num_stages - 1, topo.pp, placement)
        self.group: dist.ProcessGroup | None = None
        if last != 0:
            for replica in range(topo.dp):  # every rank creates every group, in the same order
                group = dist.new_group([replica * topo.pp, replica * topo.pp + last])
                if replica == topo.dp_rank:
                    self.group = group
        self.weight: nn.Parameter | None = None
        self.is_copy = False
        if 0 in split.stages:
            self.weight = model.get_input_embeddings().weight
        elif num_stages - 1 in split.stages:
            self.weight = model.get_output_embeddings().weight
            self.is_copy = True

    def sync_grads(self) -> None:
        if self.group is None or self.weight is None or not self.weight.requires_grad:
            return  # a frozen embedding (LoRA) has no gradient to share
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        grad = self.weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's shard, in place
        dist.all_reduce(local, group=self.group)

    def skip_in_norm(self) -> set[int]:
        return {id(self.weight)} if self.is_copy and self.weight is not None else set()


def _rank_of(stage: int, pp: int, placement: str) -> int:
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def preflight(config: RecipeConfig, topo: Topology, num_layers: int | None) -> ScheduleInfo:
    """Every check that needs no process group: schedule name, batch split, layers vs stages, options.

    Run on every rank before joining the group, so a bad config stops all ranks alike, at once.
    """
    spec = config.pipeline
    auto = str(spec.schedule).lower() == "auto"
    if auto:
        _check_auto(spec)
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
    if spec.microbatches < 1:
        raise ConfigError(f"pipeline.microbatches must be >= 1, got {spec.microbatches}")
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


def _check_auto(spec: Any) -> None:
    """``schedule: auto`` chooses schedule, offload and costs itself; it takes only the memory limits and,
    as ``offload``, a list of the offload policies it may choose from."""
    given = [k for k in ("costs", "layers_per_stage", "stages_per_rank") if getattr(spec, k) is not None]
    if spec.offload not in (None, "none") and not isinstance(spec.offload, list):
        given.insert(0, "offload")
    if given:
        raise ConfigError(
            f"pipeline.{given[0]} cannot be set with pipeline.schedule=auto (auto chooses the schedule, the "
            "offload policy and the costs from a probe step); remove it, or name a schedule instead of auto"
            + (" (a list of offload policies auto may choose from is fine)" if given[0] == "offload" else "")
        )
    if isinstance(spec.offload, list):
        from pp_offload.plan.auto import offload_candidates

        try:
            offload_candidates(spec.offload)
        except ValueError as error:
            raise ConfigError(f"pipeline.offload (auto's candidates): {error}") from error
    limit = spec.memory_limit
    if limit is not None and not (isinstance(limit, (int, float)) and 0 < limit <= 1):
        raise ConfigError(
            f"pipeline.memory_limit={limit!r}: a fraction of 1F1B's activation memory in (0, 1], e.g. 0.5"
        )
    budget = spec.activation_budget_gib
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
        raise ConfigError(f"pipeline.activation_budget_gib={budget!r} must be a number of GiB > 0")
    steps = spec.auto_probe_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"pipeline.auto_probe_steps={steps!r} must be an int >= 1")


def num_layers_of(config: RecipeConfig) -> int | None:
    """The model's layer count from its config alone (no weights loaded), or None if it cannot be read."""
    from transformers import AutoConfig

    spec = config.model
    if spec.config is not None:
        values = dict(spec.config)
        values.pop("vocab_size", None)
        hf_config = _hf_config(values)
    elif spec.path is not None:
        hf_config = AutoConfig.from_pretrained(spec.path)
    else:
        raise ConfigError("set model.path (hub id or local dir) or model.config (a dict with model_type)")
    return getattr(hf_config, "num_hidden_layers", None)


def build_pipeline(
    config: RecipeConfig,
    model: nn.Module,
    topo: Topology,
    device: torch.device,
    mesh: DeviceMesh,
    *,
    shard: bool = True,
    offload_inputs: Any = None,
) -> Pipeline:
    """Split ``model`` for this rank, shard it over the data-parallel ranks when ``pipeline.dp > 1`` (and
    ``shard``), and build its ``PipelineStage``s (on this replica's pipeline group) and the schedule.

    ``offload_inputs``: the figures ``schedule: auto`` chose with (`pp_offload.order.offload_inputs`, or
    its ``to_dict``), so the offload plan is the predicted one; without them a budget policy gets the
    planner's figures for this model and machine preset when it can (`pp_offload.recipe.offload_figures`)."""
    from torch.distributed.pipelining import PipelineStage

    from pp_offload.parallel import activation_checkpointing, apply_fsdp, checkpointing_mode
    from pp_offload.recipe.offload_figures import planner_offload_inputs
    from pp_offload.runtime.offload import enable_offload

    spec = config.pipeline
    info = schedule_info(spec.schedule)
    per_rank = info.stages_per_rank(spec.stages_per_rank)
    num_stages = topo.pp * per_rank
    offload = spec.offload not in (None, "none")
    model.train()
    split = split_model(
        model,
        num_stages=num_stages,
        stage_indices=stage_indices(topo.pp_rank, topo.pp, info.placement, per_rank),
        layers_per_stage=spec.layers_per_stage,
        verify=config.model.verify_split,
    )
    if any(p.is_meta for p in split.module.parameters()):  # a skeleton from load_model(partial=True)
        from pp_offload.models.loading import load_split_weights
        from pp_offload.models.lora import init_adapters, unwrap_peft

        load_split_weights(split, unwrap_peft(model), str(config.model.path))
        if config.lora is not None:
            init_adapters(split.module, seed=config.train.seed)
    split.module.to(device)
    recompute = checkpointing_mode(config.train.activation_checkpointing)
    if recompute is not None:
        activation_checkpointing(split, mode=recompute)
    sharded = None
    if topo.dp > 1 and shard:
        sharded = apply_fsdp(
            split, mesh, mixed_precision=config.train.precision, split_backward=info.split_backward
        )
    tied = None
    if bool(getattr(model.config, "tie_word_embeddings", False)) and info.placement != "v":
        tied = _TiedAcrossRanks(model, split, topo, num_stages, info.placement)  # after FSDP: its params
    group = mesh["pp"].get_group()
    stages = [PipelineStage(split.stages[s], s, num_stages, device, group=group) for s in split.stage_indices]
    loss_fn = TokenCrossEntropy()
    if split.router_aux is not None:  # each of the step's microbatches (all replicas) adds coef x aux / count
        loss_fn.router_aux_weight = split.router_aux.coef / (spec.microbatches * topo.dp)
    if offload and offload_inputs is None:
        offload_inputs = planner_offload_inputs(
            config,
            model,
            schedule=info.name,
            stages_per_rank=per_rank,
            pp=topo.pp,
            dp=topo.dp,
            layers_per_stage=list(split.layers_per_stage),
            device=device,
            log=topo.rank == 0,
        )
    figures: dict[str, Any] = {"costs": spec.costs}
    if offload and offload_inputs is not None:
        figures = {"inputs": offload_inputs}
    kwargs: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
    if info.module == "pp_offload.runtime.schedules":
        kwargs["costs"] = spec.costs  # None with inputs: the order is built from their scalar costs
        if spec.memory_limit is not None:
            kwargs["memory_limit"] = spec.memory_limit
        if offload:
            kwargs["offload"] = spec.offload
            if "inputs" in figures:
                kwargs["offload_inputs"] = figures["inputs"]
    schedule = build_schedule(info, stages, spec.microbatches, **kwargs)
    if info.module != "pp_offload.runtime.schedules" and offload:
        enable_offload(schedule, spec.offload, **figures, device=device)
    if sharded is not None:
        sharded.attach(schedule)
    dropout = key_pipeline_dropout(
        split, schedule, seed=config.train.seed, offset=topo.dp_rank * spec.microbatches
    )
    if topo.rank == 0 and (unkeyed := unkeyed_dropout(model)):
        print(f"dropout: {', '.join(unkeyed)} not keyed: their masks depend on the schedule", flush=True)
    return Pipeline(
        info=info,
        split=split,
        schedule=schedule,
        loss_fn=loss_fn,
        tied=tied,
        has_first=0 in split.stages,
        has_last=num_stages - 1 in split.stages,
        mesh=mesh,
        sharded=sharded,
        dropout=dropout,
    )
