"""The Python training demo killed with SIGKILL while an async save is in flight resumes from
LATEST in a fresh process and ends bit for bit where an uninterrupted run ends: parameters,
masters, both moments, the LR scheduler, the RNG and every group's step. CKPT_TEST_DEVICE=cuda (the
GPU host) trains on the GPU with ckpt's CUDA engine (the demo turns torch's deterministic algorithms
on there)."""
import functools
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEMO = os.path.join(REPO, "demo", "python", "train_gpt.py")
SMALL = ["--steps", "24", "--save-every", "5", "--dim", "64", "--layers", "2", "--threads", "2",
         "--device", os.environ.get("CKPT_TEST_DEVICE", "cpu")]


def run_with(*args):
    return subprocess.run([sys.executable, DEMO, *SMALL, *args], capture_output=True, text=True,
                          env=dict(os.environ))


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("optimizer,groups", [("adamw", 2), ("muon", 3)])
def test_killed_during_an_async_save_resumes_bit_exactly(tmp_path, optimizer, groups):
    run = functools.partial(run_with, "--optimizer", optimizer)
    crashed = run("--out", str(tmp_path / "run"), "--crash-at", "17")
    assert crashed.returncode == -9, crashed.stdout + crashed.stderr
    assert "killed while its async save is in flight" in crashed.stdout
    resumed = run("--out", str(tmp_path / "run"), "--resume", "--dump", str(tmp_path / "a.pt"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from step 15: next step 16" in resumed.stdout
    reference = run("--out", str(tmp_path / "ref"), "--no-save", "--dump", str(tmp_path / "b.pt"))
    assert reference.returncode == 0, reference.stderr
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    for kind in ("params", "masters", "exp_avg", "exp_avg_sq"):
        for name in b[kind]:
            assert torch.equal(bits(a[kind][name]), bits(b[kind][name])), f"{kind} {name}"
    assert a["sched"] == b["sched"]
    assert torch.equal(a["rng"], b["rng"])
    assert a["group_steps"] == b["group_steps"] == [24] * groups
