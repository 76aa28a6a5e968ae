"""The fine-tuning recipe's configuration: dataclasses read from YAML, with ``--set key=value`` overrides.

Why dataclasses and a strict reader: a typo in a YAML key (``micro_batches``) would otherwise be ignored
and the run would train with the default. Every section and key is checked against the dataclasses, and an
unknown one is an error naming the closest valid key, before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pp_offload.data import DataConfig, DataError
from pp_offload.recipe.config_types import ConfigTypeError, check_section

__all__ = [
    "TRAIN_TOKENIZER",
    "ConfigError",
    "LoraConfig",
    "ModelConfig",
    "OutputConfig",
    "PipelineConfig",
    "RecipeConfig",
    "TrainConfig",
    "load_config",
]


class ConfigError(ValueError):
    """A bad recipe configuration; the message names the key, the bad value and the fix."""


#: ``model.tokenizer``'s value that trains a byte-level BPE on the training data.
TRAIN_TOKENIZER = "train"


@dataclass
class ModelConfig:
    """The model to fine-tune: a pretrained one (``path``) or a randomly initialised one (``config``).

    Attributes:
        path: A hub id or a local directory of a pretrained model. Each pipeline rank reads only its own
            stages' tensors from the safetensors shards (on the hub only the shards it needs are
            downloaded).
        config: Instead of ``path``: a transformers config as a mapping with ``model_type`` (a randomly
            initialised model, e.g. the embedded tiny Llama). Entries can be overridden one by one:
            ``--set model.config.num_hidden_layers=4``.
        tokenizer: A hub id or local directory of the tokenizer; or ``train``: a byte-level BPE trained on
            the training data (``data.path``) before the run, for a model built from ``config``, saved in
            ``<output.dir>/tokenizer`` (reused by a resumed run) and with the export. Default: ``path``;
            with ``config`` and the embedded data, the tokenizer trained on the embedded corpus.
        tokenizer_vocab_size: ``tokenizer: train`` only: the most tokens its vocabulary holds (fewer when
            the data offers fewer merges); a config-built model's ``vocab_size`` defaults to the
            tokenizer's.
        attn_implementation: Passed to transformers (``sdpa``, ``eager``, ...).
        verify_split: Prove the pipeline split before training (default true): the model's own config,
            shrunken, is run unsplit and as chained stages, and a family whose stages would compute
            something else is refused with the size of the difference, instead of silently training a
            different model. Costs well under a second, once per config. Set false only for a family you
            have checked yourself (see docs/families.md).
    """

    path: str | None = None
    config: dict[str, Any] | None = None
    tokenizer: str | None = None
    tokenizer_vocab_size: int = 8192
    attn_implementation: str = "sdpa"
    verify_split: bool = True


@dataclass
class PipelineConfig:
    """How the model is pipelined: any of our schedules or torch's (see ``pp_offload.runtime.catalog``), or
    ``auto``: probe the real costs, then pick schedule and offload within the memory limit
    (`pp_offload.recipe.auto`).

    Attributes:
        schedule: The schedule class by name. Ours: ``ScheduleVHalf``, ``ScheduleVMin``, ``ScheduleVZB``,
            ``ScheduleVAdaptive`` (with ``memory_limit``); torch's: ``ScheduleZBVZeroBubble``,
            ``ScheduleDualPipeV``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
            ``ScheduleLoopedBFS``, ``Schedule1F1B``, ``ScheduleGPipe``; or ``auto`` (probe the costs, then
            choose schedule and offload within ``memory_limit`` / ``activation_budget_gib``).
        microbatches: Microbatches per step, per data-parallel replica; the global batch must split into
            ``dp x microbatches``.
        pp: Pipeline ranks. Default: the world size divided by ``dp``.
        dp: Data-parallel replicas of the pipeline; above 1 each stage is sharded with FSDP2 over them.
        dp_replicate: HSDP: of the ``dp`` ranks, groups that replicate (sharding within each group); must
            divide ``dp``.
        stages_per_rank: Loop schedules (torch's interleaved ones) only: stages each rank holds (default
            2). V schedules always hold 2, single-stage schedules 1.
        layers_per_stage: Decoder layers of each stage, one entry per stage. Default: balanced, with the
            embedding and the LM head counted as work.
        offload: Activation offload to host memory: ``none``, ``full``, ``selective`` (half the chunks),
            ``selective:0.25`` (a fraction of the chunks) or ``auto`` (from the ratio of copy time to
            compute time). With ``schedule: auto``: unset (auto chooses among its default policies) or a
            list of the policies auto may choose from, e.g. ``[none, budget, budget:sublayer]``.
        memory_limit: ``ScheduleVAdaptive`` or ``auto``: per-rank activation memory as a fraction of
            1F1B's, in (0, 1].
        activation_budget_gib: ``auto`` only: per-rank device-resident activation budget in GiB.
        auto_probe_steps: ``auto`` only: probe steps timed before choosing (no weight is updated).
        costs: Our schedules only: relative durations of a chunk's passes, ``{F: .., I: .., W: ..}`` (and
            ``comm``, ``transfer``), for which the order is searched. Default: unit costs.
        deferred_w: How a split-backward schedule (V-Min, V-Half, V-ZB, V-Adaptive, ZBV, DualPipeV,
            InterleavedZeroBubble) splits each microbatch's backward into I and W. ``true`` (default):
            deferred weight gradients, I is one ordinary backward and W runs the queued weight-gradient
            GEMMs (docs/hot-path.md); compiled layers work, a checkpointed layer runs twice per
            microbatch, and each linear's input and output gradient are held from I to W (offload moves
            them to host memory where the gap between I and W affords the copies). ``false``:
            torch's retained-graph split, which holds the saved tensors from I to W instead: with
            activation recompute those are far fewer (one stage of 4 Llama layers with full recompute:
            1.5 MiB against the queue's 15.3 MiB), so turn it off when recompute must save memory and
            memory is tight. It costs a third run of each checkpointed layer (in W), and is eager only:
            with ``train.compile`` it is refused. Schedules without split backward (Interleaved1F1B,
            LoopedBFS, 1F1B, GPipe) run one backward either way: the key changes nothing there. The
            planner's figures (the budget offload plan, ``schedule: auto``) follow it. Where the installed
            torch's split adds the gradient of a weight used twice in one stage twice (pytorch #180952,
            fixed in torch 2.14; asked of torch, not read from its version), ``false`` is refused for a
            stage holding one weight under two names.
    """

    schedule: str = "ScheduleVHalf"
    microbatches: int = 8
    pp: int | None = None
    dp: int = 1
    dp_replicate: int = 1
    stages_per_rank: int | None = None
    layers_per_stage: list[int] | None = None
    offload: Any = "none"
    memory_limit: float | None = None
    activation_budget_gib: float | None = None
    auto_probe_steps: int = 2
    costs: dict[str, float] | None = None
    deferred_w: bool = True


@dataclass
class TrainConfig:
    """Optimisation: AdamW with transformers Trainer's weight-decay groups, linear warm-up then cosine (or
    linear, or constant) decay, clipping by the global norm. Where a default differs from Trainer's, the
    table below the keys says so and why.

    Attributes:
        steps: Optimizer steps of the whole run (a resumed run continues up to this count).
        global_batch_size: Sequences per step over all data-parallel replicas.
        lr: Peak learning rate, reached after ``warmup_steps``. The default, 3e-3, suits the small models
            built from ``model.config`` that the examples train from scratch; a pretrained model is
            fine-tuned with far less (1e-5 to 5e-5 is usual: the README's Llama example uses 2e-5).
        min_lr_ratio: The cosine (or linear) schedule decays to ``lr * min_lr_ratio``; 0 decays to 0, as
            Trainer's schedules do.
        warmup_steps: Steps of linear warm-up to ``lr``: step k (counted from 1) runs at ``lr * k /
            warmup_steps``, so the first step already learns and step ``warmup_steps`` runs at ``lr``
            (Trainer's first step runs at 0: the table below the keys).
        warmup_ratio: Instead of ``warmup_steps``: the warm-up as a share of ``steps``, ``ceil(warmup_ratio
            * steps)`` steps (Trainer's ``warmup_ratio``); null: ``warmup_steps`` applies.
        lr_schedule: ``cosine``, ``linear`` (Trainer's default) or ``constant`` after the warm-up. A
            warm-up of ``steps`` or more never reaches ``lr``: the run warns.
        extend_lr: What a resume with another ``steps`` than its checkpoint's does to the schedule:
            ``continue`` (the rate goes on from where the run is and decays to the floor at the new
            ``steps``: no jump) or ``recompute`` (the new total's schedule, as if planned from the start:
            a finished run's rate rises again). docs/reliability.md#extending-a-run.
        weight_decay: AdamW's weight decay, on the parameters Trainer decays: every weight but the norms' and
            the biases (``weight_decay_exclude``). The run's log says how many are decayed.
        weight_decay_exclude: Which parameters weight decay leaves out: null, Trainer's rule (norm
            layers' weights and every bias: `transformers.Trainer.get_decay_parameter_names`); ``[]``,
            none (every parameter decays); or a list of regular expressions searched in each lowercased
            Hugging Face parameter name (``[bias, norm]``, ``[embed_tokens]``).
        optimizer: ``adamw`` (torch's AdamW, its default implementation: foreach on CUDA, one parameter at
            a time on the CPU), ``adamw_foreach`` or ``adamw_fused`` (torch's fused kernel; a device torch
            has none for is refused before the run); Trainer's names ``adamw_torch`` and
            ``adamw_torch_fused`` are the same as ``adamw`` and ``adamw_fused``.
        betas: AdamW's betas.
        adam_eps: AdamW's epsilon (Trainer's ``adam_epsilon``).
        max_grad_norm: Clip gradients to this norm, computed over all pipeline and data-parallel ranks
            (each gradient counted once); ``null``: no clipping.
        precision: ``fp32`` or ``bf16`` (autocast; FSDP's bf16 policy when ``dp > 1``; master weights
            stay fp32).
        activation_checkpointing: Recompute decoder layers in backward: ``false``; ``true`` or ``full``
            (each layer recomputed from its input, which is all it saves); ``selective`` (each layer keeps
            its matmul and attention outputs and recomputes only norms, rotary, activation functions and
            products: under half of a plain layer's saved bytes for Llama and Qwen2 (46%), 36% for
            GPT-2, for some recompute time); ``mlp`` (only each layer's MLP activation and gated product:
            the op group that frees the most bytes per byte of recompute traffic); either on the first
            share of each stage's layers, ``selective:0.75`` (the others keep everything: memory in steps
            of one layer per stage, for that share of the recompute time), with a second mode for the
            others, ``selective:0.75,mlp``. All compose with ``pipeline.offload``: what a layer keeps moves
            with its chunk (or layer, with a budget policy).
        compile: Compile each decoder layer in place with ``torch.compile`` (regional compile): ``false``,
            ``true``, or ``{mode: ..., backend: inductor, fullgraph: false}``. Works with every schedule:
            split-backward ones defer weight gradients to W (docs/hot-path.md), so a compiled layer's
            backward runs once per microbatch. With any recompute plan (selective and mlp through
            torch's selective-checkpoint policy; ``+once`` is refused, and not needed). The compile time
            and the graphs compiled after the first step are printed once.
        seed: Seed of the weights' initialisation and of the batch order.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        timeout_s: Collective timeout in seconds: a stuck or missing rank fails the job instead of
            hanging it.
        eval_every: Steps between evaluations on the held-out data (``data.eval_split`` or
            ``data.eval_path``); 0: only the final evaluation, which runs whenever held-out data is set.
        eval_batches: Held-out global batches per evaluation (the same blocks each time); null: all.
        max_bad_steps: Consecutive non-finite steps tolerated (an int >= 1). A step whose loss or global
            gradient norm is NaN or infinite is skipped on every rank (no optimizer update, gradients
            dropped; its batch and learning-rate slot are used up, AdamW's step count is not); this many
            in a row stop the run with exit code 3 (docs/reliability.md).
        stall_timeout: Seconds a training step may go without progress (no pipeline action started, no
            collective finished) before every rank prints the action it waits in and the job ends with
            exit code 4; null: no stall watch. Keep it below ``timeout_s``, which fails the collective
            itself without saying where each rank was.
    """

    steps: int = 40
    global_batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    warmup_ratio: float | None = None
    lr_schedule: str = "cosine"
    extend_lr: str = "continue"
    weight_decay: float = 0.01
    weight_decay_exclude: list[str] | None = None
    optimizer: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    precision: str = "fp32"
    activation_checkpointing: bool | str = False
    compile: bool | dict[str, Any] = False
    seed: int = 0
    device: str = "auto"
    timeout_s: float = 600.0
    eval_every: int = 0
    eval_batches: int | None = None
    max_bad_steps: int = 5
    stall_timeout: float | None = 300.0


@dataclass
class OutputConfig:
    """Where results go: checkpoints (torch.distributed.checkpoint), the HF export, metrics.

    Attributes:
        dir: The run's directory: ``metrics.csv``, ``summary.json``, ``checkpoints/``, ``export/``.
        save_every: Steps between checkpoints; 0: only at the end.
        keep: Checkpoints kept; older ones are deleted only after a new one is complete.
        resume: Continue from ``dir/checkpoints/latest`` when there is one (same as ``--resume``), even
            when that checkpoint was written with another config (the differences are printed). Without
            it a run resumes by itself only from checkpoints of the same run (same model, data and
            optimisation settings: a torchrun restart, a relaunch of the same command).
        overwrite: Start from step 0 even though ``dir/checkpoints`` holds another run's checkpoints,
            deleting them first (not on a torchrun restart, which always continues its own run).
        export: Write a Hugging Face model (safetensors shards, config, tokenizer) to ``dir/export`` at the
            end.
        log_every: Steps between log lines.
        report_to: Where rank 0 reports each step's loss, gradient norm, learning rate, tokens/s and device
            peak (and each evaluation), as Trainer's ``report_to``: ``csv`` (``metrics.csv``,
            ``eval.csv``), ``tensorboard`` (``dir/tensorboard``), ``wandb`` (project ``$WANDB_PROJECT``,
            else pp-offload; ``WANDB_MODE=offline`` works without an account), ``mlflow`` (the tracking
            URI and experiment of ``$MLFLOW_TRACKING_URI`` / ``$MLFLOW_EXPERIMENT_NAME``), ``trackio``
            (project ``$TRACKIO_PROJECT``, else pp-offload); each but csv needs its package (``pip install
            'pp-offload[wandb]'``, ``[mlflow]``, ``[trackio]``, ``[tensorboard]``), checked before the run.
            Was ``output.metrics``.
        timeline: Record the second step: ``timeline.png`` (predicted vs realized) and ``trace.json``.
    """

    dir: str = "runs/finetune"
    save_every: int = 0
    keep: int = 2
    resume: bool = False
    overwrite: bool = False
    export: bool = True
    log_every: int = 1
    report_to: list[str] = field(default_factory=lambda: ["csv"])
    timeline: bool = True


@dataclass
class LoraConfig:
    """LoRA fine-tuning with peft: adapters on the base model's projections, everything else frozen.

    Attributes:
        r: Rank of each adapter (``lora_A`` is r x in, ``lora_B`` out x r).
        alpha: Scale of the adapter's update: the update is multiplied by ``alpha / r``.
        dropout: Dropout on the adapter's input (peft's ``lora_dropout``); 0 disables it.
        target_modules: Module names peft adapts (``q_proj`` matches every layer's); default: every
            linear projection of the decoder layers (attention and MLP).
        merge: Also write ``<output.dir>/merged``: the base model with the adapter folded into its
            weights, loadable by ``AutoModelForCausalLM.from_pretrained``.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None
    merge: bool = False


@dataclass
class RecipeConfig:
    """The whole recipe configuration (YAML sections ``model``, ``data``, ``pipeline``, ``train``,
    ``output``, and ``lora`` for LoRA fine-tuning).

    Attributes:
        model: The model to fine-tune (`ModelConfig`).
        data: The training data (`pp_offload.data.DataConfig`).
        pipeline: Schedule, pipeline and data-parallel sizes, offload (`PipelineConfig`).
        train: Optimisation (`TrainConfig`).
        output: Checkpoints, export and metrics (`OutputConfig`).
        lora: LoRA adapters via peft (`LoraConfig`); absent: every weight is trained.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    lora: LoraConfig | None = None  # a ``lora:`` section (even empty) turns LoRA on

    def to_dict(self) -> dict[str, Any]:
        """Nested dicts that `from_dict` reads back to an equal config. Without LoRA the ``lora`` key is
        left out rather than written as None: a ``lora`` section, even an empty one, turns LoRA on, so a
        None there would come back as a LoRA run with default adapters."""
        data = dataclasses.asdict(self)
        if self.lora is None:
            del data["lora"]
        return data

    def validated(self) -> RecipeConfig:
        """This config read back through `from_dict` (every value checked against its key's type and
        range, as a config read from YAML is, for a config built or changed in Python), then checked as a
        whole: the keys that must go together (`_check_combinations`).

        Why two steps: `from_dict` and `load_config` accept a partial config (no model yet, an override
        still to come); a run needs a whole one. `validated` and `pp_offload.recipe.preflight.preflight`
        (what needs the machine, the model's config or the schedule catalog) are every check a config
        gets: the ranks and the launcher call both, first."""
        config = _build(self.to_dict(), "defaults")
        _check_combinations(config)
        return config

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "config") -> RecipeConfig:
        """Build and validate a config from nested dicts (as read from YAML)."""
        return _build(data, where)


_SECTIONS = {f.name: f for f in dataclasses.fields(RecipeConfig)}


#: Keys that were renamed: a config that still uses the old name is told the new one.
_RENAMED = {"output.metrics": "output.report_to"}


def _unknown_key(section: str, key: str, names: list[str]) -> str:
    new = _RENAMED.get(f"{section}.{key}")
    if new is not None:
        return f"unknown key {section}.{key}: it is now {new}"
    return f"unknown key {section}.{key}{_closest(key, names)}"


def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {match[0]!r}?)" if match else f" (valid: {', '.join(options)})"


def _section_class(section: str) -> type:
    return {
        "model": ModelConfig,
        "data": DataConfig,
        "pipeline": PipelineConfig,
        "train": TrainConfig,
        "output": OutputConfig,
        "lora": LoraConfig,
    }[section]


def _build(data: dict[str, Any], where: str) -> RecipeConfig:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: the configuration must be a mapping of sections, got {type(data).__name__}"
        )
    sections: dict[str, Any] = {}
    for section, values in data.items():
        if section not in _SECTIONS:
            raise ConfigError(f"{where}: unknown section {section!r}{_closest(section, list(_SECTIONS))}")
        cls = _section_class(section)
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: section {section!r} must be a mapping, got {values!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise ConfigError(f"{where}: {_unknown_key(section, key, names)}")
        try:
            values = check_section(cls, section, values)
        except ConfigTypeError as error:
            raise ConfigError(f"{_prefix(where)}{error}") from None
        try:
            sections[section] = cls(**values)
        except DataError as error:  # DataConfig's own checks: a config error like any other, no traceback
            raise ConfigError(f"{where}: {section}: {error}") from error
    config = RecipeConfig(**sections)
    if isinstance(config.train.betas, list):
        config.train.betas = tuple(config.train.betas)
    return config


def _check_combinations(config: RecipeConfig) -> None:
    """Keys that need each other or exclude each other, decided from the config alone."""
    model, train = config.model, config.train
    if (model.path is None) == (model.config is None):
        raise ConfigError("set exactly one of model.path (hub id or local dir) and model.config (a dict)")
    if model.tokenizer == TRAIN_TOKENIZER and model.path is not None:
        raise ConfigError(
            f"model.tokenizer=train trains a new tokenizer, whose token ids the pretrained model.path="
            f"{model.path!r} has never seen: use its own tokenizer (leave model.tokenizer unset), or build a "
            "new model from model.config"
        )
    if model.tokenizer == TRAIN_TOKENIZER and config.data.streaming:
        raise ConfigError(
            "model.tokenizer=train reads all the data to train a tokenizer, data.streaming never does: "
            "train one once (pp_offload.data.tokenizer.train_tokenizer on a sample, then "
            "save_pretrained) and set model.tokenizer to its directory, or prepare the data "
            "(data.streaming: false)"
        )
    _check_recompute_and_compile(train)
    for pattern in train.weight_decay_exclude or []:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ConfigError(
                f"train.weight_decay_exclude: {pattern!r} is not a regular expression ({error}); give "
                "patterns searched in the lowercased parameter names, e.g. [bias, norm]"
            ) from None
    if (train.eval_every or train.eval_batches is not None) and not config.data.has_eval:
        raise ConfigError(
            "train.eval_every / train.eval_batches need held-out data: set data.eval_split (the embedded "
            "corpus has 'validation') or data.eval_path"
        )
    _check_auto_keys(config.pipeline)


def _check_recompute_and_compile(train: TrainConfig) -> None:
    """``train.activation_checkpointing`` must parse, and ``train.compile`` must be a compile setting whose
    recompute plan compiles (the rules are the runtime's: `pp_offload.runtime.compile`)."""
    from pp_offload.parallel import checkpointing_mode
    from pp_offload.runtime.compile import CompileOptions, check_recompute_compiles

    try:
        recompute = checkpointing_mode(train.activation_checkpointing)
    except ValueError as error:
        raise ConfigError(f"train.activation_checkpointing: {error}") from None
    try:
        if CompileOptions.coerce(train.compile) is not None:
            check_recompute_compiles(recompute)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _check_auto_keys(spec: PipelineConfig) -> None:
    """``schedule: auto`` chooses schedule, offload and costs itself; it takes only the memory limits and,
    as ``offload``, a list of the offload policies it may choose from (each checked by the planner, in
    `pp_offload.recipe.preflight`)."""
    if str(spec.schedule).lower() != "auto":
        return
    given = [k for k in ("costs", "layers_per_stage", "stages_per_rank") if getattr(spec, k) is not None]
    if spec.offload not in (None, "none") and not isinstance(spec.offload, list):
        given.insert(0, "offload")
    if given:
        raise ConfigError(
            f"pipeline.{given[0]} cannot be set with pipeline.schedule=auto (auto chooses the schedule, the "
            "offload policy and the costs from a probe step); remove it, or name a schedule instead of auto"
            + (" (a list of offload policies auto may choose from is fine)" if given[0] == "offload" else "")
        )


def _prefix(where: str) -> str:
    return "" if where == "defaults" else f"{where}: "


def _yaml_loader() -> type:
    """PyYAML's safe loader, reading numbers as YAML 1.2 does.

    PyYAML implements YAML 1.1, whose floats need a dot and a signed exponent: ``1e20``, ``3e-4`` and
    ``1.5e3`` come back as strings, and a string reaches transformers as ``initializer_range='1e20'``
    (inside ``model.config`` no type hint says it is a number). Every other scalar reads as before."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # a copy: add_implicit_resolver would otherwise extend SafeLoader's own table
    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return Loader


def _yaml(text: str, what: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        reason = " ".join(str(getattr(error, "problem", None) or error).split())
        raise ConfigError(f"{what} is not valid YAML: {reason}{where}") from None


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None
) -> RecipeConfig:
    """Read a YAML recipe config (or start from the defaults) and apply ``section.key=value`` overrides.

    The value is parsed as YAML (``3`` is an int, ``[csv, tensorboard]`` a list, ``null`` None). A key whose
    value is a mapping (``model.config``, ``pipeline.costs``) can be reached into at any depth:
    ``model.config.num_hidden_layers=4`` or ``model.config.rope_scaling.factor=8`` change one entry and keep
    the others; missing entries and intermediate mappings are created. Sections and their keys stay strict:
    an unknown one is an error naming the closest valid name. Numbers read as YAML 1.2 (``1e20`` is a
    float), and every value is checked against its key's type (`pp_offload.recipe.config_types`).
    """
    data: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        if not Path(path).is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = _yaml(Path(path).read_text(), where) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the configuration must be a mapping of sections")
    for item in overrides or []:
        _apply_override(data, item, where)
    return _build(data, where)


def _apply_override(data: dict[str, Any], item: str, where: str) -> None:
    """Set ``section.key[.sub...]=value`` in the raw config ``data`` (nested dicts, as read from YAML)."""
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(
            f"override {item!r} must look like section.key=value (e.g. train.steps=10), or "
            "section.key.subkey=value inside a mapping (e.g. model.config.num_hidden_layers=4)"
        )
    section, name, *inner = parts
    if section not in _SECTIONS:
        raise ConfigError(
            f"override {item!r}: unknown section {section!r}{_closest(section, list(_SECTIONS))}"
        )
    fields = {f.name: f for f in dataclasses.fields(_section_class(section))}
    if name not in fields:
        raise ConfigError(f"override {item!r}: {_unknown_key(section, name, list(fields))}")
    if data.get(section) is None:
        data[section] = {}
    if not isinstance(data[section], dict):
        raise ConfigError(f"{where}: section {section!r} must be a mapping, got {data[section]!r}")
    node = data[section]
    if inner and node.get(name) is None and "dict" not in str(fields[name].type):
        raise ConfigError(
            f"override {item!r}: {section}.{name} is not a mapping, so it has no sub-key {inner[0]!r}; "
            f"set {section}.{name}=value"
        )
    keys = [name, *inner]
    for depth in range(len(keys) - 1):  # walk (and create) the mappings down to the last key's parent
        k = keys[depth]
        if node.get(k) is None:
            node[k] = {}
        if not isinstance(node[k], dict):
            raise ConfigError(
                f"override {item!r}: {'.'.join([section, *keys[: depth + 1]])} is {node[k]!r}, not a "
                f"mapping, so it has no sub-key {keys[depth + 1]!r}"
            )
        node = node[k]
    node[keys[-1]] = _yaml(value, f"override {item!r}: the value")
