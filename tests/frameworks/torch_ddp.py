#!/usr/bin/python3
"""One rank of a PyTorch DDP job on the gloo backend (tests/tests/frameworks_torch.rs).

Rendezvous as torchrun does it: rank 0 hosts the TCPStore at --master, every
rank joins with init_process_group("gloo", init_method="tcp://MASTER").

1. Training: a small MLP on synthetic data (fixed seeds; each rank its own
   shard), N steps of SGD through DistributedDataParallel. gloo's all-reduce
   is deterministic for a fixed world size, so the parameters after N steps
   are bit-identical whatever carries the bytes: the rank prints the sha256
   of its state dict.
2. Bandwidth: all_reduce of float32 tensors of the given sizes, timed after a
   warm-up; algbw = bytes / time, busbw = algbw * 2 (n - 1) / n, as
   nccl-tests define them for all_reduce.
3. Hold: the rank prints its result (one JSON line) and then "HOLD", and
   keeps the process group (and so every connection of the job) open until
   a line arrives on stdin, so that the test can count the job's
   connections and the daemons' channels at the same moment.
"""
import argparse
import hashlib
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="host:port of rank 0's TCPStore")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--sizes-mib", default="1,64", help="all_reduce sizes, MiB")
    ap.add_argument("--iters", default="20,4", help="timed iterations per size")
    a = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}",
        rank=a.rank,
        world_size=a.world,
        timeout=timedelta(seconds=120),
    )

    # Training: the same initial model on every rank (DDP also broadcasts
    # rank 0's), a rank-specific data shard.
    torch.manual_seed(a.seed)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
    )
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(a.seed + 1000 + a.rank)
    teacher = torch.Generator().manual_seed(a.seed + 7)
    w_true = torch.randn(64, 1, generator=teacher)
    losses = []
    t0 = time.perf_counter()
    for _ in range(a.steps):
        x = torch.randn(128, 64, generator=gen)
        y = torch.tanh(x @ w_true) + 0.01 * torch.randn(128, 1, generator=gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    train_s = time.perf_counter() - t0
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())

    # Collective bandwidth.
    bench = []
    n = a.world
    for mib, iters in zip(
        [int(s) for s in a.sizes_mib.split(",") if s],
        [int(s) for s in a.iters.split(",") if s],
    ):
        t = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
        dist.all_reduce(t)  # warm-up (and the buffers' first touch)
        dist.barrier()
        t1 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        dt = (time.perf_counter() - t1) / iters
        size = mib * 1024 * 1024
        algbw = size / dt / 1e9
        bench.append(
            {
                "bytes": size,
                "iters": iters,
                "time_us": dt * 1e6,
                "algbw_gbs": algbw,
                "busbw_gbs": algbw * 2 * (n - 1) / n,
            }
        )
        # ones summed over warm-up + iters all-reduces: n ** (iters + 1).
        if t[0].item() != float(n) ** (iters + 1):
            raise SystemExit(f"all_reduce result {t[0].item()} != {n ** (iters + 1)}")

    dist.barrier()
    print(
        json.dumps(
            {
                "rank": a.rank,
                "world": n,
                "state_sha256": h.hexdigest(),
                "loss_first": losses[0],
                "loss_last": losses[-1],
                "train_s": train_s,
                "all_reduce": bench,
            }
        ),
        flush=True,
    )
    print("HOLD", flush=True)
    sys.stdin.readline()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
