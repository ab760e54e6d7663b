"""Data-parallel StagedAdamW over torch.distributed (gloo): 2 processes, each owning its pieces
of the state (Megatron buckets, ZeRO-1 style), train and save; 3 processes load that checkpoint
and continue; the result equals a single process trained on the same batches within 2e-6."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import ckpt.torch
from test_torch_optimizer import TinyGPT, groups, muon_groups, relative, shard_loss, torch_groups

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dp_worker.py")


def launch(world, tmp_path, tag, *args, env=None):
    init = tmp_path / f"init-{tag}"
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(world), str(init), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, **(env or {})))
             for r in range(world)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} of {world}:\n{outs[r]}"


def test_two_ranks_save_three_load_and_continue_as_one_process(tmp_path):
    root = str(tmp_path / "root")
    launch(2, tmp_path, "a", root, "train", "1", "4")
    launch(3, tmp_path, "b", root, "resume", "7", str(tmp_path / "dp.pt"))
    got = torch.load(tmp_path / "dp.pt")
    # One process, the whole batch of each step.
    torch.manual_seed(0)
    model = TinyGPT()
    opt = ckpt.torch.StagedAdamW(groups(model), lr=3e-3, threads=1)
    for step in range(1, 8):
        opt.zero_grad()
        shard_loss(model, step, 0, 1).backward()
        opt.step()
    assert got["steps"] == opt.group_steps() == [7, 7]
    for name, p in model.named_parameters():
        want = (p.detach(), opt.master(p), opt.exp_avg(p), opt.exp_avg_sq(p))
        for kind, a, b in zip(("weights", "master", "exp_avg", "exp_avg_sq"), got["state"][name],
                              want):
            assert relative(a, b) <= 2e-6, f"{kind} {name}: {relative(a, b):.2e}"


def test_muon_saved_at_two_ranks_resumes_bit_for_bit_at_one_two_and_three(tmp_path):
    # Every rank steps from the whole batch's gradient, so any DP size steps the same bits:
    # Muon's matrices lie whole on one rank each, AdamW's parameters are cut.
    root = str(tmp_path / "root")
    muon = {"CKPT_TEST_OPT": "muon"}
    launch(2, tmp_path, "a", root, "train", "1", "2", env=muon)
    got = {}
    for world in (1, 2, 3):
        launch(world, tmp_path, f"b{world}", root, "resume", "4", str(tmp_path / f"m{world}.pt"),
               env=muon)
        got[world] = torch.load(tmp_path / f"m{world}.pt")
    # The uninterrupted run: one rank, steps 1 to 4 (in a worker, as torch's own threads make
    # the gradients: one each).
    launch(1, tmp_path, "u", str(tmp_path / "whole"), "train", "1", "4",
           str(tmp_path / "whole.pt"), env=muon)
    want = torch.load(tmp_path / "whole.pt")
    assert want["steps"] == [4, 4]
    for world, dump in got.items():
        assert dump["steps"] == want["steps"]
        for name, state in want["state"].items():
            for kind, a, b in zip(("weights", "master", "momentum or exp_avg"),
                                  dump["state"][name], state):
                assert torch.equal(a, b), f"DP {world}: {kind} {name}"


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                    reason="needs a CUDA device and NCCL (the GPU host)")
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_cuda_parameters_over_nccl_resume_bit_for_bit(tmp_path, optimizer):
    # The CUDA engine with a process_group over NCCL, as many ranks as GPUs (up to 2): saved
    # after step 2 and resumed to step 4, every rank's state equals an uninterrupted run's.
    world = min(2, torch.cuda.device_count())
    env = {"CKPT_TEST_DEVICE": "cuda", "CKPT_TEST_OPT": optimizer}
    launch(world, tmp_path, "a", str(tmp_path / "root"), "train", "1", "2", env=env)
    launch(world, tmp_path, "b", str(tmp_path / "root"), "resume", "4", str(tmp_path / "r.pt"),
           env=env)
    launch(world, tmp_path, "u", str(tmp_path / "whole"), "train", "1", "4",
           str(tmp_path / "u.pt"), env=env)
    got, want = torch.load(tmp_path / "r.pt"), torch.load(tmp_path / "u.pt")
    assert got["steps"] == want["steps"] == [4, 4]
    for name, state in want["state"].items():
        assert state[0].is_cuda
        for kind, a, b in zip(("weights", "master", "momentum or exp_avg", "exp_avg_sq"),
                              got["state"][name], state):
            assert torch.equal(a, b), f"{optimizer}: {kind} {name}"


def test_bf16_parameters_average_their_gradients_in_fp32(tmp_path):
    # gloo cannot all-reduce BF16: the ranks reduce FP32 copies; save at 2, resume at 3.
    root = str(tmp_path / "root")
    launch(2, tmp_path, "a", root, "train", "1", "2", env={"CKPT_TEST_DTYPE": "bf16"})
    launch(3, tmp_path, "b", root, "resume", "3", str(tmp_path / "bf16.pt"),
           env={"CKPT_TEST_DTYPE": "bf16"})
    got = torch.load(tmp_path / "bf16.pt")
    assert got["steps"] == [3, 3]
    for name, (weights, master, _, _) in got["state"].items():
        assert weights.dtype == torch.bfloat16
        assert torch.equal(weights, master.bfloat16()), name


def test_a_step_failing_on_one_rank_raises_on_every_rank_and_nobody_hangs(tmp_path):
    # dp_failure_worker.py: rank 1's step fails before the collectives (a NaN lr: ValueError
    # there, ABORTED on rank 0) and inside ckpt's step (INTERNAL there, ABORTED on rank 0); the
    # steps between and after succeed on both ranks, which end with the same masters.
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dp_failure_worker.py")
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, worker, str(r), "2", str(init)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r}:\n{outs[r]}"
    lines = [dict(line.split(" ", 2)[1:] for line in out.splitlines()
                  if line[:1].isdigit() and line.split(" ", 2)[0] == str(r))
             for r, out in enumerate(outs)]
    assert [lines[0][str(s)] for s in range(1, 6)] == \
        ["ok", "CkptError ABORTED", "ok", "CkptError ABORTED", "ok"], outs[0]
    assert [lines[1][str(s)] for s in range(1, 6)] == \
        ["ok", "ValueError -", "ok", "CkptError INTERNAL", "ok"], outs[1]
    assert lines[0]["master"] == lines[1]["master"]


def test_sharded_state_dicts_follow_torchs_convention(tmp_path):
    # Consolidation on rank 0 (Lightning's way), each rank's own shard saved and loaded back
    # exactly, another rank's shard refused (dp_state_dict_worker.py asserts those), with
    # amsgrad; the consolidated dict equals one process's state on the whole batches.
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dp_state_dict_worker.py")
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, worker, str(r), "2", str(init), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r}:\n{outs[r]}"
    full = torch.load(tmp_path / "full.pt")
    torch.manual_seed(0)
    model = TinyGPT()
    param_groups = groups(model)
    param_groups[1]["maximize"] = True
    opt = ckpt.torch.StagedAdamW(param_groups, lr=3e-3, betas=(0.9, 0.95), amsgrad=True,
                                 threads=1)
    for step in range(1, 4):
        opt.zero_grad()
        shard_loss(model, step, 0, 1).backward()
        opt.step()
    want = opt.state_dict()
    assert full["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        assert set(full["state"][i]) == set(entry) == {"step", "exp_avg", "exp_avg_sq",
                                                       "max_exp_avg_sq", "master"}
        for key, t in entry.items():
            assert relative(full["state"][i][key], t) <= 2e-6, f"{key} of {i}"
    # The consolidated dict is torch's format: torch AdamW takes it.
    rgroups = torch_groups(TinyGPT())
    rgroups[1]["maximize"] = True
    ref = torch.optim.AdamW(rgroups, amsgrad=True)
    ref.load_state_dict(full)
