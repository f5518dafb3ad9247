"""How the FSDP2 examples start their ranks: under ``torchrun`` (NCCL on CUDA, ``cpcompile.gloo_backend()`` on CPU),
or, without a launcher, by spawning ``world`` CPU processes that meet through a file."""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cpcompile


def _spawned(rank: int, world: int, init_file: str, train, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        cpcompile.gloo_backend(),  # gloo with one worker thread per group (see cpcompile.runtime.gloo)
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        train(args, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def launch(train, args, world: int) -> None:
    """Run ``train(args, device)`` on every rank of ``world = dp * cp`` ranks, then destroy the process group."""
    if "RANK" in os.environ:  # launched by torchrun
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            device, backend = torch.device("cuda", local_rank), "nccl"
        else:
            device, backend = torch.device("cpu"), cpcompile.gloo_backend()
        dist.init_process_group(backend)
        if dist.get_world_size() != world:
            raise SystemExit(f"--dp {args.dp} x --cp {args.cp} = {world}, but torchrun started {dist.get_world_size()}")
        try:
            train(args, device)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:  # no launcher: spawn dp * cp CPU processes with gloo
        rendezvous = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _spawned, args=(world, rendezvous, train, args), nprocs=world, join=False, start_method="spawn"
        )
        while not ctx.join():
            pass
