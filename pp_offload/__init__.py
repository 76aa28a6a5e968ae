"""pp-offload: memory-efficient pipeline parallelism on torch.distributed.pipelining."""

__version__ = "0.1.0"
