"""Tensor parallelism across the devices of one host (Megatron-style).

    group.py           the process group: ranks, collectives with timeouts (NCCL on CUDA, gloo on the CPU)
    sharding.py        which slice of each checkpoint tensor a rank owns, and its per-rank model config
    shard_reader.py    a rank's slices of safetensors files (`get_slice`)
    gguf_shards.py     a rank's slices of a GGUF file's memory map
    loading.py         one rank's model: its config, its slices, the parallel modules swapped in
    step_broadcast.py  rank 0's model calls (`DriverModel`) replayed by the others (`WorkerLoop`)
    workers.py         the engine starting ranks 1..N-1 and watching them

The sharded projections and the vocab-parallel embedding / lm_head live beside the other Linear
variants, in `model/parallel_linear.py`.
"""
