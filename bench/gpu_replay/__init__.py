"""`bench/bench_gpu_replay.py`'s parts, by job: `rank` (build and ready the rank), `measure` (what a step is
measured by), `predict` (the planner's figures) and `report` (tables, plot, JSON)."""
