"""One rank of the sharded state dict test (test_distributed.py): a data-parallel StagedAdamW
with amsgrad (and maximize in one group) over gloo follows torch's sharded-optimizer convention. Usage:
    dp_state_dict_worker.py RANK WORLD INIT_FILE OUT_DIR
Writes OUT_DIR/full.pt (rank 0's consolidated state dict) and OUT_DIR/shard-RANK.pt; asserts
the rest itself (a failed assertion is a non-zero exit, which the test reports)."""
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt.torch  # noqa: E402
from test_torch_optimizer import TinyGPT, groups, shard_loss  # noqa: E402
from rank_exit import run_then_exit  # noqa: E402


def train(model, opt, first, last, rank, world):
    for step in range(first, last + 1):
        opt.zero_grad()
        shard_loss(model, step, rank, world).backward()
        opt.step()


def same(a, b):
    """Two state dicts hold the same tensors, bit for bit."""
    assert a["state"].keys() == b["state"].keys()
    for i, entry in a["state"].items():
        assert entry.keys() == b["state"][i].keys(), i
        for key, t in entry.items():
            assert torch.equal(t, b["state"][i][key]), (i, key)


def main():
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = TinyGPT()
    param_groups = groups(model)
    param_groups[1]["maximize"] = True  # Per group: the norms and biases ascend.
    opt = ckpt.torch.StagedAdamW(param_groups, lr=3e-3, betas=(0.9, 0.95), amsgrad=True,
                                 process_group=dist.group.WORLD, bucket_elems=5000, threads=1)
    train(model, opt, 1, 3, rank, world)

    # Lightning's way: consolidate on every rank, state_dict() on rank 0 only (no collective
    # there); the other ranks refuse rather than wait for a collective nobody joins.
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(opt.state_dict(), os.path.join(out, "full.pt"))
    else:
        try:
            opt.state_dict()
            raise AssertionError("state_dict() on a rank the state was not consolidated on")
        except RuntimeError as e:
            assert "consolidated on rank 0" in str(e), e

    # This rank's shard: never collective (the last rank asks first, alone).
    if rank == world - 1:
        opt.local_state_dict()
    dist.barrier()
    shard = opt.local_state_dict()
    assert shard["shard"]["rank"] == rank and shard["shard"]["world_size"] == world
    owned = sum(n for _, _, n in shard["shard"]["pieces"])
    assert owned < sum(p.numel() for p in model.parameters()), "a shard is not the whole"
    numel = [q.numel() for g in opt.param_groups for q in g["params"]]
    assert any(n < numel[i] for i, _, n in shard["shard"]["pieces"]), "no parameter is cut"
    torch.save(shard, os.path.join(out, f"shard-{rank}.pt"))
    weights = [p.detach().clone() for p in model.parameters()]
    dist.barrier()

    train(model, opt, 4, 5, rank, world)
    after = opt.state_dict()  # Collective: every rank gets the whole state.
    # Per parameter, collective too: p's elements gathered from the ranks that own them (its
    # pieces lie on both ranks for some) equal the whole state's entry bit for bit.
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        for key, read in (("master", opt.master), ("exp_avg", opt.exp_avg),
                          ("exp_avg_sq", opt.exp_avg_sq), ("max_exp_avg_sq", opt.max_exp_avg_sq)):
            got = read(p)
            assert got.shape == p.shape and torch.equal(got, after["state"][i][key]), (key, i)
    after_weights = [p.detach().clone() for p in model.parameters()]

    # opt.state is this rank's and reads no other rank's: rank 0 reads all of it while rank 1
    # waits at the barrier (a collective read would hang until the group's timeout). Each
    # entry holds this rank's elements of the whole state, zero at the others'.
    if rank == 0:
        params = [q for g in opt.param_groups for q in g["params"]]
        mine = {}
        for i, begin, count in opt.local_state_dict()["shard"]["pieces"]:
            mine.setdefault(i, torch.zeros(params[i].numel(), dtype=torch.bool))[
                begin:begin + count] = True
        assert len(opt.state) == len(mine) and set(map(id, opt.state)) == \
            {id(params[i]) for i in mine}
        for i, owned in mine.items():
            entry = opt.state[params[i]]
            assert set(entry) == set(after["state"][i]), i
            assert torch.equal(entry["step"], after["state"][i]["step"]), i
            for key, t in entry.items():
                if key == "step":
                    continue
                want = torch.where(owned, after["state"][i][key].reshape(-1), torch.zeros(()))
                assert t.shape == params[i].shape and torch.equal(t.reshape(-1), want), (key, i)
    dist.barrier()

    # Another rank's shard is refused on every rank, with nothing changed.
    other = torch.load(os.path.join(out, f"shard-{(rank + 1) % world}.pt"))
    try:
        opt.load_state_dict(other)
        raise AssertionError("another rank's shard loaded")
    except ValueError as e:
        assert "shard of rank" in str(e), e
    assert all(torch.equal(a, b) for a, b in zip(after_weights, model.parameters()))

    # Each rank's own shard back (over the weights of that step): the run goes on exactly.
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    opt.load_state_dict(torch.load(os.path.join(out, f"shard-{rank}.pt")))
    assert opt.param_steps() == [3] * len(list(model.parameters()))
    train(model, opt, 4, 5, rank, world)
    same(opt.state_dict(), after)
    assert all(torch.equal(a, b) for a, b in zip(after_weights, model.parameters()))
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)
