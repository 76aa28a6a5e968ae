"""Multi-process test helper: `pp_offload.local_ranks` under the name the tests import.

results = run_on_ranks(worker, 2, arg, key=value, timeout=60)   # worker(rank, world_size, arg, key=value)
"""

from pp_offload.local_ranks import RankError, RankTimeout, run_on_ranks, send

__all__ = ["RankError", "RankTimeout", "run_on_ranks", "send"]
