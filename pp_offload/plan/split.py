"""How many decoder layers each pipeline stage gets.

Why a function of its own: the planner needs the split to predict per-stage time and memory, and the code
that cuts a Hugging Face model into stages must use the *same* split, or the prediction describes a
different pipeline. The embedding (first stage) and the LM head with the loss (last stage) are work
too: counting them as ``first_extra`` / ``last_extra`` layers of work gives those stages fewer layers,
so the slowest stage, which sets the pace of every pipeline schedule, is as fast as it can be.
"""

from __future__ import annotations

import math

__all__ = ["balanced_split"]

_EPS = 1e-9


def balanced_split(num_layers: int, num_stages: int, *, first_extra: float, last_extra: float) -> list[int]:
    """Layers per stage (a list of ``num_stages`` ints summing to ``num_layers``) minimising the largest
    stage's work, where stage ``s`` works ``layers[s]`` plus ``first_extra`` (s = 0) and ``last_extra``
    (s = last), in units of one decoder layer (e.g. the LM head's time over a layer's time).

    Among splits with the same largest load, layers are taken away from the most loaded stages first,
    the first and last stage before the others at equal load (they hold the embedding and the head, and
    usually their memory too), then later stages before earlier ones. Examples: 62 layers on 64 stages
    with both extras ~1 give ``[0, 1, ..., 1, 0]`` (the controllable-memory paper's setting: the
    embedding and the head each take a stage); 62 layers on 32 stages with ``last_extra=0.6`` give
    ``[1, 2, ..., 2, 1]``. With one stage, it gets every layer.
    """
    for name, value in (("num_layers", num_layers), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    for name, value in (("first_extra", first_extra), ("last_extra", last_extra)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not value >= 0
            or math.isinf(value)
        ):
            raise ValueError(f"{name} must be a finite number >= 0 (layers of work), got {value!r}")
    if num_stages == 1:
        return [num_layers]
    extras = [0.0] * num_stages
    extras[0] += float(first_extra)
    extras[-1] += float(last_extra)

    def capacity(bound: float) -> list[int]:
        return [max(0, math.floor(bound - e + _EPS)) for e in extras]

    # The smallest feasible bound is some integer k plus one of the extras; search those values.
    top = math.ceil(num_layers / num_stages) + max(extras) + 1
    bounds = sorted({k + e for k in range(0, int(top) + 2) for e in set(extras)})
    bound = next(b for b in bounds if b + _EPS >= max(extras) and sum(capacity(b)) >= num_layers)
    layers = capacity(bound)
    surplus = sum(layers) - num_layers
    for _ in range(surplus):
        # remove a layer from the most loaded stage; ties: end stages first, then later stages
        s = max(
            (s for s in range(num_stages) if layers[s] > 0),
            key=lambda s: (layers[s] + extras[s], s in (0, num_stages - 1), s),
        )
        layers[s] -= 1
    return layers
