"""The tensor-parallel worker processes: rank 0 (the engine) starts them, or torchrun started every rank.

A worker loads its slice of the model, sizes its KV pages as rank 0 says, then runs each step rank 0
broadcasts until told to stop. Workers never outlive rank 0: they ask the kernel for SIGKILL when their
parent dies, and a broken or timed-out collective ends them too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagegate.config import EngineConfig, torchrun_rank
from pagegate.engine.forward import forward
from pagegate.engine.kv_cache import PagedKVCache
from pagegate.engine.loading.loader import load_checkpoint, model_path, resolve_device
from pagegate.engine.models.base import CausalLM
from pagegate.engine.parallel import StepChannel, TensorParallel, backend_for
from pagegate.kernels.kv_format import resolve_format

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """Each rank's own GPU on CUDA (its local rank under torchrun); on CPU, this rank's share of the cores
    (ranks that each spin up every core's worth of threads stall one another at every all-reduce)."""
    if device.type != "cuda":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class WorkerGroup:
    """Rank 0's side of tensor parallelism: the process group, the step channel and, unless torchrun
    started the ranks, the worker processes (watched: one that dies calls `on_death`)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        size = config.tensor_parallel_size
        self._threads = torch.get_num_threads()  # rank_device may share out the cores; close() restores
        self.processes: list[BaseProcess] = []
        self.on_death: Callable[[str], None] | None = None
        self._closing = False
        if torchrun_rank() is None:
            init = f"tcp://127.0.0.1:{_free_port()}"
            context = mp.get_context("spawn")
            self.processes = [context.Process(target=worker_main, args=(rank, init, config), daemon=True,
                                              name=f"pagegate-tp{rank}") for rank in range(1, size)]
            for process in self.processes:
                process.start()
        else:
            init = "env://"
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but "
                                 f"--tensor-parallel-size is {size}")
        _init_group(config, device, 0, init)
        self.tp = TensorParallel(0, size)
        self.channel = StepChannel(device)
        if self.processes:
            threading.Thread(target=self._watch, name="pagegate-tp-watch", daemon=True).start()

    def share_sizes(self, num_blocks: int, num_cpu_blocks: int) -> None:
        dist.broadcast(torch.tensor([num_blocks, num_cpu_blocks], dtype=torch.int64), 0, group=self.channel.control)

    def close(self, timeout: float = 10.0, graceful: bool = True) -> None:
        """Tell the workers to stop (graceful: they are waiting for a step), wait for them, then make sure
        none is left."""
        self._closing = True
        if graceful:
            try:
                self.channel.stop()
            except Exception as error:  # a worker already gone: the others exit on the broken group
                log.warning("stopping the tensor-parallel workers: %s", error)
        for process in self.processes:
            if not graceful:
                process.kill()
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)

    def _watch(self) -> None:
        by_sentinel = {process.sentinel: process for process in self.processes}
        ready = wait(list(by_sentinel))  # until the first one exits
        if self._closing:
            return
        process = by_sentinel[cast(int, ready[0])]
        process.join(1)  # its sentinel closes a moment before it can be reaped
        message = f"tensor-parallel worker {process.name} exited with code {process.exitcode}"
        log.error(message)
        if self.on_death is not None:
            self.on_death(message)


def worker_main(rank: int, init: str, config: EngineConfig) -> None:
    """A worker process: load this rank's slice, then run steps until rank 0 says stop."""
    if init != "env://":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive rank 0
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 stops us
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    device = rank_device(resolve_device(config.device), rank, config.tensor_parallel_size)
    _init_group(config, device, rank, init)
    channel = StepChannel(device)
    tp = TensorParallel(rank, config.tensor_parallel_size)
    (model, model_config, _), _ = load_checkpoint(model_path(config), config.dtype, device, config.quantization, tp)
    model.fit_context(config.scheduler.max_model_len or model_config.max_position_embeddings)
    sizes = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(sizes, 0, group=channel.control)
    kv_cache = worker_kv_cache(model, config, int(sizes[0]), int(sizes[1]), device)
    while (step := channel.recv()) is not None:
        forward(model, kv_cache, step)
    dist.destroy_process_group()


def worker_kv_cache(model: CausalLM, config: EngineConfig, num_blocks: int, num_cpu_blocks: int,
                    device: torch.device) -> PagedKVCache:
    kv_format = resolve_format(config.cache.kv_cache_dtype, model.dtype, device)
    return PagedKVCache(model.num_layers, num_blocks, config.cache.block_size, model.num_kv_heads, model.head_dim,
                        kv_format, device, num_cpu_blocks)


def _init_group(config: EngineConfig, device: torch.device, rank: int, init: str) -> None:
    dist.init_process_group(backend_for(device), init_method=init, rank=rank,
                            world_size=config.tensor_parallel_size,
                            timeout=timedelta(seconds=config.distributed_timeout_s))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
