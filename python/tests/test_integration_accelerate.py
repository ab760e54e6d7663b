"""ckpt.integrations.accelerate with the real Accelerate (and PEFT): save_state folders hold a
reference to a ckpt step; accelerate's total_limit rotation and ckpt's retention agree; a run
resumed with load_state from an older folder, or from the last complete folder after a SIGKILL
during an async optimizer save, ends bit for bit where the uninterrupted run ends; a LoRA model
(FP32 adapters over a frozen BF16 base) does too. Needs the current stack (skipped under
Debian's torch)."""
import os
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate_ckpt_worker import run  # noqa: E402
from ckpt import CkptError  # noqa: E402
from ckpt.integrations.accelerate import last_complete_checkpoint  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_ckpt_worker.py")
KINDS = ["mlp", "peft"]


def store_steps(root):
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-"))


@pytest.fixture(scope="module", params=KINDS)
def uninterrupted(request, tmp_path_factory):
    if request.param == "peft":
        pytest.importorskip("peft")
        pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp(request.param)
    params, _ = run(tmp / "a", str(tmp / "store"), request.param, 8)
    return request.param, tmp, params


def test_folders_hold_a_reference_and_retention_follows_the_rotation(uninterrupted):
    kind, tmp, _ = uninterrupted
    folders = sorted(os.listdir(tmp / "a" / "checkpoints"))
    assert folders == ["checkpoint_2", "checkpoint_3"]  # total_limit=2 of saves at 2, 4, 6, 8.
    ref = torch.load(tmp / "a" / "checkpoints" / "checkpoint_2" / "optimizer.bin",
                     weights_only=True)
    assert ref["ckpt"]["step"] == 6
    assert os.path.getsize(tmp / "a" / "checkpoints" / "checkpoint_2" / "optimizer.bin") < 4096
    assert store_steps(str(tmp / "store")) == [6, 8]


def test_a_run_resumed_from_an_older_folder_ends_bit_for_bit(uninterrupted):
    kind, tmp, params = uninterrupted
    resumed, keeper = run(tmp / "b", str(tmp / "store"), kind, 8, save_every=0,
                          resume=str(tmp / "a" / "checkpoints" / "checkpoint_2"))
    assert keeper.keeper.loaded == 6
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))


def test_a_run_killed_during_an_async_save_resumes_from_the_last_complete_folder(
        uninterrupted, tmp_path):
    kind, _, params = uninterrupted
    root = str(tmp_path / "store")
    proc = subprocess.run([sys.executable, WORKER, str(tmp_path / "k"), root, kind, "8", "6"],
                          capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    checkpoints = str(tmp_path / "k" / "checkpoints")
    # checkpoint_2 (step 6) was written, but its optimizer step never committed.
    assert os.path.isdir(os.path.join(checkpoints, "checkpoint_2"))
    folder = last_complete_checkpoint(checkpoints)
    assert folder == os.path.join(checkpoints, "checkpoint_1")
    with pytest.raises(CkptError, match="never committed"):
        run(tmp_path / "r0", root, kind, 8, save_every=0,
            resume=os.path.join(checkpoints, "checkpoint_2"))
    resumed, _ = run(tmp_path / "r", root, kind, 8, save_every=0, resume=folder)
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))


def test_two_optimizers_keep_their_own_steps_in_their_own_stores(tmp_path):
    import accelerate
    from accelerate.utils import ProjectConfiguration

    import ckpt.torch
    from ckpt.integrations.accelerate import attach
    acc = accelerate.Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path / "p"), automatic_checkpoint_naming=True, total_limit=2))
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    a, b, opt_a, opt_b = acc.prepare(a, b, ckpt.torch.StagedAdamW(a.parameters(), lr=1e-2),
                                     ckpt.torch.StagedAdamW(b.parameters(), lr=1e-2))
    keepers = [attach(acc, opt_a, str(tmp_path / "sa")), attach(acc, opt_b, str(tmp_path / "sb"))]
    for step in range(1, 9):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        acc.backward(b(a(x)).sum())
        opt_a.step()  # Every step.
        if step % 2 == 0:
            opt_b.step()  # Every other step: its step count is half of a's.
        opt_a.zero_grad()
        opt_b.zero_grad()
        if step % 2 == 0:
            acc.save_state()
    for keeper in keepers:
        keeper.close()
    folders = [tmp_path / "p" / "checkpoints" / f for f in ("checkpoint_2", "checkpoint_3")]
    for name, store, steps in (("optimizer.bin", "sa", [6, 8]), ("optimizer_1.bin", "sb", [3, 4])):
        assert [torch.load(f / name, weights_only=True)["ckpt"]["step"] for f in folders] == steps
        assert store_steps(str(tmp_path / store)) == steps, store
