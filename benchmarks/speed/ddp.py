"""Plain PyTorch DistributedDataParallel outside Ray: the baseline of the 2-worker training row.

    python -m benchmarks.speed.ddp 2 30      # processes, timed steps; prints one JSON object (benchmarks.run calls `measure`)

``processes`` fresh Python processes (``python -m benchmarks.speed.ddp --rank ...``, started side by
side by `measure`; no Ray anywhere) each pin torch to one thread (``training.model.catalog.configure_cpu(1)``
and ``OMP_NUM_THREADS=1``), join a gloo process group on 127.0.0.1 (a free port, loopback
interface), wrap the same model (``benchmarks.build_model``, same seed on every rank) in
``DistributedDataParallel`` and train it with fused AdamW (lr 1e-3, as ours) and
``CrossEntropyLoss(label_smoothing=0.1)`` on in-memory random tensors: the global batch of 128
split evenly, 64 images per process for 2. Two warm-up steps are not timed; then every process
meets at a barrier, trains ``steps`` steps and meets at a barrier again, and rank 0's seconds
between the barriers give the global images/s (steps x global batch / seconds). Imports, the
process group and the model's construction are not timed. No data loading, augmentation,
validation or checkpoints: this is the distribution itself (a forward and backward per rank and
DDP's gradient all-reduce over gloo every step) as plain PyTorch does it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
WARMUP_STEPS = 2


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_images_per_s(rank: int, world: int, port: int, steps: int, global_batch: int) -> float:
    """One rank's part: join the group, train ``steps`` timed steps; the global images/s it saw."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks import build_model
    from training.model.catalog import configure_cpu

    configure_cpu(1)  # one thread, denormals flushed, as our workers
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        model = DistributedDataParallel(build_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # fused, as ours
        criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
        local = global_batch // world
        generator = torch.Generator().manual_seed(rank)
        x, y = torch.randn(local, 1, 28, 28, generator=generator), torch.randint(0, 10, (local,), generator=generator)
        model.train()
        for step in range(WARMUP_STEPS + steps):
            if step == WARMUP_STEPS:  # warm-up steps are not timed
                dist.barrier()
                start = time.perf_counter()
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        dist.barrier()
        seconds = time.perf_counter() - start
    finally:
        dist.destroy_process_group()
    return steps * local * world / seconds


def measure(processes: int = 2, steps: int = 30, global_batch: int = 128, timeout_s: float = 600) -> dict:
    """Plain DDP with ``processes`` processes x 1 thread; rank 0's global images/s."""
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as tmp:
        outs = [Path(tmp) / f"rank{rank}.out" for rank in range(processes)]
        errs = [Path(tmp) / f"rank{rank}.err" for rank in range(processes)]
        ranks = []
        for rank in range(processes):
            args = [sys.executable, "-m", "benchmarks.speed.ddp", "--rank", str(rank), "--world", str(processes),
                    "--port", str(port), "--steps", str(steps), "--global-batch", str(global_batch)]
            with outs[rank].open("w") as out, errs[rank].open("w") as err:
                ranks.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=err))
        deadline = time.monotonic() + timeout_s
        try:
            codes = [rank.wait(timeout=max(1.0, deadline - time.monotonic())) for rank in ranks]
        finally:
            for rank in ranks:  # a rank that failed leaves the others waiting in the rendezvous
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
        if any(codes):
            raise RuntimeError(f"plain DDP failed (exit codes {codes}):\n" + "\n".join(e.read_text()[-1500:] for e in errs))
        results = [json.loads(out.read_text().strip().splitlines()[-1]) for out in outs]
    return {"images_per_s": results[0]["images_per_s"], "ranks_images_per_s": [r["images_per_s"] for r in results],
            "processes": processes, "threads_per_process": 1, "per_process_batch": global_batch // processes,
            "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("processes", nargs="?", type=int, default=2)
    parser.add_argument("steps_arg", nargs="?", type=int, default=30, metavar="steps")
    parser.add_argument("--rank", type=int, help="(internal) run one rank")
    parser.add_argument("--world", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--global-batch", type=int, default=128)
    args = parser.parse_args(argv)
    if args.rank is None:
        json.dump(measure(args.processes, args.steps_arg, args.global_batch), sys.stdout)
    else:
        rate = rank_images_per_s(args.rank, args.world, args.port, args.steps, args.global_batch)
        print(json.dumps({"rank": args.rank, "images_per_s": rate}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
