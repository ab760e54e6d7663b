"""One rank of test_distributed.py's failure test: a data-parallel StagedAdamW over gloo whose
step fails on rank 1 alone, first before the ranks' collectives (a NaN learning rate in its
param group), then inside ckpt's step (its native step made to fail). Every rank must raise,
none may wait for the others, and the ranks must go on stepping together afterwards. Prints
one line per step: RANK STEP ok|ExceptionType CODE. Usage: dp_failure_worker.py RANK WORLD INIT"""
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import ckpt.torch  # noqa: E402
from test_torch_optimizer import TinyGPT, groups, shard_loss  # noqa: E402
from rank_exit import run_then_exit  # noqa: E402


class FailingStep:
    """ckpt's C library, except that the next native step fails (as a device error would)."""

    def __init__(self, lib):
        self.lib, self.armed = lib, False

    def __getattr__(self, name):
        f = getattr(self.lib, name)
        if name != "ckpt_optimizer_step_masked" or not self.armed:
            return f
        self.armed = False
        return lambda *args: 13  # INTERNAL


def main():
    rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = TinyGPT()
    opt = ckpt.torch.StagedAdamW(groups(model), lr=3e-3, process_group=dist.group.WORLD,
                                 bucket_elems=5000, threads=1)
    failing = FailingStep(ckpt.optim.sharding.lib)
    ckpt.optim.sharding.lib = failing
    for step in range(1, 6):
        opt.zero_grad()
        shard_loss(model, step, rank, world).backward()
        if rank == 1 and step == 2:
            opt.param_groups[0]["lr"] = float("nan")
        if rank == 1 and step == 4:
            failing.armed = True
        try:
            opt.step()
            outcome = "ok"
        except (ValueError, ckpt.CkptError) as e:
            outcome = f"{type(e).__name__} {getattr(e, 'code', '-')}"
        opt.param_groups[0]["lr"] = 3e-3
        print(f"{rank} {step} {outcome}", flush=True)
    ckpt.optim.sharding.lib = failing.lib
    # The ranks still agree: every rank gathers the same masters.
    master = opt.master(next(model.parameters()))
    print(f"{rank} master {float(master.double().sum()):.9e}", flush=True)
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)
