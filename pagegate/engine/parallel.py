"""Tensor parallelism on torch.distributed: which slice of the model a rank holds, the all-reduce of
row-parallel layers, and the per-step broadcast from rank 0 (the one scheduler) to the workers.

Every rank holds its share of the attention and KV heads for every page, so page ids, block tables and
the whole page core stay on rank 0, unchanged. Each step rank 0 broadcasts the step's inputs as one packed
int64 tensor (after a fixed-size header saying how long each part is); the workers run the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

CONTROL_TIMEOUT = timedelta(days=30)  # workers wait this long for the next step: an idle server is fine
HEADER = 10  # int64: command, then the lengths of the packed parts (see StepInputs.PARTS)
RUN, STOP = 1, 2


class ParallelError(ValueError):
    """The model cannot be split across this many ranks (heads or sizes not divisible)."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (size 1: no group, every call a no-op)."""

    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(this rank's count, its first index) of `total` items split evenly."""
        if total % self.size:
            raise ParallelError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        local = total // self.size
        return local, self.rank * local

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(local KV heads, first one): split when there are enough, else each rank holds the one KV head
        its query heads read (replicated across size / num_kv_heads ranks, as vLLM does)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "the number of KV heads")
        if self.size % num_kv_heads:
            raise ParallelError(f"{num_kv_heads} KV heads cannot be replicated evenly over {self.size} ranks")
        return 1, self.rank // (self.size // num_kv_heads)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x


SINGLE = TensorParallel()


@dataclass
class StepInputs:
    """One forward pass, as every rank runs it: the model inputs and the KV page moves before it."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [B, W]
    seq_lens: np.ndarray  # [B]
    query_start_loc: np.ndarray  # [B + 1]
    swap_out: np.ndarray  # [P, 2] (device page, cpu page)
    copies: np.ndarray  # [C, 2] (src, dst)
    swap_in: np.ndarray  # [Q, 2] (cpu page, device page)
    # (tokens int32 [R], rows float32 [R, hidden]): input rows in place of those tokens' embeddings (an image
    # encoder's); rank 0 only: a vision-language model runs on one rank
    given: tuple[np.ndarray, torch.Tensor] | None = None
    # int64 [T]: the last position each token attends to, past its own for an image's tokens where the model reads
    # images bidirectionally (Gemma 3); None: causal. Rank 0 only, as `given`
    key_ends: np.ndarray | None = None

    PARTS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
             "swap_out", "copies", "swap_in")
    DTYPES = (np.int64, np.int64, np.int64, np.int32, np.int32, np.int32, np.int32, np.int32, np.int32)

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, payload): the command and part lengths, then every part flattened into one int64 tensor."""
        parts = [np.ascontiguousarray(getattr(self, name), dtype=np.int64).reshape(-1) for name in self.PARTS]
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = RUN
        header[1] = self.block_tables.shape[1] if self.block_tables.ndim == 2 else 0
        for i, name in enumerate(("input_ids", "seq_lens", "swap_out", "copies", "swap_in")):
            header[2 + i] = len(getattr(self, name))
        return header, torch.from_numpy(np.concatenate(parts))

    @classmethod
    def unpack(cls, header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
        width, tokens, seqs, outs, copies, ins = (int(v) for v in header[1:7])
        sizes = [tokens, tokens, tokens, seqs * width, seqs, seqs + 1, 2 * outs, 2 * copies, 2 * ins]
        chunks = np.split(payload.numpy(), np.cumsum(sizes)[:-1])
        shapes = [(-1,), (-1,), (-1,), (seqs, width), (-1,), (-1,), (-1, 2), (-1, 2), (-1, 2)]
        a = [chunk.reshape(shape).astype(dtype) for chunk, shape, dtype in zip(chunks, shapes, cls.DTYPES, strict=True)]
        return cls(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8])

    @staticmethod
    def payload_size(header: torch.Tensor) -> int:
        width, tokens, seqs, outs, copies, ins = (int(v) for v in header[1:7])
        return 3 * tokens + seqs * width + 2 * seqs + 1 + 2 * (outs + copies + ins)


class StepChannel:
    """Rank 0 sends each step to the workers; a worker receives the next one (None: stop)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The header waits on its own group: a worker idles in it between steps, beyond the collective timeout.
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def send(self, step: StepInputs) -> None:
        header, payload = step.pack()
        dist.broadcast(header, 0, group=self.control)
        dist.broadcast(payload.to(self.device), 0)

    def recv(self) -> StepInputs | None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        if int(header[0]) == STOP:
            return None
        payload = torch.empty(StepInputs.payload_size(header), dtype=torch.int64, device=self.device)
        dist.broadcast(payload, 0)
        return StepInputs.unpack(header, payload.cpu())

    def stop(self) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = STOP
        dist.broadcast(header, 0, group=self.control)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
