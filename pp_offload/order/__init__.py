"""Order generation: who runs which pass of which microbatch, in what order, on every rank."""

from pp_offload.order.actions import Action, Costs, Order, v_rank_of_stage, v_stages
from pp_offload.order.vshape import adaptive_v_order, v_half_order, v_min_order, v_zb_order

__all__ = [
    "Action",
    "Costs",
    "Order",
    "adaptive_v_order",
    "v_half_order",
    "v_min_order",
    "v_stages",
    "v_rank_of_stage",
    "v_zb_order",
]
