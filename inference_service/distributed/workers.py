"""The engine's tensor-parallel ranks: rank 0 (the serving process) starts ranks 1..N-1 itself.

`start_tensor_parallel(config)` spawns the workers (torch.multiprocessing, spawn), joins the group
with them (NCCL on CUDA, gloo on the CPU), loads rank 0's shard and returns it wrapped in a
`DriverModel`. A watcher thread follows the workers: one that exits while the server runs is a
fatal error, reported through `WorkerPool.on_failure` (the server turns NOT_SERVING and exits non-zero).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import sys
import threading
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from inference_service.distributed.group import destroy_group, init_group
from inference_service.distributed.step_broadcast import DriverModel, WorkerLoop

logger = logging.getLogger(__name__)


def tensor_parallel_devices(device: str, world_size: int) -> list[torch.device]:
    """One device a rank: `cpu` for every rank; `cuda` / `auto` (with a GPU) GPUs 0..N-1; `cuda:2,3`
    those GPUs. Raises ValueError when there are not enough."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return [torch.device("cpu")] * world_size
    if device in ("cuda", "auto"):
        ids = list(range(world_size))
    else:
        ids = [int(i) for i in device.removeprefix("cuda:").split(",")]
    if len(ids) != world_size:
        raise ValueError(f"--device {device} names {len(ids)} GPUs for --tensor-parallel-size {world_size}")
    num_visible = torch.cuda.device_count()
    if max(ids) >= num_visible:
        raise ValueError(f"--tensor-parallel-size {world_size} needs GPUs {ids}; {num_visible} visible")
    return [torch.device("cuda", i) for i in ids]


class WorkerPool:
    """The worker processes of ranks 1..N-1 and the thread that watches them."""

    def __init__(self, processes: list, pipes: list):
        self.processes, self.pipes = processes, pipes
        self.on_failure: Callable[[str], None] | None = None
        self._is_stopping = False
        self._watcher = threading.Thread(target=self._watch, name="tp-worker-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._is_stopping:
            return
        rank = sentinels[ready[0]]
        self.processes[rank - 1].join(1.0)  # reaps it: its exit code is known after
        message = (f"tensor-parallel worker rank {rank} (pid {self.processes[rank - 1].pid}) exited with "
                   f"code {self.processes[rank - 1].exitcode}")
        logger.error("%s: the engine cannot run steps without it", message)
        if self.on_failure is not None:
            self.on_failure(message)

    def stop(self, driver: DriverModel | None = None, timeout_s: float = 10.0) -> None:
        """Asks the workers to exit, then ends those that did not."""
        self._is_stopping = True
        if driver is not None:
            driver.stop_workers()
        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join()


def start_tensor_parallel(config, devices: list[torch.device], dtype: torch.dtype):
    """Rank 0's loaded shard (`LoadedModel` whose `model` is a `DriverModel`) once all ranks joined."""
    from inference_service.distributed.loading import load_model_shard, open_shard_source
    from inference_service.distributed.sharding import ShardPlan

    world_size = config.tensor_parallel_size
    # The checks a bad size (or model) fails, before any process starts.
    source = open_shard_source(config.model, config.load_format, dtype, config.yarn_scaling_factor)
    ShardPlan(source.config, 0, world_size)
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    processes, pipes = [], []
    for rank in range(1, world_size):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=worker_main, args=(rank, world_size, init_method, config, devices[rank], dtype, theirs),
                        name=f"tp-rank-{rank}", daemon=True)
        p.start()
        theirs.close()
        processes.append(p)
        pipes.append(ours)
    pool = WorkerPool(processes, pipes)
    try:
        group = init_group(0, world_size, init_method, devices[0],
                           use_symmetric_memory=not config.disable_custom_all_reduce)
        loaded = load_model_shard(config.model, group, device=devices[0], dtype=dtype, load_format=config.load_format,
                                  attention_backend=config.attention_backend, seed=config.seed,
                                  yarn_scaling_factor=config.yarn_scaling_factor, quantization=config.quantization,
                                  quantized_weights=not config.dequantize)
    except BaseException:
        pool.stop()
        raise
    loaded.model = DriverModel(loaded.model, group, pipes, workers=pool)
    return loaded


def worker_main(rank: int, world_size: int, init_method: str, config, device: torch.device, dtype: torch.dtype,
                pipe) -> None:
    """A worker process: join the group, load the shard, replay rank 0's steps; exit non-zero on error."""
    from inference_service.distributed.loading import load_model_shard

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    torch.manual_seed(config.seed)
    try:
        group = init_group(rank, world_size, init_method, device,
                           use_symmetric_memory=not config.disable_custom_all_reduce)
        loaded = load_model_shard(config.model, group, device=device, dtype=dtype, load_format=config.load_format,
                                  attention_backend=config.attention_backend, seed=config.seed,
                                  yarn_scaling_factor=config.yarn_scaling_factor, quantization=config.quantization,
                                  quantized_weights=not config.dequantize)
        WorkerLoop(loaded.model, group, pipe, device, dtype).run()
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    destroy_group()
    sys.exit(0)
