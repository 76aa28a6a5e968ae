"""How many decoder layers each pipeline stage gets: the one implementation the planner and the model split
share.

Why one function: the planner predicts per-stage time and memory from a split, and the code that cuts a
Hugging Face model into stages must use the *same* split, or the prediction describes a different pipeline.
The embedding (first stage) and the LM head with the loss (last stage) are work too: counting them as
``first_extra`` / ``last_extra`` layers of work gives those stages fewer layers, so the slowest stage,
which sets the pace of every pipeline schedule, is as fast as it can be. The planner allows end stages
without a layer (``min_layers=0``: the controllable-memory paper gives the embedding and the head a stage
each); a stage module of a real model needs at least one layer (``min_layers=1``, the default).
"""

from __future__ import annotations

import math

__all__ = ["balanced_layers"]

_EPS = 1e-9


def balanced_layers(
    num_layers: int, num_stages: int, *, first_extra: float, last_extra: float, min_layers: int = 1
) -> list[int]:
    """Layers per stage (``num_stages`` ints >= ``min_layers`` summing to ``num_layers``) minimising the
    largest stage's work, where stage ``s`` works ``layers[s]`` plus ``first_extra`` (s = 0) and
    ``last_extra`` (s = last), in units of one decoder layer (e.g. the LM head's time over a layer's).

    Among splits with the same largest load, layers are taken away from the most loaded stages first, the
    first and last stage before the others at equal load (they hold the embedding and the head, and usually
    their memory too), then later stages before earlier ones. Examples: ``(8, 4, 1.3, 1.3)`` gives
    ``[1, 3, 3, 1]``; with ``min_layers=0``, 62 layers on 64 stages with both extras ~1 give
    ``[0, 1, ..., 1, 0]``. With one stage, it gets every layer.
    """
    for name, value in (("num_layers", num_layers), ("num_stages", num_stages), ("min_layers", min_layers)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if min_layers < 0:
        raise ValueError(f"min_layers must be >= 0, got {min_layers}")
    for name, value in (("first_extra", first_extra), ("last_extra", last_extra)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not value >= 0
            or math.isinf(value)
        ):
            raise ValueError(f"{name} must be a finite number >= 0 (layers of work), got {value!r}")
    if num_layers < min_layers * num_stages:
        if min_layers == 1:
            raise ValueError(
                f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages: use fewer "
                "pipeline ranks or stages per rank, or a model with more layers"
            )
        raise ValueError(
            f"{num_layers} layers cannot give each of {num_stages} stages at least {min_layers} layers"
        )
    if num_stages == 1:
        return [num_layers]
    extras = [0.0] * num_stages
    extras[0] += float(first_extra)
    extras[-1] += float(last_extra)

    def capacity(bound: float) -> list[int]:
        return [max(min_layers, math.floor(bound - e + _EPS)) for e in extras]

    # The smallest feasible bound is some integer k plus one of the extras, and every stage's load with
    # its minimum (min_layers + extra) must fit under it; search those values.
    floor = min_layers + max(extras)
    top = math.ceil(num_layers / num_stages) + max(extras) + 1
    bounds = sorted({k + e for k in range(min_layers, int(top) + 2) for e in set(extras)})
    bound = next(b for b in bounds if b + _EPS >= floor and sum(capacity(b)) >= num_layers)
    layers = capacity(bound)
    for _ in range(sum(layers) - num_layers):
        # remove a layer from the most loaded stage; ties: end stages first, then later stages
        s = max(
            (s for s in range(num_stages) if layers[s] > min_layers),
            key=lambda s: (layers[s] + extras[s], s in (0, num_stages - 1), s),
        )
        layers[s] -= 1
    return layers
