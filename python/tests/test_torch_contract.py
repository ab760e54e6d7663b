"""The torch.optim contract: the same generic training code run with torch.optim.AdamW and with
ckpt.torch.StagedAdamW, compared (within 2e-6 normwise per parameter: the two update kernels
order their float operations differently). Runs under every torch the project tests with.

What generic code does to an optimizer: closures, zero_grad both ways, steps without gradients,
torch's own keyword arguments, a tensor lr, every common LR scheduler (OneCycleLR cycling the
betas too), gradient clipping, `optimizer.state[p]`, and state dicts in both directions,
through torch.save and torch.load."""
import copy
import inspect
import io
import os

import pytest
import torch

import ckpt
import ckpt.torch

TOL = 2e-6
# CKPT_TEST_DEVICE=cuda runs the suite on CUDA parameters (the GPU host); CPU by default.
DEVICE = torch.device(os.environ.get("CKPT_TEST_DEVICE", "cpu"))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.fc2 = torch.nn.Linear(24, 5)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def pair(seed=0):
    torch.manual_seed(seed)
    a = Net().to(DEVICE)
    b = Net().to(DEVICE)
    b.load_state_dict(a.state_dict())
    return a, b


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    plain = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


def make(kind, model, **kw):
    if kind == "torch":
        return torch.optim.AdamW(param_groups(model), foreach=False, **kw)
    return ckpt.torch.StagedAdamW(param_groups(model), **kw)


def loss(model, step):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(8, 12, generator=g).to(DEVICE)
    y = torch.randn(8, 5, generator=g).to(DEVICE)
    return torch.nn.functional.mse_loss(model(x), y)


def relative(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / max(b.norm().item(), 1e-30)).item()


def assert_close(ours, ref, what=""):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert relative(a, b) <= TOL, f"{what}{name} off by {relative(a, b):.2e}"


def train(model, opt, steps, first=0, sched=None, clip=None, closure=False, set_to_none=True):
    for s in range(first, first + steps):
        opt.zero_grad(set_to_none=set_to_none)
        if closure:
            def closure_fn(s=s):
                opt.zero_grad()
                value = loss(model, s)
                value.backward()
                return value
            opt.step(closure_fn)
        else:
            value = loss(model, s)
            value.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        if sched is not None:
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(float(s % 3))  # A plateau every few steps.
            else:
                sched.step()


def run_both(steps=12, sched=None, **train_kw):
    """The same code with both optimizers; returns (ours, ref) models and optimizers."""
    out = {}
    models = pair()
    for kind, model in zip(("ckpt", "torch"), models):
        opt = make(kind, model, lr=3e-3, betas=(0.9, 0.95))
        s = sched(opt) if sched is not None else None
        train(model, opt, steps, sched=s, **train_kw)
        out[kind] = (model, opt)
    return out["ckpt"], out["torch"]


SCHEDULERS = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=1e-2, total_steps=20, cycle_momentum=True, base_momentum=0.85,
        max_momentum=0.95),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)], milestones=[3]),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_schedulers_drive_both_alike(name):
    (ours, opt), (ref, ropt) = run_both(sched=SCHEDULERS[name])
    assert_close(ours, ref, f"{name}: ")
    for g, rg in zip(opt.param_groups, ropt.param_groups):
        assert float(g["lr"]) == float(rg["lr"])
        assert tuple(map(float, g["betas"])) == tuple(map(float, rg["betas"]))


def test_closure_and_zero_grad_both_ways_and_clipping():
    for kw in ({"closure": True}, {"set_to_none": False}, {"clip": 0.05}):
        (ours, _), (ref, _) = run_both(**kw)
        assert_close(ours, ref, f"{kw}: ")


def test_a_step_without_any_gradient_changes_nothing():
    (ours, opt), (ref, ropt) = run_both(steps=3)
    before = [p.detach().clone() for p in ours.parameters()]
    steps = opt.group_steps()
    for o in (opt, ropt):
        o.zero_grad(set_to_none=True)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))
    assert opt.group_steps() == steps
    train(ours, opt, 2, first=3)
    train(ref, ropt, 2, first=3)
    assert_close(ours, ref)


def test_torch_keyword_arguments_and_a_tensor_lr():
    # Each at its default, as far as this torch's AdamW has it (1.13 lacks a few).
    defaults = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                    differentiable=False, fused=None)
    known = inspect.signature(torch.optim.AdamW).parameters
    torch_kw = {k: v for k, v in defaults.items() if k in known}
    ours, ref = pair()
    opt = ckpt.torch.StagedAdamW(param_groups(ours), lr=torch.tensor(3e-3), **torch_kw)
    ropt = torch.optim.AdamW(param_groups(ref), lr=torch.tensor(3e-3), **torch_kw)
    train(ours, opt, 5)
    train(ref, ropt, 5)
    assert_close(ours, ref)
    # Every key of torch's param groups is there, so the two state dicts carry the same keys.
    assert set(opt.param_groups[0]) == set(ropt.param_groups[0])
    if "differentiable" in known:  # torch 1.13's AdamW has no such argument.
        with pytest.raises(NotImplementedError, match="differentiable"):
            ckpt.torch.StagedAdamW(param_groups(ours), differentiable=True)
    with pytest.raises(TypeError, match="unexpected"):
        ckpt.torch.StagedAdamW(param_groups(ours), no_such_option=1)


def test_amsgrad_keeps_the_running_maximum_as_torch_does():
    # A loss whose gradients shrink after a few steps: the second moment falls below its
    # maximum, which then sets the step size.
    ours, ref = pair()
    opt = make("ckpt", ours, lr=3e-3, betas=(0.9, 0.9), amsgrad=True)
    ropt = make("torch", ref, lr=3e-3, betas=(0.9, 0.9), amsgrad=True)
    train(ours, opt, 8)
    train(ref, ropt, 8)
    assert_close(ours, ref)
    mine, theirs = opt.state_dict(), ropt.state_dict()
    below = 0
    for i, entry in theirs["state"].items():
        assert relative(mine["state"][i]["max_exp_avg_sq"], entry["max_exp_avg_sq"]) <= TOL, i
        below += int((entry["exp_avg_sq"] < entry["max_exp_avg_sq"]).sum())
    assert below > 0, "the run must make the maximum differ from exp_avg_sq"
    # Both directions through torch.save, then every run goes on alike.
    fresh_ours = copy.deepcopy(ref)  # torch's state into ckpt, over torch's weights.
    fresh = make("ckpt", fresh_ours, lr=3e-3, betas=(0.9, 0.9), amsgrad=True)
    fresh.load_state_dict(round_trip(theirs))
    fresh_ref = copy.deepcopy(ours)  # ckpt's state into torch, over ckpt's weights.
    fresh_torch = make("torch", fresh_ref, lr=3e-3, betas=(0.9, 0.9), amsgrad=True)
    fresh_torch.load_state_dict(round_trip(mine))
    for model, o in ((ours, opt), (ref, ropt), (fresh_ours, fresh), (fresh_ref, fresh_torch)):
        train(model, o, 3, first=8)
    assert_close(fresh_ours, ref, "torch -> ckpt: ")
    assert_close(fresh_ref, ref, "ckpt -> torch: ")
    assert_close(ours, ref)


def test_amsgrad_per_group_and_its_refusals():
    ours, ref = pair()
    groups = param_groups(ours)
    groups[1]["amsgrad"] = True  # Only the biases and norms.
    opt = ckpt.torch.StagedAdamW(groups, lr=3e-3, betas=(0.9, 0.9))
    rgroups = param_groups(ref)
    rgroups[1]["amsgrad"] = True
    ropt = torch.optim.AdamW(rgroups, lr=3e-3, betas=(0.9, 0.9), foreach=False)
    train(ours, opt, 6)
    train(ref, ropt, 6)
    assert_close(ours, ref)
    assert "max_exp_avg_sq" in opt.state[ours.fc1.bias]
    assert "max_exp_avg_sq" not in opt.state[ours.fc1.weight]
    assert torch.equal(opt.max_exp_avg_sq(ours.fc1.weight), torch.zeros(ours.fc1.weight.shape))
    # An optimizer built without amsgrad keeps no maximum: turning it on later is refused by
    # name at the next step, and so is a state dict of amsgrad groups, with nothing changed.
    plain_model, _ = pair()
    plain = make("ckpt", plain_model, lr=3e-3)
    train(plain_model, plain, 1)
    before = [p.detach().clone() for p in plain_model.parameters()]
    with pytest.raises(ValueError, match="amsgrad"):
        plain.load_state_dict(round_trip(opt.state_dict()))
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        plain.max_exp_avg_sq(plain_model.fc1.weight)
    plain.param_groups[0]["amsgrad"] = True
    with pytest.raises(ckpt.CkptError, match="amsgrad"):
        train(plain_model, plain, 1, first=1)
    assert all(torch.equal(a, b) for a, b in zip(before, plain_model.parameters()))


def test_eps_zero_steps_as_torch_does():
    ours, ref = pair()
    opt = make("ckpt", ours, lr=1e-3, eps=0.0)
    ropt = make("torch", ref, lr=1e-3, eps=0.0)
    train(ours, opt, 4)
    train(ref, ropt, 4)
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    assert_close(ours, ref)


def test_maximize_ascends_as_torch_does():
    ours, ref = pair()
    opt = make("ckpt", ours, lr=1e-3, maximize=True)
    ropt = make("torch", ref, lr=1e-3, maximize=True)
    train(ours, opt, 6)
    train(ref, ropt, 6)
    assert_close(ours, ref)


def test_maximize_per_param_group_as_torch():
    # One group ascends, the other descends; the gradients torch hands back are untouched.
    ours, ref = pair()
    groups, rgroups = param_groups(ours), param_groups(ref)
    groups[1]["maximize"] = rgroups[1]["maximize"] = True
    opt = ckpt.torch.StagedAdamW(groups, lr=1e-3)
    ropt = torch.optim.AdamW(rgroups, lr=1e-3, foreach=False)
    for s in range(5):
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            loss(model, s).backward()
        before = [p.grad.clone() for p in ours.parameters()]
        opt.step()
        ropt.step()
        assert all(torch.equal(a, p.grad) for a, p in zip(before, ours.parameters()))
    assert_close(ours, ref)


def test_optimizer_state_reads_as_torchs():
    (ours, opt), (ref, ropt) = run_both(steps=4)
    assert len(opt.state) == len(ropt.state) == len(list(ours.parameters()))
    for p, rp in zip(ours.parameters(), ref.parameters()):
        mine, theirs = opt.state[p], ropt.state[rp]
        assert float(mine["step"]) == float(theirs["step"]) == 4.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert mine[key].shape == theirs[key].shape
            assert relative(mine[key], theirs[key]) <= 1e-5, key
        assert torch.equal(mine["master"], p.detach().cpu())  # FP32: the master itself.
    fresh = ckpt.torch.StagedAdamW(Net().parameters())
    assert not fresh.state and len(fresh.state) == 0  # No state before the first step.
    with pytest.raises(TypeError, match="load_state_dict"):
        opt.state[next(ours.parameters())] = {}
    # What a caller assigns into an entry (Lightning moves each to the GPU so) is its own copy.
    p = next(ours.parameters())
    entry = opt.state[p]
    entry["exp_avg"] = torch.zeros(1)
    assert opt.state[p]["exp_avg"].shape == p.shape


def round_trip(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_state_dicts_load_in_both_directions_through_torch_save():
    # StagedAdamW -> torch AdamW: both then go on alike.
    (ours, opt), (ref, ropt) = run_both(steps=5)
    ropt.load_state_dict(round_trip(opt.state_dict()))
    train(ours, opt, 4, first=5)
    train(ref, ropt, 4, first=5)
    assert_close(ours, ref, "ckpt -> torch: ")
    # torch AdamW -> a fresh StagedAdamW over the torch model's weights.
    (_, _), (ref2, ropt2) = run_both(steps=5)
    ours2 = Net().to(DEVICE)
    ours2.load_state_dict(ref2.state_dict())
    opt2 = make("ckpt", ours2, lr=1e-4)
    opt2.load_state_dict(round_trip(ropt2.state_dict()))
    assert opt2.group_steps() == [5, 5]
    assert opt2.param_groups[0]["lr"] == ropt2.param_groups[0]["lr"]
    train(ours2, opt2, 4, first=5)
    train(ref2, ropt2, 4, first=5)
    assert_close(ours2, ref2, "torch -> ckpt: ")


def test_state_dict_has_torchs_shape():
    (ours, opt), (ref, ropt) = run_both(steps=2)
    mine, theirs = opt.state_dict(), ropt.state_dict()
    assert sorted(mine["state"]) == sorted(theirs["state"])
    assert [g["params"] for g in mine["param_groups"]] == \
        [g["params"] for g in theirs["param_groups"]]
    for i in theirs["state"]:
        assert set(theirs["state"][i]) <= set(mine["state"][i])
        assert mine["state"][i]["exp_avg"].device.type == "cpu"


def test_a_bad_state_dict_changes_nothing():
    (ours, opt), _ = run_both(steps=3)
    good = opt.state_dict()
    before = [p.detach().clone() for p in ours.parameters()]
    snapshot = {k: v.clone() for k, v in opt.state[next(ours.parameters())].items()}
    bad_size = round_trip(good)
    first = bad_size["state"][0]
    first["exp_avg"] = torch.zeros(first["exp_avg"].numel() + 1)
    bad_value = round_trip(good)
    bad_value["state"][1]["exp_avg_sq"].view(-1)[0] = float("nan")
    bad_steps = round_trip(good)
    bad_steps["state"][0]["step"] = torch.tensor(-7.0)
    bad_groups = round_trip(good)
    bad_groups["param_groups"].pop()
    for bad, match in ((bad_size, "elements"), (bad_value, "non-finite"),
                       (bad_steps, "not a count"), (bad_groups, "param groups")):
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))
    after = opt.state[next(ours.parameters())]
    assert all(torch.equal(after[k], snapshot[k]) for k in snapshot)
    assert opt.group_steps() == [3, 3]
    opt.load_state_dict(good)  # The good one still loads.


def test_parameters_keep_their_own_storage():
    (ours, opt), _ = run_both(steps=2)
    # torch.save of one parameter writes that parameter, not a buffer shared with the others.
    buffer = io.BytesIO()
    torch.save(ours.fc1.bias, buffer)
    assert len(buffer.getvalue()) < 2048 + 4 * ours.fc1.bias.numel()
    storages = {p.data_ptr() for p in ours.parameters()}
    assert len(storages) == len(list(ours.parameters()))


def test_safetensors_saves_every_tensor_of_the_model(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    (ours, opt), _ = run_both(steps=2)
    path = tmp_path / "model.safetensors"
    safetensors.save_file(ours.state_dict(), str(path))
    loaded = safetensors.load_file(str(path))
    assert set(loaded) == set(ours.state_dict())
    for name, t in ours.state_dict().items():
        assert torch.equal(loaded[name], t.cpu()), name


def test_state_dicts_whose_steps_do_not_fit_are_refused():
    (ours, opt), _ = run_both(steps=2)
    good = opt.state_dict()
    # 2**64 once wrapped to 0 silently (the parameter then had no state); inf and NaN too.
    for value in (-1.0, 1.5, 2.0**64, float("inf"), float("nan")):
        bad = round_trip(good)
        for entry in bad["state"].values():
            entry["step"] = torch.tensor(value)
        with pytest.raises(ValueError, match="not a count"):
            opt.load_state_dict(bad)
    assert opt.group_steps() == [2, 2]
    train(ours, opt, 1, first=2)  # Still steps: nothing was changed.
