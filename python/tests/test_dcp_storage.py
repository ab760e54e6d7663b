"""ckpt as torch.distributed.checkpoint's storage layer (ckpt.dcp): dcp.save, dcp.async_save
and dcp.load of a model and its StagedAdamW round trip exactly; a step saved by two ranks
(DTensors sharded by rows and by columns) loads at one and at three; a save that fails on one
rank, or is killed, publishes nothing and the next save goes on; damage is refused by name; the
step is an ordinary ckpt step (ckpt-tool verify and inspect). Needs torch ≥ 2.2's DCP: skipped
under Debian's torch 1.13."""
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint.state_dict")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import state_dict as dcp_sd  # noqa: E402

import ckpt._dcp_writer  # noqa: E402
import ckpt.dcp  # noqa: E402
import ckpt.torch  # noqa: E402
from test_trainer_generic import REPO, small_data, small_net  # noqa: E402

# What dcp.save and dcp.load raise: DCP wraps a rank's exception in a CheckpointException (a
# BaseException) carrying its message.
REFUSED = (Exception, dcp.api.CheckpointException)
# CKPT_TEST_DEVICE=cuda (GPU host): the model on the GPU, StagedAdamW's CUDA engine; DCP then
# saves CUDA tensors and loads into them.
DEVICE = os.environ.get("CKPT_TEST_DEVICE", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dcp_worker.py")


def tool():
    path = os.environ.get("CKPT_TOOL") or os.path.join(REPO, "build", "cli", "ckpt-tool")
    if not os.path.exists(path):
        if os.environ.get("CI"):
            pytest.fail(f"ckpt-tool not found at {path} (CKPT_TOOL)")
        pytest.skip(f"ckpt-tool not found at {path} (set CKPT_TOOL)")
    return path


def trained(steps=3):
    x, y = (t.to(DEVICE) for t in small_data())
    model = small_net().to(DEVICE)
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)

    def step(m, o, s):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x[s::4]), y[s::4]).backward()
        o.step()
    for s in range(steps):
        step(model, opt, s)
    return model, opt, step


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_model_and_its_staged_adamw_round_trip_exactly(tmp_path, how):
    if how == "async_save" and not hasattr(dcp, "async_save"):
        pytest.skip("this torch has no dcp.async_save")
    root = str(tmp_path / "root")
    model, opt, step = trained()
    model_sd, optim_sd = dcp_sd.get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd,
             "extra": {"a/b..c@d": torch.arange(3), "epoch": 4}}  # Names ckpt must escape.
    writer = ckpt.dcp.StorageWriter(root, step=3)
    if how == "save":
        dcp.save(state, storage_writer=writer)
    else:
        pending = dcp.async_save(state, storage_writer=writer)
        pending = getattr(pending, "upload_completion", pending)  # An AsyncSaveResponse.
        pending.result()
    assert ckpt.dcp.latest_step(root) == 3
    assert not [e for e in os.listdir(root) if e.startswith(".staging")]

    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                 torch.nn.Linear(16, 1)).to(DEVICE)
    opt2 = ckpt.torch.StagedAdamW(model2.parameters(), lr=1e-2)
    m2, o2 = dcp_sd.get_state_dict(model2, opt2)
    target = {"model": m2, "optim": o2, "extra": {"a/b..c@d": torch.zeros(3, dtype=torch.int64),
                                                    "epoch": 0}}
    dcp.load(target, checkpoint_id=os.path.join(root, "step-3"),
             storage_reader=ckpt.dcp.StorageReader())
    assert torch.equal(target["extra"]["a/b..c@d"], torch.arange(3))
    assert target["extra"]["epoch"] == 4
    dcp_sd.set_state_dict(model2, opt2, model_state_dict=target["model"],
                          optim_state_dict=target["optim"])
    assert opt2.param_steps() == opt.param_steps() == [3] * 4
    for s in range(3, 5):
        step(model, opt, s)
        step(model2, opt2, s)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_the_step_is_a_ckpt_step_that_verifies_inspects_and_diffs(tmp_path):
    root = str(tmp_path / "root")
    model, _, _ = trained(1)
    dcp.save({"model": model.state_dict()},
             checkpoint_id=os.path.join(root, "step-12"), storage_writer=ckpt.dcp.StorageWriter())
    out = subprocess.run([tool(), "verify", root], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    shown = subprocess.run([tool(), "inspect", root], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "model.0.weight" in shown.stdout and "dcp.metadata" in shown.stdout, shown.stdout
    # The same weights in another root compare equal; a changed one differs, by name.
    other = str(tmp_path / "other")
    dcp.save({"model": model.state_dict()}, storage_writer=ckpt.dcp.StorageWriter(other, 1))
    same = subprocess.run([tool(), "diff", root, other], capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    with torch.no_grad():
        model[0].bias[3] += 1
    dcp.save({"model": model.state_dict()}, storage_writer=ckpt.dcp.StorageWriter(other, 2))
    changed = subprocess.run([tool(), "diff", root, other], capture_output=True, text=True)
    assert changed.returncode == 1 and "model.0.bias" in changed.stdout, changed.stdout
    # A step is saved once: saving it again is refused (LATEST already names it).
    with pytest.raises(REFUSED, match="not newer than LATEST"):
        dcp.save({"model": model.state_dict()}, storage_writer=ckpt.dcp.StorageWriter(root, 12))


def test_damage_is_refused_naming_the_file(tmp_path):
    root = str(tmp_path / "root")
    weights = {"w": torch.randn(256, 64)}
    dcp.save(weights, storage_writer=ckpt.dcp.StorageWriter(root, step=1))
    data = os.path.join(root, "step-00000001", "rank-00000.data")
    with open(data, "r+b") as f:
        f.seek(4096 + 1000)
        byte = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(REFUSED, match="rank-00000.data"):
        dcp.load({"w": torch.zeros(256, 64)}, storage_reader=ckpt.dcp.StorageReader(root))


def test_an_unstorable_dtype_is_refused_by_name_and_publishes_nothing(tmp_path):
    root = str(tmp_path / "root")
    with pytest.raises(REFUSED, match="'z' is torch.complex64"):
        dcp.save({"z": torch.zeros(3, dtype=torch.complex64)},
                 storage_writer=ckpt.dcp.StorageWriter(root, step=1))
    assert ckpt.dcp.latest_step(root) is None
    assert not [e for e in os.listdir(root) if e.startswith(".staging")]


def test_a_caching_planner_is_refused_by_name_and_publishes_nothing(tmp_path):
    root = str(tmp_path / "root")
    planner = dcp.DefaultSavePlanner(enable_plan_caching=True) \
        if "enable_plan_caching" in dcp.DefaultSavePlanner.__init__.__code__.co_varnames \
        else pytest.skip("this torch's DefaultSavePlanner caches no plans")
    weights = {"w": torch.randn(4)}
    dcp.save(weights, storage_writer=ckpt.dcp.StorageWriter(root, step=1), planner=planner)
    with pytest.raises(REFUSED, match="enable_plan_caching"):
        dcp.save(weights, storage_writer=ckpt.dcp.StorageWriter(root, step=2), planner=planner)
    assert ckpt.dcp.latest_step(root) == 1
    assert not [e for e in os.listdir(root) if e.startswith(".staging")]


def test_a_writer_serves_one_save_at_a_time(tmp_path, monkeypatch):
    if not hasattr(dcp, "async_save"):
        pytest.skip("this torch has no dcp.async_save")
    root = str(tmp_path / "root")
    writer = ckpt.dcp.StorageWriter(root, step=1)
    weights = {"w": torch.randn(64)}
    writing, release = threading.Event(), threading.Event()
    write_items = ckpt._dcp_writer._write_items

    def held(*args):
        writing.set()
        release.wait(60)
        write_items(*args)
    monkeypatch.setattr(ckpt._dcp_writer, "_write_items", held)
    pending = dcp.async_save(weights, storage_writer=writer)
    pending = getattr(pending, "upload_completion", pending)
    assert writing.wait(60)
    # The async save is writing through `writer`: a second save through it, or closing it,
    # is refused instead of freeing the handles the first one uses.
    writer.step = 2
    with pytest.raises(REFUSED, match="not finished|another thread"):
        dcp.save(weights, storage_writer=writer)
    with pytest.raises(RuntimeError, match="another thread"):
        writer.close()
    release.set()
    pending.result()
    assert ckpt.dcp.latest_step(root) == 1
    monkeypatch.setattr(ckpt._dcp_writer, "_write_items", write_items)
    dcp.save(weights, storage_writer=writer)  # Once it finished, the writer saves again.
    assert ckpt.dcp.latest_step(root) == 2


KILLED_SAVE = r"""
import os, signal, sys, torch
import torch.distributed.checkpoint as dcp
import ckpt.dcp
root = sys.argv[1]
dcp.save({"w": torch.full((64, 64), 1.0), "v": torch.full((8,), 1.0)},
         storage_writer=ckpt.dcp.StorageWriter(root, step=1))
write_items = ckpt._dcp_writer._write_items
def killed(save, items, planner, results):
    write_items(save, items[:1], planner, results)
    os.kill(os.getpid(), signal.SIGKILL)
ckpt._dcp_writer._write_items = killed
dcp.save({"w": torch.full((64, 64), 2.0), "v": torch.full((8,), 2.0)},
         storage_writer=ckpt.dcp.StorageWriter(root, step=2))
"""


def test_a_save_killed_midway_publishes_nothing_and_the_next_save_goes_on(tmp_path):
    root = str(tmp_path / "root")
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, root], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [e for e in os.listdir(root) if e.startswith(".staging-step-00000002")]
    assert ckpt.dcp.latest_step(root) == 1
    state = {"w": torch.zeros(64, 64), "v": torch.zeros(8)}
    dcp.load(state, storage_reader=ckpt.dcp.StorageReader(root))  # LATEST: step 1.
    assert torch.equal(state["w"], torch.full((64, 64), 1.0))
    # The next writer's recovery removes what the killed one left, and step 2 saves.
    dcp.save({"w": torch.full((64, 64), 3.0), "v": torch.full((8,), 3.0)},
             storage_writer=ckpt.dcp.StorageWriter(root, step=2))
    assert not [e for e in os.listdir(root) if e.startswith(".staging")]
    dcp.load(state, storage_reader=ckpt.dcp.StorageReader(root))
    assert torch.equal(state["w"], torch.full((64, 64), 3.0))


def launch(world, tmp_path, tag, *args):
    init = tmp_path / f"init-{tag}"
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(world), str(init), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
             for r in range(world)]
    return [(p.wait(timeout=300), p.stdout.read()) for p in procs]


def test_two_ranks_save_and_one_and_three_ranks_load(tmp_path):
    root = str(tmp_path / "root")
    for r, (code, out) in enumerate(launch(2, tmp_path, "save", root, "save", "5")):
        assert code == 0, f"rank {r}:\n{out}"
    for r, (code, out) in enumerate(launch(3, tmp_path, "load", root, "load")):
        assert code == 0 and "LOADED 2" in out, f"rank {r}:\n{out}"
    # One process, no process group: the whole tensors, from the pieces of both ranks.
    from dcp_worker import full
    state = {"model": {name: torch.zeros_like(t) for name, t in full().items()},
             "note": {"text": "", "world": 0}}
    dcp.load(state, storage_reader=ckpt.dcp.StorageReader(root))
    for name, t in full().items():
        assert torch.equal(state["model"][name], t), name
    shown = subprocess.run([tool(), "verify", root], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stdout + shown.stderr


def test_ranks_saving_without_collectives_are_refused(tmp_path):
    root = str(tmp_path / "root")
    for r, (code, out) in enumerate(launch(2, tmp_path, "nocoll", root, "nocoll", "1")):
        assert code == 0 and "REFUSED WITHOUT COLLECTIVES" in out, f"rank {r}:\n{out}"
    assert ckpt.dcp.latest_step(root) is None


@pytest.mark.parametrize("mode", ["fail", "kill"])
def test_a_rank_that_fails_its_writes_publishes_nothing(tmp_path, mode):
    root = str(tmp_path / "root")
    for r, (code, out) in enumerate(launch(2, tmp_path, "first", root, "save", "1")):
        assert code == 0, f"rank {r}:\n{out}"
    results = launch(2, tmp_path, "second", root, mode, "2")
    if mode == "fail":
        for r, (code, out) in enumerate(results):
            assert code == 0 and "FAILED AS INJECTED" in out, f"rank {r}:\n{out}"
    else:
        assert results[1][0] == -signal.SIGKILL, results[1][1]
        assert results[0][0] != 0  # Its job lost a rank mid-save.
    state = {"model": {"rows": torch.zeros(9, 5)}}
    assert ckpt.dcp.latest_step(root) == 1
    assert not os.path.exists(os.path.join(root, "step-00000002"))
    dcp.load(state, storage_reader=ckpt.dcp.StorageReader(root))
    from dcp_worker import full
    assert torch.equal(state["model"]["rows"], full()["rows"])


def test_tensors_of_any_rank_round_trip_or_are_refused_before_publishing(tmp_path):
    # 17 and 64 dims: the reader asked for 16 dims and refused the step it had committed.
    for n in (17, 64):
        root = str(tmp_path / f"r{n}")
        t = torch.arange(6, dtype=torch.float32).reshape([2, 3] + [1] * (n - 2))
        dcp.save({"t": t}, storage_writer=ckpt.dcp.StorageWriter(root, step=1))
        got = {"t": torch.zeros_like(t)}
        dcp.load(got, storage_reader=ckpt.dcp.StorageReader(root))
        assert torch.equal(got["t"], t)
    # 65 dims (torch allows them): more than a manifest holds, refused before anything is
    # published, naming the tensor.
    root = str(tmp_path / "r65")
    t = torch.zeros([1] * 65)
    with pytest.raises(REFUSED, match="65 dimensions"):
        dcp.save({"t": t}, storage_writer=ckpt.dcp.StorageWriter(root, step=1))
    assert ckpt.dcp.latest_step(root) is None
