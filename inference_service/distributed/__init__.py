"""Tensor parallelism across the devices of one host (Megatron-style).

    group.py     the process group: ranks, collectives with timeouts (NCCL on CUDA, gloo on the CPU)
    sharding.py  which slice of each checkpoint tensor a rank owns, and its per-rank model config
    workers.py   the engine's worker processes: started by rank 0, replaying rank 0's steps

The sharded projections and the vocab-parallel embedding / lm_head live beside the other Linear
variants, in `model/parallel_linear.py`.
"""
