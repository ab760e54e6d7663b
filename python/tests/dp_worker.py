"""One rank of the data-parallel test (test_distributed.py): trains the TinyGPT of
test_torch_optimizer.py on its shard of each step's batch with a sharded StagedAdamW over gloo,
saving or resuming through ckpt.Checkpointer. Usage:
    dp_worker.py RANK WORLD INIT_FILE ROOT (train FIRST LAST | resume LAST) [DUMP]
CKPT_TEST_OPT=muon trains with StagedMuon instead. CKPT_TEST_DEVICE=cuda puts each rank's model on
its GPU (rank modulo the GPUs) and the ranks on NCCL."""
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import ckpt.torch  # noqa: E402
from test_torch_optimizer import TinyGPT, groups, muon_groups, shard_loss  # noqa: E402
from rank_exit import run_then_exit  # noqa: E402


def main():
    rank, world, init, root, phase = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], \
        sys.argv[5]
    torch.set_num_threads(1)
    cuda = os.environ.get("CKPT_TEST_DEVICE") == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = TinyGPT()
    if cuda:
        model.cuda()
    if os.environ.get("CKPT_TEST_DTYPE") == "bf16":
        model.to(torch.bfloat16)
    muon = os.environ.get("CKPT_TEST_OPT") == "muon"
    if muon:
        # StagedMuon, each rank with the whole batch's gradient (no reduction): every DP size
        # then steps the same bits (test_distributed.py).
        opt = ckpt.torch.StagedMuon(muon_groups(model), lr=0.02, adamw_lr=3e-3,
                                    process_group=dist.group.WORLD, bucket_elems=5000,
                                    reduce_grads=False, threads=1)
    else:
        opt = ckpt.torch.StagedAdamW(groups(model), lr=3e-3, process_group=dist.group.WORLD,
                                     bucket_elems=5000, threads=1)
    ck = ckpt.Checkpointer(root, opt)
    if phase == "train":
        first, last = int(sys.argv[6]), int(sys.argv[7])
    else:
        extra = ck.load()
        first, last = extra["next_step"], int(sys.argv[6])
    for step in range(first, last + 1):
        opt.zero_grad()
        (shard_loss(model, step, 0, 1) if muon else shard_loss(model, step, rank, world)).backward()
        opt.step()
    if phase == "train":
        ck.save(last, extra={"next_step": last + 1, "rank": rank})
    dump = sys.argv[-1] if sys.argv[-1].endswith(".pt") else None
    state = {n: (p.detach().clone(), opt.master(p), opt.exp_avg(p), opt.exp_avg_sq(p))
             for n, p in model.named_parameters()}  # Collective: every rank gathers.
    if dump and rank == 0:
        torch.save({"state": state, "steps": opt.group_steps()}, dump)
    ck.close()
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)
