"""The classic torch.distributed example, on the minicomm backend: 4 processes started with
torch.multiprocessing (start method "spawn"), rendezvous at MASTER_ADDR:MASTER_PORT, each
all-reduces rank + 1, and every rank prints 10.0 (1 + 2 + 3 + 4).

    python examples/torch_allreduce.py

The only change from the NCCL/gloo version is ``import minicomm.torch`` and
``backend="minicomm"``.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import minicomm.torch  # noqa: F401  (registers the "minicomm" backend)

WORLD_SIZE = 4


def run(rank: int, world_size: int) -> None:
    dist.init_process_group(backend="minicomm", rank=rank, world_size=world_size)
    tensor = torch.tensor([rank + 1.0])
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    # one write per line: the four processes share one stdout
    sys.stdout.write(f"rank {rank}: all_reduce of rank + 1 = {tensor.item()}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


def init_process(rank: int, world_size: int, fn) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    fn(rank, world_size)


if __name__ == "__main__":
    mp.set_start_method("spawn")
    processes = []
    for rank in range(WORLD_SIZE):
        p = mp.Process(target=init_process, args=(rank, WORLD_SIZE, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    raise SystemExit(max(p.exitcode for p in processes))
