"""ckpt.torch.StagedAdafactor against torch.optim.Adafactor (docs/design/adafactor.md): every
step within 1e-5 of torch's on FP32 parameters (matrices, 3-D tensors, vectors, scalars; weight
decay, maximize, eps1, clipping, per-group hyper-parameters, a parameter without a gradient, a
scheduler's lr), state dicts both ways, a checkpoint that resumes bit for bit with its
hyper-parameters, and torch's refusals. Parity needs torch >= 2.5 (torch.optim.Adafactor); the
rest runs on every torch.
"""
import pytest
import torch

import ckpt
import ckpt.torch

HAS_ADAFACTOR = hasattr(torch.optim, "Adafactor")
needs_torch_adafactor = pytest.mark.skipif(not HAS_ADAFACTOR,
                                           reason="torch.optim.Adafactor: torch >= 2.5")
SHAPES = [(6, 10), (2, 3, 5), (7,), ()]
TOLERANCE = 1e-5  # Relative, per element, after each step (docs/design/adafactor.md).


def make_params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_(True) for s in SHAPES]


def grads(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def run_both(torch_opt, ours, a, b, first, count, skip=None, after=None):
    for s in range(first, first + count):
        for i, (x, y, g) in enumerate(zip(a, b, grads(s))):
            x.grad = None if i == skip else g.clone()
            y.grad = None if i == skip else g.clone()
        torch_opt.step()
        ours.step()
        if after is not None:
            after(s)
        for i, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(y, x, rtol=TOLERANCE, atol=TOLERANCE,
                                       msg=lambda m: f"step {s}, parameter {i}: {m}")


@needs_torch_adafactor
@pytest.mark.parametrize("options", [
    {},
    {"lr": 0.5, "weight_decay": 0.1, "maximize": True, "eps": (1e-4, 1e-2), "d": 1.0,
     "beta2_decay": -0.5},
])
def test_steps_match_torch_optim_adafactor(options):
    a, b = make_params(0), make_params(0)
    run_both(torch.optim.Adafactor(a, **options), ckpt.torch.StagedAdafactor(b, **options),
             a, b, 0, 6)


@needs_torch_adafactor
def test_groups_a_parameter_without_gradient_and_a_scheduler_match_torch():
    a, b = make_params(1), make_params(1)

    def groups(p):
        return [{"params": p[:2], "lr": 0.02, "d": 2.0}, {"params": p[2:], "beta2_decay": -0.6}]
    ta = torch.optim.Adafactor(groups(a), lr=0.01)
    tb = ckpt.torch.StagedAdafactor(groups(b), lr=0.01)
    sa = torch.optim.lr_scheduler.StepLR(ta, step_size=2, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(tb, step_size=2, gamma=0.5)
    run_both(ta, tb, a, b, 0, 5, skip=2, after=lambda s: (sa.step(), sb.step()))
    assert ta.state[a[0]]["step"] == tb.state[b[0]]["step"] == 5
    assert b[2] not in tb.state  # Never stepped: no state, as torch.


@needs_torch_adafactor
def test_an_added_param_group_starts_fresh_and_steps_as_torchs():
    a, b = make_params(6), make_params(6)
    ta = torch.optim.Adafactor(a[:2], lr=0.01)
    tb = ckpt.torch.StagedAdafactor(b[:2], lr=0.01)
    for s in range(2):
        for x, y, g in zip(a[:2], b[:2], grads(s)):
            x.grad, y.grad = g.clone(), g.clone()
        ta.step()
        tb.step()
    ta.add_param_group({"params": a[2:], "beta2_decay": -0.6, "eps": (1e-5, 1e-2)})
    tb.add_param_group({"params": b[2:], "beta2_decay": -0.6, "eps": (1e-5, 1e-2)})
    assert tb.param_groups[1]["d"] == 1.0  # The defaults fill what the group leaves out.
    run_both(ta, tb, a, b, 2, 3)


@needs_torch_adafactor
def test_state_dicts_go_both_ways_with_torch_optim_adafactor():
    a, b = make_params(2), make_params(2)
    ta = torch.optim.Adafactor(a, weight_decay=0.01)
    tb = ckpt.torch.StagedAdafactor(b, weight_decay=0.01)
    run_both(ta, tb, a, b, 0, 3)
    ours = tb.state_dict()
    assert set(ours["state"][0]) == {"step", "row_var", "col_var", "master"}
    assert set(ours["state"][2]) == {"step", "variance", "master"}
    assert ours["state"][0]["row_var"].shape == (6, 1)
    assert ours["state"][1]["col_var"].shape == (2, 1, 5)
    # torch's state into ckpt's, and ckpt's into torch's: both go on as one.
    c, d = [p.detach().clone().requires_grad_(True) for p in a], make_params(9)
    tc = torch.optim.Adafactor(c, weight_decay=0.01)
    tc.load_state_dict({"state": {i: {k: v for k, v in e.items() if k != "master"}
                                  for i, e in ours["state"].items()},
                        "param_groups": ours["param_groups"]})
    td = ckpt.torch.StagedAdafactor(d, weight_decay=0.5)
    td.load_state_dict(ta.state_dict())
    with torch.no_grad():
        for x, y in zip(d, a):
            x.copy_(y)  # The masters come from the parameters when a dict has none.
    td.load_state_dict(ta.state_dict())
    assert td.param_groups[0]["weight_decay"] == 0.01
    run_both(tc, td, c, d, 3, 3)


def test_a_checkpoint_resumes_bit_for_bit_with_its_hyper_parameters(tmp_path):
    a, b = make_params(3), make_params(4)
    opt_a = ckpt.torch.StagedAdafactor(a, lr=0.02, beta2_decay=-0.7, eps=(1e-20, 1e-3),
                                       threads=2)
    opt_b = ckpt.torch.StagedAdafactor(b, lr=0.5, d=3.0, threads=2)
    ck_a = ckpt.Checkpointer(str(tmp_path / "run"), opt_a)

    def steps(opt, params, first, count):
        for s in range(first, first + count):
            for p, g in zip(params, grads(s)):
                p.grad = g
            opt.step()
    steps(opt_a, a, 0, 2)
    ck_a.save(2)
    pending = ck_a.save_async(3)  # The same state, written while the steps go on.
    steps(opt_a, a, 2, 2)
    pending.finalize()
    ck_a.close()
    ck_b = ckpt.Checkpointer(str(tmp_path / "run"), opt_b)
    ck_b.load(3)
    assert opt_b.param_groups[0]["lr"] == 0.02
    assert opt_b.param_groups[0]["beta2_decay"] == -0.7
    assert opt_b.param_groups[0]["eps"] == (1e-20, 1e-3)
    assert opt_b.param_groups[0]["d"] == 1.0
    steps(opt_b, b, 2, 2)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    for p, q in zip(a, b):
        for key, value in opt_a.factors(p).items():
            assert torch.equal(value, opt_b.factors(q)[key]), key
    ck_b.close()


def test_a_local_state_dict_round_trip_keeps_the_factors():
    a, b = make_params(7), make_params(8)
    opt_a = ckpt.torch.StagedAdafactor(a)
    opt_b = ckpt.torch.StagedAdafactor(b, lr=0.3)
    for s in range(3):
        for p, g in zip(a, grads(s)):
            p.grad = g
        opt_a.step()
    shard = opt_a.local_state_dict()
    assert shard["state"][0]["row_var"].shape == (6,)  # 1-D, as a shard's tensors are.
    opt_b.load_state_dict(shard)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, value in opt_a.factors(p).items():
            assert torch.equal(value, opt_b.factors(q)[key]), key
    del shard["state"][1]["col_var"]
    with pytest.raises(ValueError, match="has no col_var"):
        opt_b.load_state_dict(shard)
    for s in range(3, 5):
        for p, q, g in zip(a, b, grads(s)):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_refusals_name_what_is_wrong():
    p = make_params(5)
    for kwargs, what in [({"d": 0.5}, "d"), ({"beta2_decay": 0.1}, "beta2_decay"),
                         ({"eps": (-1.0, 1e-3)}, "epsilon1"), ({"lr": -1.0}, "lr"),
                         ({"weight_decay": float("nan")}, "weight_decay")]:
        with pytest.raises(ValueError, match=what):
            ckpt.torch.StagedAdafactor(p, **kwargs)
    with pytest.raises(NotImplementedError, match="process_group"):
        ckpt.torch.StagedAdafactor(p, process_group=object())
    with pytest.raises(NotImplementedError, match="CUDA engine"):
        ckpt.torch.StagedAdafactor(p, engine="cuda")
    opt = ckpt.torch.StagedAdafactor(p)
    opt.param_groups[0]["d"] = 0.25  # Changed between steps, as a scheduler would.
    for q, g in zip(p, grads(0)):
        q.grad = g
    with pytest.raises(ValueError, match="param group 0: Clipping threshold d"):
        opt.step()
    empty = torch.zeros(0, 4, requires_grad=True)
    with pytest.raises(ckpt.CkptError, match="no elements"):
        ckpt.torch.StagedAdafactor([empty])
