"""The planner setup that tests/test_plan_exact.py checks and bench/bench_plan_exact.py times: Llama-3-70B
at seq 4096 in bf16, microbatches of one row, two stages per rank, no data parallelism, no reserve."""

from __future__ import annotations

from typing import Any

from pp_offload.plan.evaluate import setup_schedule
from pp_offload.plan.machines import resolve_machine
from pp_offload.plan.memory import precision
from pp_offload.plan.model import model_spec


def llama70b_setup(schedule: str, machine: str, pp: int, m: int) -> Any:
    """``schedule``'s setup on the ``machine`` preset; V-Adaptive gets a memory cap between V-Min's and
    V-ZB's peaks."""
    setup = setup_schedule(
        schedule,
        spec=model_spec("llama-3-70b"),
        machine=resolve_machine(machine),
        precision=precision("bf16"),
        seq_len=4096,
        microbatch_size=1,
        num_microbatches=m,
        pp=pp,
        dp=1,
        dp_shard=False,
        virtual_stages=2,
        reserve=0,
    )
    if schedule == "ScheduleVAdaptive":
        setup.memory_cap = float(pp + pp // 2)
    return setup
