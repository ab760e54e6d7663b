"""The torch.optim contract, per parameter: what generic code does to single parameters, run
with torch.optim.AdamW and with ckpt.torch.StagedAdamW and compared (helpers and tolerance from
test_torch_contract). Parameters without a gradient (None, frozen) are skipped with their own
step counts, as torch skips them; parameters changed in place are continued from; NaN
gradients, deep copies of the model, non-contiguous parameters, torch.compile and GradScaler."""
import copy

import pytest
import torch

import ckpt
import ckpt.torch
from test_torch_contract import (DEVICE, assert_close, loss, make, pair, relative, round_trip,
                                 train)


def step_with(model, opt, s, drop=()):
    """One step on loss(model, s) whose gradients of the parameters named in `drop` are None."""
    opt.zero_grad(set_to_none=True)
    loss(model, s).backward()
    for name, p in model.named_parameters():
        if name in drop:
            p.grad = None
    opt.step()


def both(**kw):
    a, b = pair()
    return (a, make("ckpt", a, lr=3e-3, **kw)), (b, make("torch", b, lr=3e-3, **kw))


def test_none_gradients_skip_a_parameter_and_its_step_count_as_torch_does():
    (ours, opt), (ref, ropt) = both()
    drops = [(), ("fc2.weight",), ("fc2.weight", "norm.bias"), (), ("fc1.bias",), ()]
    for s, drop in enumerate(drops):
        before = {n: p.detach().clone() for n, p in ours.named_parameters()}
        for model, o in ((ours, opt), (ref, ropt)):
            step_with(model, o, s, drop)
        for name in drop:
            assert torch.equal(dict(ours.named_parameters())[name], before[name]), name
        assert_close(ours, ref, f"step {s}: ")
    mine, theirs = opt.state_dict(), ropt.state_dict()
    for i in theirs["state"]:
        assert float(mine["state"][i]["step"]) == float(theirs["state"][i]["step"]), i
    assert sorted({float(e["step"]) for e in mine["state"].values()}) == [4.0, 5.0, 6.0]


def test_frozen_parameters_given_to_the_optimizer_do_not_move():
    (ours, opt), (ref, ropt) = both(weight_decay=0.1)
    for model in (ours, ref):
        model.fc1.weight.requires_grad_(False)
    frozen = ours.fc1.weight.detach().clone()
    train(ours, opt, 4)
    train(ref, ropt, 4)
    assert torch.equal(ours.fc1.weight, frozen)
    assert ours.fc1.weight not in opt.state  # torch keeps no state for it either.
    assert_close(ours, ref)


def test_state_dicts_with_per_parameter_steps_load_in_both_directions():
    (ours, opt), (ref, ropt) = both()
    for s, drop in enumerate([(), ("fc2.bias",), ()]):
        for model, o in ((ours, opt), (ref, ropt)):
            step_with(model, o, s, drop)
    # torch's state (steps 3 and 2) into a fresh StagedAdamW over the reference's weights.
    copy_of_ref = copy.deepcopy(ref)
    fresh = make("ckpt", copy_of_ref, lr=3e-3)
    fresh.load_state_dict(round_trip(ropt.state_dict()))
    assert sorted(set(fresh.param_steps())) == [2, 3]
    # StagedAdamW's state into a fresh torch AdamW over our weights.
    copy_of_ours = copy.deepcopy(ours)
    fresh_torch = make("torch", copy_of_ours, lr=3e-3)
    fresh_torch.load_state_dict(round_trip(opt.state_dict()))
    for s in range(3, 6):
        for model, o in ((ours, opt), (ref, ropt), (copy_of_ref, fresh), (copy_of_ours, fresh_torch)):
            step_with(model, o, s)
    assert_close(copy_of_ref, ref, "torch -> ckpt: ")
    assert_close(copy_of_ours, ref, "ckpt -> torch: ")


def edits():
    """In-place edits generic code makes after the optimizer was built, each applied to a model."""
    torch.manual_seed(3)
    other = pair(seed=7)[0].state_dict()

    def load(m):
        m.load_state_dict(other)

    def scale(m):
        with torch.no_grad():
            m.fc1.weight.mul_(0.5)

    def reinit(m):
        torch.manual_seed(11)
        torch.nn.init.normal_(m.fc2.weight, std=0.02)

    def ema_swap(m):
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p * 0.9 + 0.01)
    return {"load_state_dict": load, "mul_": scale, "init": reinit, "ema_swap": ema_swap}


@pytest.mark.parametrize("name", sorted(edits()))
def test_a_parameter_changed_in_place_is_continued_from(name):
    (ours, opt), (ref, ropt) = both()
    train(ours, opt, 2)
    train(ref, ropt, 2)
    for model in (ours, ref):
        edits()[name](model)
    assert_close(ours, ref, "after the edit: ")
    train(ours, opt, 3, first=2)
    train(ref, ropt, 3, first=2)
    assert_close(ours, ref, f"{name}: ")
    # The masters follow the edit (an FP32 parameter's master is the parameter itself).
    for p in ours.parameters():
        assert torch.equal(opt.master(p), p.detach().cpu())


def test_a_bf16_parameter_changed_in_place_takes_its_value_as_the_master():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(device=DEVICE, dtype=torch.bfloat16)
    opt = ckpt.torch.StagedAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8, dtype=torch.bfloat16, device=DEVICE)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(0.375)
    opt.zero_grad(set_to_none=True)
    opt.step()  # No gradient: nothing steps, but the edit is seen.
    assert torch.equal(opt.master(model.weight).cpu(), torch.full((4, 8), 0.375))


def test_nan_gradients_poison_the_parameter_as_in_torch():
    (ours, opt), (ref, ropt) = both()
    for model, o in ((ours, opt), (ref, ropt)):
        o.zero_grad()
        loss(model, 0).backward()
        model.fc2.bias.grad[0] = float("nan")
        o.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
        if not torch.isnan(b).any():
            assert relative(a, b) <= 2e-6, name
    assert torch.isnan(ours.fc2.bias).any()


def test_a_deep_copy_of_the_model_is_independent_of_the_optimizer():
    (ours, opt), (ref, ropt) = both()
    train(ours, opt, 2)
    train(ref, ropt, 2)
    snapshot = copy.deepcopy(ours)
    frozen = [p.detach().clone() for p in snapshot.parameters()]
    train(ours, opt, 2, first=2)
    train(ref, ropt, 2, first=2)
    assert all(torch.equal(a, b) for a, b in zip(snapshot.parameters(), frozen))
    assert_close(ours, ref)


class Transposed(torch.nn.Module):
    """A parameter stored transposed (a non-contiguous view of its storage)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(5, 12).to(DEVICE).t())
        self.b = torch.nn.Parameter(torch.zeros(5, device=DEVICE))

    def forward(self, x):
        return x @ self.w + self.b


def test_non_contiguous_parameters_step_in_place():
    ours, ref = Transposed(), Transposed()
    assert not ours.w.is_contiguous()
    opt = ckpt.torch.StagedAdamW(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    storage = ours.w.data_ptr()
    for s in range(4):
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            g = torch.Generator().manual_seed(s)
            model(torch.randn(3, 12, generator=g).to(DEVICE)).pow(2).sum().backward()
            o.step()
    assert ours.w.data_ptr() == storage and not ours.w.is_contiguous()
    assert relative(ours.w, ref.w) <= 2e-6 and relative(ours.b, ref.b) <= 2e-6


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile is torch >= 2")
@pytest.mark.parametrize("when", ["before", "after"])
def test_torch_compile_before_or_after_building_the_optimizer(when):
    a, b = pair()
    out = []
    for kind, model in (("ckpt", a), ("torch", b)):
        if when == "before":
            model = torch.compile(model, backend="aot_eager")
            opt = make(kind, model, lr=3e-3)
        else:
            opt = make(kind, model, lr=3e-3)
            model = torch.compile(model, backend="aot_eager")
        train(model, opt, 3)
        out.append(model)
    assert_close(a, b)


@pytest.mark.skipif(not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"),
                    reason="torch.amp.GradScaler on the CPU is torch >= 2.3")
def test_grad_scaler_skips_a_step_with_inf_gradients_as_torch_does():
    (ours, opt), (ref, ropt) = both()
    for model, o in ((ours, opt), (ref, ropt)):
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=1024.0)
        for s in range(4):
            o.zero_grad()
            scaler.scale(loss(model, s)).backward()
            if s == 1:
                model.fc1.weight.grad[0, 0] = float("inf")
            scaler.step(o)
            scaler.update()
        model.scale = scaler.get_scale()
    assert ours.scale == ref.scale == 1024.0 / 2  # One backoff.
    assert_close(ours, ref)
    assert [float(e["step"]) for e in opt.state_dict()["state"].values()] == \
        [float(e["step"]) for e in ropt.state_dict()["state"].values()]


class Adapted(torch.nn.Module):
    """A frozen BF16 base with an FP32 adapter beside it (PEFT's LoRA layout)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.base = torch.nn.Linear(12, 6).to(torch.bfloat16).requires_grad_(False)
        self.down = torch.nn.Linear(12, 3, bias=False)
        self.up = torch.nn.Linear(3, 6, bias=False)
        self.to(DEVICE)

    def forward(self, x):
        return self.base(x.to(torch.bfloat16)).float() + self.up(self.down(x))


def test_a_frozen_bf16_base_and_fp32_adapters_share_one_optimizer():
    ours, ref = Adapted(), Adapted()
    opt = ckpt.torch.StagedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    base = ours.base.weight.detach().clone()
    for s in range(4):
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            g = torch.Generator().manual_seed(s)
            model(torch.randn(4, 12, generator=g).to(DEVICE)).pow(2).sum().backward()
            o.step()
    assert torch.equal(ours.base.weight, base) and ours.base.weight.dtype == torch.bfloat16
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert a.dtype == b.dtype and relative(a, b) <= 2e-6, name


def test_parameters_of_three_dtypes_step_each_in_its_own_dtype():
    torch.manual_seed(4)
    values = [torch.randn(40).to(DEVICE), torch.randn(7, 3).to(DEVICE), torch.randn(50).to(DEVICE)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    ours = [torch.nn.Parameter(v.to(d)) for v, d in zip(values, dtypes)]
    # torch AdamW on FP32 copies of the same values is what the FP32 masters follow.
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = ckpt.torch.StagedAdamW(ours, lr=1e-2)
    ropt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    for s in range(3):
        g = torch.Generator().manual_seed(10 + s)
        for p, r in zip(ours, ref):
            grad = torch.randn(p.shape, generator=g).to(DEVICE)
            p.grad = grad.to(p.dtype)
            r.grad = p.grad.float()
        opt.step()
        ropt.step()
    for p, r in zip(ours, ref):
        assert p.dtype in dtypes
        assert relative(opt.master(p), r.cpu()) <= 2e-6
        assert torch.equal(p.detach().cpu(), opt.master(p).to(p.dtype))
    # And state dicts carry them both ways.
    again = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    other = ckpt.torch.StagedAdamW(again, lr=1e-2)
    other.load_state_dict(round_trip(opt.state_dict()))
    for p, q in zip(ours, again):
        assert torch.equal(other.master(q), opt.master(p))


def test_a_parameter_resized_through_data_is_refused_before_it_is_read(tmp_path):
    (ours, opt), _ = both()
    train(ours, opt, 1)
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    ours.fc1.bias.data = torch.zeros(3, device=DEVICE)  # 24 elements before.
    for read in (opt.state_dict, lambda: ck.save(2), lambda: opt.master(ours.fc2.bias)):
        with pytest.raises(ckpt.CkptError, match="fc1.bias|changed"):
            read()
    assert ck.latest is None
    # Reshaped with its size kept (torch's AdamW fails on it too): a checkpoint would record
    # the old shape, state_dict() the new one.
    ours.fc1.bias.data = torch.zeros(24, device=DEVICE)
    ours.fc2.weight.data = ours.fc2.weight.data.reshape(24, 5)
    for read in (opt.state_dict, lambda: ck.save(2), opt.step):
        # fc2.weight: param.1 (the second of the first group).
        with pytest.raises(ckpt.CkptError, match=r"param.1 changed: .* shape \[24, 5\] "
                                                 r"\(built with .* shape \[5, 24\]\)"):
            read()
    assert ck.latest is None
    ck.close()


def test_add_param_group_at_any_time_starts_the_new_parameters_fresh():
    from test_handles import wrap_as_lightning_does
    a, b = pair()
    out = []
    for kind, model in (("ckpt", a), ("torch", b)):
        first = [model.fc1.weight, model.fc1.bias]
        if kind == "ckpt":
            opt = ckpt.torch.StagedAdamW(first, lr=3e-3)
        else:
            opt = torch.optim.AdamW(first, lr=3e-3, foreach=False)
        wrapper = wrap_as_lightning_does(opt) if kind == "ckpt" else opt
        train(model, wrapper, 2)
        # A new group with its own hyper-parameters, then one with the defaults.
        opt.add_param_group({"params": list(model.fc2.parameters()), "lr": 1e-3,
                             "weight_decay": 0.0})
        train(model, wrapper, 1, first=2)
        opt.add_param_group({"params": list(model.norm.parameters())})
        train(model, wrapper, 3, first=3)
        out.append(opt)
    assert_close(a, b)
    mine, theirs = out[0].state_dict(), out[1].state_dict()
    assert [float(e["step"]) for e in mine["state"].values()] == \
        [float(e["step"]) for e in theirs["state"].values()] == [6.0, 6.0, 4.0, 4.0, 3.0, 3.0]
    assert [g["lr"] for g in mine["param_groups"]] == [g["lr"] for g in theirs["param_groups"]]


def test_add_param_group_refusals_change_nothing():
    (ours, opt), _ = both()
    train(ours, opt, 1)
    groups = len(opt.param_groups)
    with pytest.raises(ValueError):  # torch's own rule: a parameter in two groups.
        opt.add_param_group({"params": [ours.fc1.weight]})
    with pytest.raises(TypeError):
        opt.add_param_group({"params": [torch.zeros(3, dtype=torch.int32, device=DEVICE)]})
    with pytest.raises(ValueError, match="eps"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=DEVICE))],
                             "eps": -1.0})
    assert len(opt.param_groups) == groups
    train(ours, opt, 1, first=1)  # Still steps.


class Split(torch.nn.Module):
    """Two layers on two devices: `big` (most of the elements) and `small`."""

    def __init__(self, big, small):
        super().__init__()
        torch.manual_seed(6)
        self.big = torch.nn.Linear(12, 24).to(big)
        self.small = torch.nn.Linear(24, 5).to(small)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.big(x.to(self.big.weight.device)))
        return self.small(h.to(self.small.weight.device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="two devices need a GPU")
@pytest.mark.parametrize("engine", ["cuda", "cpu"])
def test_parameters_on_two_devices_share_one_optimizer(engine):
    other = "cpu" if engine == "cuda" else "cuda"
    ours, ref = Split(engine, other), Split(engine, other)
    opt = ckpt.torch.StagedAdamW(ours.named_parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    assert opt._device.type == engine  # The engine runs where most elements are.
    storages = [p.data_ptr() for p in ours.parameters()]
    for s in range(4):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(6, 12, generator=g)
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            model(x).pow(2).mean().backward()
            o.step()
    assert [p.data_ptr() for p in ours.parameters()] == storages
    assert ours.small.weight.device.type == other
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert relative(a, b) <= 2e-6, name
    # A load writes the parameters on both devices.
    state = round_trip(opt.state_dict())
    with torch.no_grad():
        for p in ours.parameters():
            p.zero_()
    opt.load_state_dict(state)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert relative(a, b) <= 2e-6, name


class WithEmpty(torch.nn.Module):
    """Net after a parameter of no elements (a pruned head, a LoRA of rank 0): torch's AdamW
    steps it (its state is a step count and two empty moments)."""

    def __init__(self, net):
        super().__init__()
        self.empty = torch.nn.Parameter(torch.empty(0, 24, device=DEVICE))
        self.net = net

    def forward(self, x):
        return self.net(x) + self.empty.sum()


@pytest.mark.parametrize("overlap", [False, True])
def test_parameters_of_no_elements_are_stepped_as_torch_steps_them(tmp_path, overlap):
    if overlap and not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        pytest.skip(f"overlap=True needs torch >= 2.1; this is {torch.__version__}")
    a, b = (WithEmpty(m) for m in pair())
    opt = ckpt.torch.StagedAdamW(a.parameters(), lr=3e-3, weight_decay=0.1, overlap=overlap)
    ropt = torch.optim.AdamW(b.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    for s, drop in enumerate([(), (), ("empty",), ()]):
        for model, o in ((a, opt), (b, ropt)):
            step_with(model, o, s, drop)
    assert_close(a, b)
    mine, theirs = opt.state_dict(), ropt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for i, t in theirs["state"].items():
        assert float(mine["state"][i]["step"]) == float(t["step"]), i
        for key in ("exp_avg", "exp_avg_sq"):
            assert mine["state"][i][key].shape == t[key].shape, (i, key)
    assert float(mine["state"][0]["step"]) == 3.0  # "empty": a step without its gradient.
    assert opt.exp_avg(a.empty).shape == (0, 24) and opt.master(a.empty).shape == (0, 24)
    # State dicts both ways, and a checkpoint written and resumed.
    a2, b2 = copy.deepcopy(b), copy.deepcopy(a)
    from_torch = ckpt.torch.StagedAdamW(a2.parameters(), lr=3e-3, weight_decay=0.1)
    from_torch.load_state_dict(round_trip(theirs))
    to_torch = torch.optim.AdamW(b2.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    to_torch.load_state_dict(round_trip(mine))
    assert from_torch.param_steps() == opt.param_steps() == [3, 4, 4, 4, 4, 4, 4]
    ck = ckpt.Checkpointer(tmp_path / "root", opt)
    ck.save(4)
    for model, o in ((a, opt), (b, ropt), (a2, from_torch), (b2, to_torch)):
        step_with(model, o, 4)
    assert_close(a2, b)
    assert_close(b2, b)
    ck.load(4)
    ck.close()
    assert opt.param_steps() == [3, 4, 4, 4, 4, 4, 4]
    step_with(a, opt, 4)
    assert_close(a, b)
