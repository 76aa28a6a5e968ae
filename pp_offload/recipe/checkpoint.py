"""Training checkpoints (torch.distributed.checkpoint), written beside the previous one, switched atomically.

Layout under ``<dir>/checkpoints``::

    step_00000020/        a complete checkpoint (DCP files of every rank, rng_<rank>.pt, meta.json)
    step_00000040.partial being written; never read
    latest.json           {"step": 20, "dir": "step_00000020"}: replaced atomically once a checkpoint is whole

Why DCP: every pipeline rank saves only what it holds, under the model's own parameter names, so the
checkpoint is independent of which rank held what. Why the pointer file: a job killed while saving leaves
the previous ``latest`` untouched; old checkpoints are removed only after the new pointer is in place.
A write that fails on any rank (a full disk) is agreed on by all ranks: the ``.partial`` directory is
removed and every rank raises `CheckpointWriteError`, whose message names the still intact previous
checkpoint. A state holding NaN or infinity is never written (`CheckpointWriteError` too): a resumed run
would only train on from garbage. ``meta.json`` records the step and the config that wrote it, which is
how `pp_offload.recipe.resume` tells this run's checkpoints from another run's.
Per-rank RNG states are saved too, so a resumed run draws the same random numbers (dropout) as an
uninterrupted one.

Nothing read back runs code (docs/reliability.md, "What a resume trusts"): ``latest.json`` and
``meta.json`` are JSON, the RNG states are loaded with ``torch.load(weights_only=True)`` (plain tensors
only) and checked for their shape; a file that fails is refused by `CheckpointReadError`, on every rank
alike, with one line naming the file and what is wrong. torch's DCP reads its own ``.metadata`` with
``pickle``: that part is torch's, and a checkpoint from an untrusted source should be verified first.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from pp_offload.fsutil import partial_dir, publish_dir, write_text_atomic
from pp_offload.recipe.stops import RunStopped

__all__ = [
    "CheckpointError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "check_rng_files",
    "checkpoint_meta",
    "latest_step",
    "load_checkpoint",
    "read_rng_state",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

_LATEST = "latest.json"
# Flattened optimizer state: every entry (param_groups included) is keyed by parameter name. The nested
# form keeps one "param_groups" list per rank under the same key, and DCP would load rank 0's list on
# every pipeline rank.
# Frozen parameters (a LoRA run's base model) are not saved: they are reloaded from model.path or rebuilt
# from the config's seed, and a checkpoint stays the size of what is trained.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
# Loading sets the saved (trainable) tensors and leaves the frozen ones as built. DCP itself still fails on
# a trainable tensor the checkpoint lacks: it loads exactly the keys of the state dict it is given.
_LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message says which and why."""


class CheckpointWriteError(CheckpointError, RunStopped):
    """A checkpoint that could not be written (on some rank); the previous one is intact."""


class CheckpointReadError(CheckpointError, RunStopped):
    """A checkpoint file that is corrupt, tampered with or not ours: refused before anything of it is used
    (exit code 2, like a configuration error: the fix is a file or a setting, not the code)."""

    exit_code = 2


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no group: that is our intent then."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def save_checkpoint(
    root: str | Path,
    step: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    keep: int = 2,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Save model and optimizer state of every rank for ``step``; call on every rank.

    ``meta``: more entries for ``meta.json`` (the recipe records its config). Raises
    `CheckpointWriteError` on every rank when the state is not finite or a rank's write fails."""
    root = Path(root)
    final = _step_dir(root, step)
    scratch = partial_dir(final)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if scratch.exists():
            shutil.rmtree(scratch)
    _barrier()
    model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
    _refuse_non_finite(step, root, {"model": model_state, "optim": optim_state})
    failure = None
    try:
        with _quiet_single_process():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(scratch))
        torch.save(rng_state(), scratch / f"rng_{_rank()}.pt")
    except Exception as error:  # a full disk is an OSError here, a CheckpointException from DCP's ranks
        failure = (
            f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        )
    failures = _gather_failures(failure)
    if failures:
        if _rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        _barrier()
        rank, why = failures[0]
        raise CheckpointWriteError(
            f"checkpoint of step {step} not written (rank {rank}: {why}); {_intact(root)}"
        )
    if _rank() == 0:
        (scratch / "meta.json").write_text(json.dumps({"step": step, **(meta or {})}, default=str) + "\n")
        publish_dir(scratch, final)
        write_text_atomic(root / _LATEST, json.dumps({"step": step, "dir": final.name}) + "\n")
        complete = _complete(root)
        for old in complete[: -max(keep, 1)]:
            shutil.rmtree(old)
    _barrier()
    return final


def _intact(root: Path) -> str:
    previous = latest_step(root)
    if previous is None:
        return "there is no earlier checkpoint"
    return f"the latest checkpoint is still step {previous} ({_step_dir(root, previous)}), intact"


def _gather_failures(failure: str | None) -> list[tuple[int, str]]:
    """Every rank's failure (rank, text), on every rank; one small all-reduce when none failed."""
    if not _distributed():
        return [(0, failure)] if failure else []
    flag = torch.tensor([1.0 if failure else 0.0], device=_collective_device())
    dist.all_reduce(flag)
    if not flag.item():
        return []
    texts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, failure)
    return [(rank, text) for rank, text in enumerate(texts) if text]


def _collective_device() -> torch.device:
    """Where a small tensor for the default group's collectives must live (NCCL: this rank's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _refuse_non_finite(step: int, root: Path, state: dict[str, Any]) -> None:
    """Raise `CheckpointWriteError` on every rank if any rank's state holds NaN or infinity (one host
    read for all tensors of this rank, and a name only when one is bad)."""
    named = [
        (name, t.to_local() if hasattr(t, "to_local") else t)
        for name, t in _tensors(state)
        if t.is_floating_point() and t.numel()
    ]
    verdicts: dict[torch.device, list[torch.Tensor]] = {}  # AdamW's step counts live on the CPU
    for _, t in named:
        verdicts.setdefault(t.device, []).append(torch.isfinite(t).all())
    bad = None
    if not all(bool(torch.stack(v).all()) for v in verdicts.values()):
        bad = "non-finite values in " + next(n for n, t in named if not bool(torch.isfinite(t).all()))
    failures = _gather_failures(bad)
    if failures:
        rank, why = failures[0]
        raise CheckpointWriteError(
            f"checkpoint of step {step} not written (rank {rank}: {why}); {_intact(root)}"
        )


def _tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))


def checkpoint_meta(root: str | Path) -> dict[str, Any] | None:
    """The ``meta.json`` of the newest complete checkpoint under ``root`` (step, and the config that
    wrote it when recorded), or None when there is none."""
    step = latest_step(root)
    if step is None:
        return None
    path = _step_dir(Path(root), step) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointReadError(
            f"{path} is missing or unreadable ({_why(error)}); the checkpoint is incomplete or corrupt"
        ) from error
    if not isinstance(meta, dict) or not isinstance(meta.get("config", {}), dict):
        raise CheckpointReadError(f"{path} is not a checkpoint's meta.json (a JSON object with a config)")
    return meta


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (zero-padded names sort by step)."""
    return sorted(
        p for p in root.glob("step_*") if p.is_dir() and "." not in p.name and (p / "meta.json").is_file()
    )


def latest_step(root: str | Path) -> int | None:
    """The step of the newest complete checkpoint under ``root``, or None."""
    pointer = Path(root) / _LATEST
    if not pointer.is_file():
        return None
    try:
        step = json.loads(pointer.read_text())["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r} is not a step number")
        return step
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointReadError(
            f"{pointer} is unreadable ({_why(error)}); delete it or point it at a step_* dir"
        ) from error


def _why(error: BaseException) -> str:
    """An error in a few words, on one line."""
    text = " ".join(str(error).split())
    name = type(error).__name__
    if isinstance(error, KeyError):
        return f"no {text} entry"
    return f"{name}: {text[:200]}" if text else name


def load_checkpoint(root: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the latest checkpoint under ``root`` into ``module`` and ``optimizer``; return its step."""
    root = Path(root)
    step = latest_step(root)
    if step is None:
        raise CheckpointError(f"no checkpoint under {root} (no {_LATEST}); start without resume")
    where = _step_dir(root, step)
    if not (where / "meta.json").is_file():
        raise CheckpointReadError(f"{root / _LATEST} names step {step} but {where} is missing or incomplete")
    rng = where / f"rng_{_rank()}.pt"
    rng_saved, failure = None, None
    if rng.is_file():
        try:
            rng_saved = read_rng_state(rng)
        except CheckpointReadError as error:
            failure = str(error)
    failures = _gather_failures(failure)  # a refused file on one rank stops every rank, alike
    if failures:
        raise CheckpointReadError(f"{failures[0][1]}; {_older(root, step)}")  # the file names the rank
    model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
    state = {"model": model_state, "optim": optim_state}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(where))
    set_state_dict(
        module,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_LOAD_OPTIONS,
    )
    if rng_saved is not None:
        set_rng_state(rng_saved)
    return step


def check_rng_files(root: str | Path, step: int) -> None:
    """Read every rank's RNG state of checkpoint ``step`` as `load_checkpoint` will (no code runs); raise
    its `CheckpointReadError`, with the way on, for the first that is refused. For a launcher that checks
    before any rank starts."""
    root = Path(root)
    for path in sorted(_step_dir(root, step).glob("rng_*.pt")):
        try:
            read_rng_state(path)
        except CheckpointReadError as error:
            raise CheckpointReadError(f"{error}; {_older(root, step)}") from None


def _older(root: Path, step: int) -> str:
    """What the user can do about a refused file of checkpoint ``step``: the older complete checkpoint."""
    older = [p for p in _complete(root) if p.name < _step_dir(root, step).name]
    if not older:
        return (
            "nothing of it was used: restore the file from a trusted copy, or start over (output.overwrite)"
        )
    return (
        f"nothing of it was used: restore the file from a trusted copy, or resume from {older[-1]} (point "
        f"{root / _LATEST} at it)"
    )


def read_rng_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A saved `rng_state`, read without running code: ``torch.load(weights_only=True)`` unpickles tensors
    and plain containers only, so a pickle that would run a command is refused, not executed. Raises
    `CheckpointReadError` naming ``path`` for a file that is not such a state."""
    path = Path(path)
    try:
        with warnings.catch_warnings():  # torch warns about a foreign pickle protocol: the error says more
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # UnpicklingError (a forbidden global), a truncated or foreign file
        text = str(error)
        if "trusted source." in text:  # torch's advice to turn the check off is not ours to give
            text = text.split("trusted source.")[1].split("Check the documentation")[0]
            text = text.split("WeightsUnpickler error:")[-1]
        else:
            text = text.split(". ")[0]
        why = f"{type(error).__name__}: {' '.join(text.split())}"
        raise CheckpointReadError(
            f"{path}: refused, not a plain RNG state (tensors only; it may be tampered with or corrupt): "
            f"{why[:200]}"
        ) from None
    expected = torch.get_rng_state()
    cpu = state.get("cpu") if isinstance(state, dict) else None
    if not (
        isinstance(cpu, torch.Tensor)
        and cpu.dtype == expected.dtype
        and cpu.shape == expected.shape
        and all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in state.values())
    ):
        raise CheckpointReadError(
            f"{path}: refused, not an RNG state (expected {{'cpu': a {tuple(expected.shape)} uint8 tensor}})"
        )
    return state


def rng_state() -> dict[str, Any]:
    """This process's random number state (CPU, and its current CUDA device once CUDA is in use)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a `rng_state`."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
