"""Machine profiles: what one GPU of a pipeline can compute, hold and copy.

A profile is the handful of numbers the planner turns FLOPs and bytes into seconds: peak dense matmul
throughput, the share of it a training step achieves (MFU), the device<->host link that activation
offload copies over, and the link between pipeline neighbours. Presets are spec-sheet and published
figures, not measurements of your cluster; override any field (``--flops``, ``--host-bandwidth``, ...) when
you know better, e.g. from ``bench/bench_store.py`` or a profiler trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

__all__ = ["A100", "GH200", "H100", "H200", "MACHINES", "Machine", "resolve_machine"]


@dataclass(frozen=True)
class Machine:
    """One GPU of the pipeline and its links.

    flops: peak dense bf16/fp16 tensor-core FLOP/s (no sparsity).
    tf32_flops: peak dense TF32 FLOP/s, used when the model trains in fp32.
    mfu: share of the peak a decoder layer's passes achieve (model FLOPs utilisation). 0.5 by default:
        the controllable-memory paper reports 44-53% MFU for its 38.5B model on A100s.
    host_bandwidth: bytes/s of one direction of the device<->pinned-host link as one GPU sees it while
        its neighbour copies too (activation offload runs on every GPU at once).
    p2p_bandwidth: bytes/s between pipeline neighbours; the default is the inter-node link, since a deep
        pipeline spans nodes (NVLink inside a node is faster: the prediction is then conservative).
    p2p_latency: seconds added to every point-to-point transfer.
    memory_gib: device memory, GiB.
    hbm_bandwidth: bytes/s of device memory (HBM), the datasheet peak: times memory-bound work, i.e. the
        elementwise ops selective activation recompute re-runs (`pp_offload.plan.costs`). Default: the
        H100 SXM's 3.35 TB/s.
    """

    name: str
    flops: float
    tf32_flops: float
    host_bandwidth: float
    p2p_bandwidth: float
    memory_gib: float
    mfu: float = 0.5
    p2p_latency: float = 20e-6
    hbm_bandwidth: float = 3.35e12

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                if not isinstance(value, str) or not value:
                    raise ValueError(f"machine name must be a non-empty string, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"machine {f.name} must be a number, got {value!r}")
            if f.name == "p2p_latency":
                if not 0 <= value < math.inf:
                    raise ValueError(f"machine p2p_latency must be a finite number >= 0, got {value!r}")
            elif not 0 < value < math.inf:
                raise ValueError(f"machine {f.name} must be a finite number > 0, got {value!r}")
        if self.mfu > 1:
            raise ValueError(f"mfu is a share of the peak FLOP/s in (0, 1], got {self.mfu!r}")

    def flops_for(self, dtype: str) -> float:
        """Achieved FLOP/s for a model training in ``dtype`` (peak x MFU)."""
        peak = self.tf32_flops if dtype == "fp32" else self.flops
        return peak * self.mfu


A100 = Machine(
    name="A100",
    flops=312e12,
    tf32_flops=156e12,
    host_bandwidth=15e9,
    p2p_bandwidth=25e9,
    memory_gib=80.0,
    hbm_bandwidth=2.0e12,
)
"""A100 SXM 80GB. 312 TFLOP/s bf16 and 156 TFLOP/s TF32 dense, 2,039 GB/s HBM2e (NVIDIA A100 datasheet,
80GB SXM; 2.0 TB/s here); 15 GB/s host link
per direction: the figure PipeOffload (arXiv 2503.01328) uses for its A100 machines (PCIe Gen4 x16,
~25 GB/s alone, two GPUs sharing a PCIe switch); 25 GB/s between stages: one 200 Gb/s HDR InfiniBand
NIC per GPU."""

H100 = Machine(
    name="H100",
    flops=989e12,
    tf32_flops=495e12,
    host_bandwidth=21e9,
    p2p_bandwidth=50e9,
    memory_gib=80.0,
    hbm_bandwidth=3.35e12,
)
"""H100 SXM 80GB. 989 TFLOP/s bf16 and 495 TFLOP/s TF32 dense, 3.35 TB/s HBM3 (NVIDIA H100 datasheet, SXM);
21 GB/s host link per
direction: PipeOffload's H100 figure (PCIe Gen5 hosts, GPUs sharing switches; a dedicated Gen5 x16 link
reaches ~50 GB/s, pass ``host_bandwidth`` then: one H100 SXM copying alone measured 54.9 GB/s each way,
bench/results/gpu); 50 GB/s between stages: one 400 Gb/s NDR NIC per GPU."""

H200 = Machine(
    name="H200",
    flops=989e12,
    tf32_flops=495e12,
    host_bandwidth=21e9,
    p2p_bandwidth=50e9,
    memory_gib=141.0,
    hbm_bandwidth=4.8e12,
)
"""H200 SXM 141GB: H100's compute (NVIDIA H200 datasheet) with 141 GB of HBM3e at 4.8 TB/s. The host and
network links are assumed to be those of the H100 preset (same PCIe Gen5 / NDR platforms; not measured)."""

GH200 = Machine(
    name="GH200",
    flops=989e12,
    tf32_flops=495e12,
    host_bandwidth=450e9,
    p2p_bandwidth=50e9,
    memory_gib=96.0,
    hbm_bandwidth=4.0e12,
)
"""GH200 Grace Hopper Superchip (96 GB HBM3 version): H100's compute (989 TFLOP/s bf16 dense, NVIDIA GH200
datasheet), 4 TB/s HBM3 (same datasheet) and a host link of NVLink-C2C, 900 GB/s total bidirectional per
the datasheet, i.e. 450 GB/s per direction to the Grace CPU's LPDDR5X: ~20x the PCIe presets, so activation
offload should be nearly free. Spec-sheet figure, not a measurement (measured copy rates are lower; pass
``host_bandwidth``); 50 GB/s between stages as for the H100 preset (one 400 Gb/s NDR NIC per GPU)."""

MACHINES: dict[str, Machine] = {m.name: m for m in (A100, H100, H200, GH200)}


def resolve_machine(
    machine: str | Machine = "H100",
    *,
    flops: float | None = None,
    host_bandwidth: float | None = None,
    memory_gib: float | None = None,
    mfu: float | None = None,
    p2p_bandwidth: float | None = None,
    hbm_bandwidth: float | None = None,
) -> Machine:
    """A preset by name (case-insensitive: ``"A100"``, ``"H100"``, ``"H200"``, ``"GH200"``) or a `Machine`,
    with the given fields replaced. ``flops`` replaces the peak of the training dtype (bf16 and TF32
    alike), in FLOP/s; ``host_bandwidth``, ``p2p_bandwidth`` and ``hbm_bandwidth`` are bytes/s."""
    if isinstance(machine, Machine):
        base = machine
    elif isinstance(machine, str):
        found = {k.lower(): v for k, v in MACHINES.items()}.get(machine.strip().lower())
        if found is None:
            raise ValueError(
                f"unknown machine {machine!r}; presets: {', '.join(MACHINES)} (or pass a "
                f"pp_offload.plan.Machine / --flops and --host-bandwidth)"
            )
        base = found
    else:
        raise TypeError(f"machine must be a preset name or a Machine, got {machine!r}")
    changes: dict[str, float] = {}
    if flops is not None:
        changes.update(flops=flops, tf32_flops=flops)
    for name, value in (
        ("host_bandwidth", host_bandwidth),
        ("memory_gib", memory_gib),
        ("mfu", mfu),
        ("p2p_bandwidth", p2p_bandwidth),
        ("hbm_bandwidth", hbm_bandwidth),
    ):
        if value is not None:
            changes[name] = value
    return replace(base, **changes) if changes else base
