"""How many decoder layers each pipeline stage gets, as the planner sees it: `pp_offload.balance` with end
stages allowed to hold no layer (the embedding and the head may take a stage each).

Why a name of its own: ``balanced_split`` is part of the planner's public API (``pp_offload.plan``); the
algorithm lives in `pp_offload.balance.balanced_layers`, shared with the model split
(`pp_offload.models.split`), so the planner predicts the pipeline the model split builds.
"""

from __future__ import annotations

from pp_offload.balance import balanced_layers

__all__ = ["balanced_split"]


def balanced_split(num_layers: int, num_stages: int, *, first_extra: float, last_extra: float) -> list[int]:
    """`pp_offload.balance.balanced_layers` with ``min_layers=0``. Examples: 62 layers on 64 stages with
    both extras ~1 give ``[0, 1, ..., 1, 0]`` (the controllable-memory paper's setting); 62 layers on 32
    stages with ``last_extra=0.6`` give ``[1, 2, ..., 2, 1]``."""
    return balanced_layers(
        num_layers, num_stages, first_extra=first_extra, last_extra=last_extra, min_layers=0
    )
