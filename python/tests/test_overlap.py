"""StagedAdamW(overlap=True): each parameter's update starts from its post-accumulate-grad hook
during backward; every result must be bit for bit the plain step's (docs/design/overlap.md).
CPU engine here; CKPT_TEST_DEVICE=cuda runs the same on the GPU host's CUDA engine."""
import os

import pytest
import torch

import ckpt
import ckpt.torch

DEVICE = torch.device(os.environ.get("CKPT_TEST_DEVICE", "cpu"))
HOOKS = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
needs_hooks = pytest.mark.skipif(not HOOKS, reason="post-accumulate-grad hooks: torch >= 2.1")


def model(seed, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 40),
                            torch.nn.GELU(), torch.nn.Linear(40, 40), torch.nn.GELU(),
                            torch.nn.Linear(40, 50))
    return m.to(device=DEVICE, dtype=dtype)


def pair(dtype=torch.bfloat16, **kw):
    """Two models alike, a plain and an overlapped optimizer (small units: many per layer)."""
    a, b = model(0, dtype), model(0, dtype)
    kw.setdefault("unit_bytes", 1024)
    plain = ckpt.torch.StagedAdamW(a.named_parameters(), lr=1e-2, weight_decay=0.1, **kw)
    over = ckpt.torch.StagedAdamW(b.named_parameters(), lr=1e-2, weight_decay=0.1, overlap=True,
                                  **kw)
    return (a, plain), (b, over)


def batch(step, n=16):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 50, (n,), generator=g).to(DEVICE)
    y = torch.randint(0, 50, (n,), generator=g).to(DEVICE)
    return x, y


def backward(m, step, scale=1.0):
    x, y = batch(step)
    loss = torch.nn.functional.cross_entropy(m(x).float(), y) * scale
    loss.backward()


def step_both(a, b, step, run=backward):
    """One training step of the plain pair `a` and the overlapped pair `b`: zero_grad,
    run(model, step) for the gradients, and the step; `b`'s speculation drained first, so that
    every released unit counts as speculated."""
    for m, opt in (a, b):
        opt.zero_grad()
        run(m, step)
        if opt is b[1]:
            opt._drain_overlap()
        opt.step()


def same_bits(a, b):
    (ma, oa), (mb, ob) = a, b
    for (name, pa), (_, pb) in zip(ma.named_parameters(), mb.named_parameters()):
        assert torch.equal(pa, pb), f"{name} differs"
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    for k in sa:
        for key in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][key]), torch.as_tensor(sb[k][key])), \
                f"state {k} {key} differs"


@needs_hooks
@pytest.mark.parametrize("moments", ["f32", "bf16"])
@pytest.mark.parametrize("max_norm", [None, 1e9, 0.05])
def test_overlapped_steps_equal_plain_steps(moments, max_norm):
    a, b = pair(moments=moments)
    for step in range(4):
        for m, opt in (a, b):
            opt.zero_grad()
            backward(m, step)
            if opt is b[1]:
                opt._drain_overlap()  # So that the speculation counted below is complete.
            if max_norm is not None:
                norm = opt.clip_grad_norm(max_norm)
                assert torch.isfinite(norm)
            opt.step()
        # 0.05 always clips: the first step's speculation is redone, and the next steps run
        # plainly (it would not hold).
        if max_norm == 0.05 and step > 0:
            assert b[1].last_overlap is None, step
        else:
            speculated, held = b[1].last_overlap
            assert speculated > 0
            assert held == (max_norm != 0.05), (step, held)
        same_bits(a, b)


@needs_hooks
def test_torchs_in_place_clipping_is_seen_and_the_step_redone():
    a, b = pair()
    for step in range(3):
        for m, opt in (a, b):
            opt.zero_grad()
            backward(m, step)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)  # Multiplies in place, by 1.
            if opt is b[1]:
                opt._drain_overlap()
            opt.step()
        if step == 0:
            assert b[1].last_overlap[1] is False  # Redone: the gradients changed.
        else:
            assert b[1].last_overlap is None  # Then it steps plainly.
        same_bits(a, b)


@needs_hooks
def test_accumulation_releases_only_the_last_micro_batch():
    a, b = pair()
    def micro_batches(m, step):
        opt = a[1] if m is a[0] else b[1]
        with opt.accumulating():
            backward(m, 2 * step, 0.5)
        backward(m, 2 * step + 1, 0.5)

    for step in range(3):
        step_both(a, b, step, micro_batches)
        assert b[1].last_overlap[1] is True
        same_bits(a, b)


@needs_hooks
def test_an_undeclared_second_backward_is_refused_and_the_weights_put_back():
    a, b = pair()
    before = {n: p.detach().clone() for n, p in b[0].named_parameters()}
    backward(b[0], 0, 0.5)
    b[1]._drain_overlap()
    changed = any(not torch.equal(before[n], p) for n, p in b[0].named_parameters())
    assert changed  # Speculation wrote the weights during backward.
    with pytest.raises(ckpt.CkptError, match="released twice"):
        backward(b[0], 1, 0.5)
    for n, p in b[0].named_parameters():
        assert torch.equal(before[n], p), n
    # Nothing was stepped; the optimizer goes on from the state it had.
    step_both(a, b, 2)
    assert b[1].last_overlap[1] is True
    same_bits(a, b)


@needs_hooks
def test_a_skipped_step_is_abandoned_by_zero_grad():
    # As GradScaler skips opt.step() when the gradients overflowed: the weights written during
    # backward go back before the next forward, and the next step is the plain one's.
    a, b = pair()
    before = {n: p.detach().clone() for n, p in b[0].named_parameters()}
    backward(b[0], 0)
    b[1]._drain_overlap()
    assert any(not torch.equal(before[n], p) for n, p in b[0].named_parameters())
    b[1].zero_grad()
    for n, p in b[0].named_parameters():
        assert torch.equal(before[n], p), n
    step_both(a, b, 1)
    assert b[1].last_overlap[1] is True
    same_bits(a, b)


@needs_hooks
def test_a_parameter_without_a_gradient_is_left_alone():
    a, b = pair()
    def skipping_a_layer(m, step):
        x, y = batch(step)
        h = m[0](x)  # The second Linear layer (m[3]) gets no gradient.
        out = m[5](m[2](m[1](h)).narrow(1, 0, 40))
        torch.nn.functional.cross_entropy(out.float(), y).backward()

    for step in range(3):
        step_both(a, b, step, skipping_a_layer)
        assert b[1].last_overlap[1] is True
        same_bits(a, b)
    assert b[1].param_steps()[3:5] == [0, 0]  # 3.weight and 3.bias.


@needs_hooks
def test_a_checkpoint_after_overlapped_steps_is_the_plain_ones(tmp_path):
    a, b = pair()
    for step in range(3):
        step_both(a, b, step)
    ck = ckpt.Checkpointer(tmp_path / "over", b[1])
    ck.save(3)
    ck.close()
    c = model(9)
    opt = ckpt.torch.StagedAdamW(c.named_parameters(), lr=1e-2, weight_decay=0.1,
                                 unit_bytes=1024)
    ck = ckpt.Checkpointer(tmp_path / "over", opt)
    ck.load(3)
    ck.close()
    same_bits(a, (c, opt))


@pytest.mark.skipif(HOOKS, reason="this torch has post-accumulate-grad hooks")
def test_overlap_needs_post_accumulate_grad_hooks():
    with pytest.raises(NotImplementedError, match="torch >= 2.1"):
        ckpt.torch.StagedAdamW(model(0).parameters(), overlap=True)


def test_clip_grad_norm_scales_the_step_as_torchs_clipping_does():
    """Without overlap too: clip_grad_norm's coefficient is applied by the step, the gradients
    are left alone, and the result is torch's clip_grad_norm_ + step within rounding."""
    ma, mb = model(0, torch.float32), model(0, torch.float32)
    oa = ckpt.torch.StagedAdamW(ma.named_parameters(), lr=1e-2, weight_decay=0.1)
    ob = ckpt.torch.StagedAdamW(mb.named_parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for m, opt in ((ma, oa), (mb, ob)):
            opt.zero_grad()
            backward(m, step)
        grads = [p.grad.clone() for p in ma.parameters()]
        ours = oa.clip_grad_norm(0.05)
        theirs = torch.nn.utils.clip_grad_norm_(mb.parameters(), 0.05)
        assert torch.allclose(ours, theirs, rtol=1e-5)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, ma.parameters()))
        oa.step()
        ob.step()
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            assert torch.allclose(pa, pb, rtol=1e-5, atol=1e-6)
