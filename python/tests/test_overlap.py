"""StagedAdamW(overlap=True): each parameter's update starts from its post-accumulate-grad hook
during backward; every result must be bit for bit the plain step's (docs/design/overlap.md).
CPU engine here; CKPT_TEST_DEVICE=cuda runs the same on the GPU host's CUDA engine, and with
CKPT_TEST_ENGINE=cpu too on CUDA parameters stepped by the CPU engine (through the host mirror:
gradients copied out during backward, weights copied back after the step)."""
import os

import pytest
import torch

import ckpt
import ckpt.torch

DEVICE = torch.device(os.environ.get("CKPT_TEST_DEVICE", "cpu"))
ENGINE = os.environ.get("CKPT_TEST_ENGINE", "auto")
# CUDA parameters on the CPU engine: the weights change when the step copies them back, not
# during backward; overlap="forward" gates those copies (each module's forward waits for its
# own), whether or not the speculation held.
MIRROR = DEVICE.type == "cuda" and ENGINE == "cpu"
GATES = DEVICE.type == "cuda"
CUDA_ENGINE = GATES and not MIRROR
HOOKS = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
needs_hooks = pytest.mark.skipif(not HOOKS, reason="post-accumulate-grad hooks: torch >= 2.1")


def model(seed, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 40),
                            torch.nn.GELU(), torch.nn.Linear(40, 40), torch.nn.GELU(),
                            torch.nn.Linear(40, 50))
    return m.to(device=DEVICE, dtype=dtype)


def pair(dtype=torch.bfloat16, overlap=True, **kw):
    """Two models alike, a plain and an overlapped optimizer (small units: many per layer)."""
    a, b = model(0, dtype), model(0, dtype)
    kw.setdefault("unit_bytes", 1024)
    kw.setdefault("engine", ENGINE)
    plain = ckpt.torch.StagedAdamW(a.named_parameters(), lr=1e-2, weight_decay=0.1, **kw)
    over = ckpt.torch.StagedAdamW(b.named_parameters(), lr=1e-2, weight_decay=0.1,
                                  overlap=overlap, **kw)
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
    ob.wait_for_step()  # Read outside a forward: after a gated step's writes.
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
    assert changed != MIRROR  # Speculation wrote the weights during backward (or the mirror).
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
    assert any(not torch.equal(before[n], p) for n, p in b[0].named_parameters()) != MIRROR
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


class Switch(torch.nn.Module):
    """The test model, whose middle Linear the forward may skip."""

    def __init__(self, seed):
        super().__init__()
        self.net = model(seed)
        self.skip = False

    def forward(self, x):
        h = self.net[0](x)
        for i, layer in enumerate(self.net[1:], start=1):
            if not (self.skip and i == 3):
                h = layer(h)
        return h


@needs_hooks
@pytest.mark.parametrize("moments", ["f32", "bf16"])
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_gated_steps_equal_plain_steps_through_the_next_forward(moments, max_norm):
    """overlap="forward": the next forward's modules each wait for their own parameters (on
    CUDA; on the CPU the step has written them when it returns). The losses, the weights and
    the state stay the plain step's, bit for bit, including when a forward skips a layer whose
    step then stays gated until the next backward's first hook (or zero_grad in place).
    Clipping at 0.05 fires every step: the first step's speculation is redone, and the next
    ones, which no longer speculate, run as plain steps whose writes stay gated all the same."""
    models = [Switch(0), Switch(0)]
    opts = [ckpt.torch.StagedAdamW(m.named_parameters(), lr=1e-2, weight_decay=0.1,
                                   moments=moments, unit_bytes=1024, overlap=o,
                                   engine=ENGINE)
            for m, o in zip(models, (False, "forward"))]
    gated = opts[1]
    for step in range(6):
        losses = []
        for m, opt in zip(models, opts):
            m.skip = step % 3 == 2
            opt.zero_grad(set_to_none=step != 4)
            x, y = batch(step)
            loss = torch.nn.functional.cross_entropy(m(x).float(), y)
            losses.append(loss.detach())
            loss.backward()
            if opt is gated and not CUDA_ENGINE:
                opt._drain_overlap()  # The feeder thread: speculated before step() for sure.
            if max_norm is not None:
                opt.clip_grad_norm(max_norm)
            opt.step()
        assert torch.equal(losses[0], losses[1]), step
        if max_norm is None:
            speculated, held = gated.last_overlap
            assert speculated > 0 and held, step
        elif step == 0:
            assert gated.last_overlap[1] is False, "clipping fired: redone"
            # ckpt opens no gate for a redone step; the mirror's copies back are gated.
            assert bool(gated._ov.gated) == MIRROR
            continue
        else:
            assert gated.last_overlap is None, "plain: nothing speculated"
        if GATES:
            assert gated._ov.gated, "open until the next forward"
        else:
            assert not gated._ov.gated
    models[1](batch(9)[0])  # A forward of every layer waits for all of them.
    assert not gated._ov.gated
    # Nothing left to await: the global forward pre-hook is gone (other models run unhooked).
    assert gated._ov.gate_hook is None
    same_bits((models[0], opts[0]), (models[1], opts[1]))


class SideStream(torch.nn.Module):
    """The test model with its first Linear run on a stream of its own: autograd makes that
    layer's gradients on that stream, not on the stream the overlapped step began on."""

    def __init__(self, seed):
        super().__init__()
        self.net = model(seed)
        self.side = torch.cuda.Stream(DEVICE)

    def forward(self, x):
        h = self.net[0](x)
        self.side.wait_stream(torch.cuda.current_stream(DEVICE))
        with torch.cuda.stream(self.side):
            h = self.net[1](h)
        torch.cuda.current_stream(DEVICE).wait_stream(self.side)
        for layer in self.net[2:]:
            h = layer(h)
        return h


@needs_hooks
@pytest.mark.skipif(DEVICE.type != "cuda", reason="streams are CUDA's")
@pytest.mark.parametrize("overlap", [True, "forward"])
def test_gradients_made_on_another_stream_are_waited_for(overlap):
    """A gradient hook that runs on another stream than the one the step began on orders that
    stream first: the overlapped step still equals the plain one bit for bit."""
    models = [SideStream(0), SideStream(0)]
    opts = [ckpt.torch.StagedAdamW(m.named_parameters(), lr=1e-2, weight_decay=0.1,
                                   unit_bytes=1024, overlap=o, engine=ENGINE)
            for m, o in zip(models, (False, overlap))]
    for step in range(4):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            x, y = batch(step)
            torch.nn.functional.cross_entropy(m(x).float(), y).backward()
            opt.step()
        speculated, held = opts[1].last_overlap
        assert speculated > 0 and held, step
    same_bits((models[0], opts[0]), (models[1], opts[1]))


def test_overlap_takes_true_false_or_forward():
    m = model(0)
    with pytest.raises(ValueError, match="overlap must be"):
        ckpt.torch.StagedAdamW(m.parameters(), overlap="backward")


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 32)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = torch.nn.Linear(32, 50)

    def forward(self, x):
        h = self.embed(x).unsqueeze(0)
        return self.head(self.attn(h, h, h, need_weights=False)[0][0])


@needs_hooks
@pytest.mark.skipif(not GATES, reason="a gate opens on CUDA parameters only")
def test_a_module_reading_its_childrens_weights_waits_for_its_subtree():
    """MultiheadAttention reads out_proj's weights without calling out_proj: its pre-hook waits
    for its whole subtree, so out_proj is not left gated after the forward."""
    models = [Attention().to(DEVICE), Attention().to(DEVICE)]
    opts = [ckpt.torch.StagedAdamW(m.named_parameters(), lr=1e-2, unit_bytes=1024, overlap=o)
            for m, o in zip(models, (False, "forward"))]
    gated = opts[1]
    out_proj = {id(p) for p in models[1].attn.out_proj.parameters()}
    for step in range(3):
        outs = []
        for m, opt in zip(models, opts):
            opt.zero_grad()
            x, y = batch(step)
            out = m(x)
            outs.append(out.detach())
            if opt is gated and step > 0:  # The forward awaited attn's subtree, out_proj too.
                left = {id(p) for i, p in enumerate(gated._params) if i in gated._ov.gated}
                assert not left & out_proj
            torch.nn.functional.cross_entropy(out.float(), y).backward()
            opt.step()
        assert torch.equal(outs[0], outs[1]), step
        assert gated._ov.gated
    same_bits((models[0], opts[0]), (models[1], opts[1]))
