"""A training step (forward, backward, optimizer step) of a BF16 Llama on one GPU: torch's fused
AdamW on FP32 master weights (the peer: every byte of optimizer state on the GPU) against
ckpt.torch.StagedAdamW on the CUDA engine, plain (the step after backward), overlapped (each
parameter's update streamed from its post-accumulate-grad hook while backward goes on) and
overlap="forward" (the tail left when backward ends runs behind the next forward, each module
waiting for its own parameters), with F32 and BF16 moments, with and without gradient clipping at 1.0. Prints each run's step time and
peak GPU memory, and both against the torch row of the same clipping (the goals of #24:
overlapped <= 1.10x the time with F32 moments, <= 1.05x with BF16, at <= 0.65x the memory), and
the time against its bound measured in the same run: the larger of forward + backward alone and
the state's bytes over PCIe (12 B/param each way with F32 moments, 8 with BF16) at the rate
pinned copies reach with both directions busy.

The model is transformers' LlamaForCausalLM when transformers imports (hidden 1024, 24 layers,
16 heads, MLP 2560, vocab 32000: 355M parameters), else a plain torch decoder of the same shape.
ckpt's device buffers live outside torch's caching allocator: they are measured from the
driver's free memory around the optimizer's construction, less what torch's allocator reserved
meanwhile, and added to torch's peak. With --phases, each ckpt row also prints the host time its
post-accumulate-grad hooks took on backward's thread.

    CKPT_LIB=build/capi/libckpt_c.so PYTHONPATH=python python3 bench/train_step.py \\
        [--layers 24] [--hidden 1024] [--batch 8] [--seq 512] [--steps 20] [--max-norm 1.0]
        [--clipping both|off|on] [--only ckpt-f32-overlap] [--phases] [--repeat 1]
        [--unit-mib 8]
"""
import argparse
import gc
import time

import torch

import ckpt.torch


def llama(args):
    torch.manual_seed(0)
    try:
        import transformers
        config = transformers.LlamaConfig(
            hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
            num_key_value_heads=16, intermediate_size=args.mlp, vocab_size=args.vocab,
            max_position_embeddings=args.seq, tie_word_embeddings=False)
        net = transformers.LlamaForCausalLM(config)
        kind = "transformers LlamaForCausalLM"
    except ImportError:
        net, kind = Decoder(args), "torch decoder (transformers absent)"
    return net.to(device="cuda", dtype=torch.bfloat16), kind


class Block(torch.nn.Module):
    def __init__(self, h, mlp):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
        self.qkv, self.o = torch.nn.Linear(h, 3 * h, bias=False), torch.nn.Linear(h, h, bias=False)
        self.gate_up = torch.nn.Linear(h, 2 * mlp, bias=False)
        self.down = torch.nn.Linear(mlp, h, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 16, h // 16).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
        g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(g) * u)


class Decoder(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = torch.nn.Embedding(args.vocab, args.hidden)
        self.layers = torch.nn.ModuleList(Block(args.hidden, args.mlp) for _ in range(args.layers))
        self.norm = torch.nn.RMSNorm(args.hidden)
        self.head = torch.nn.Linear(args.hidden, args.vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss})()


class TorchMasters:
    """torch.optim.AdamW(fused=True) on FP32 masters of the BF16 model: the gradients are
    widened into the masters' .grad, the masters stepped, then rounded into the model."""

    def __init__(self, net, clip):
        self.params = list(net.parameters())
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-4, weight_decay=0.1, fused=True)
        self.clip = clip

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.masters, self.clip)
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)
        for m in self.masters:
            m.grad = None


class NoStep:
    """Forward and backward only: the compute an optimizer step can hide behind."""

    def __init__(self, net):
        self.params = list(net.parameters())

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        pass


class Ckpt:
    def __init__(self, net, clip, moments, overlap, unit_bytes=0):
        self.opt = ckpt.torch.StagedAdamW(net.named_parameters(), lr=1e-4, weight_decay=0.1,
                                          moments=moments, overlap=overlap,
                                          unit_bytes=unit_bytes)
        self.clip = clip
        self.held = 0
        self.hook_s, self.hook_calls = 0.0, 0  # Host time in the gradient hooks, and calls.
        release = self.opt._release

        self.left_gated = 0  # Parameters no forward awaited, found by the next backward.

        def timed(index, p):
            self.left_gated += len(self.opt._ov.gated)
            start = time.perf_counter()
            release(index, p)
            self.hook_s += time.perf_counter() - start
            self.hook_calls += 1

        self.opt._release = timed  # What _gradient_ready calls, on backward's thread.

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def step(self):
        if self.clip:
            self.opt.clip_grad_norm(self.clip)
        self.opt.step()
        last = self.opt.last_overlap
        self.held += bool(last and last[1])


def pcie_rates(nbytes=1 << 30):
    """Host-to-device and device-to-host GB/s of pinned memory, both directions at once (as the
    streamed step moves its state)."""
    host_in = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host_out = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    best = (0.0, 0.0)
    for _ in range(3):
        torch.cuda.synchronize()
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        with torch.cuda.stream(s1):
            e[0].record()
            dev_in.copy_(host_in, non_blocking=True)
            e[1].record()
        with torch.cuda.stream(s2):
            e[2].record()
            host_out.copy_(dev_out, non_blocking=True)
            e[3].record()
        torch.cuda.synchronize()
        rate = (nbytes / e[0].elapsed_time(e[1]) / 1e6, nbytes / e[2].elapsed_time(e[3]) / 1e6)
        best = max(best, rate, key=min)
    return best


def run(name, args, clip):
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    net, kind = llama(args)
    free_before, _ = torch.cuda.mem_get_info()
    reserved_before = torch.cuda.memory_reserved()
    if name == "torch-fused":
        opt = TorchMasters(net, clip)
    elif name == "no-step":
        opt = NoStep(net)
    else:
        _, moments, mode = name.split("-")
        overlap = {"plain": False, "overlap": True, "forward": "forward"}[mode]
        opt = Ckpt(net, clip, moments, overlap, args.unit_mib << 20)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    outside = 0 if name in ("torch-fused", "no-step") else max(
        0, (free_before - free_after) - (torch.cuda.memory_reserved() - reserved_before))
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)

    marks = []  # Per timed step: events before forward, after forward, after backward, after.
    host = [0.0, 0.0, 0.0]  # Host seconds in forward, backward and step() calls.

    def step(timed):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if timed else None
        opt.zero_grad()
        t = [time.perf_counter()]
        if e:
            e[0].record()
        loss = net(input_ids=ids, labels=ids).loss
        t.append(time.perf_counter())
        if e:
            e[1].record()
        loss.backward()
        t.append(time.perf_counter())
        if e:
            e[2].record()
        opt.step()
        t.append(time.perf_counter())
        if e:
            e[3].record()
            marks.append(e)
            for i in range(3):
                host[i] += t[i + 1] - t[i]

    for _ in range(args.warmup):
        step(False)
    torch.cuda.synchronize()
    if isinstance(opt, Ckpt):
        opt.hook_s, opt.hook_calls, opt.left_gated = 0.0, 0, 0
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(args.phases)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / args.steps
    if marks:
        phase = [sum(e[i].elapsed_time(e[i + 1]) for e in marks) / len(marks) for i in range(3)]
        extra = ""
        if isinstance(opt, Ckpt):
            extra = (f"; hooks {opt.hook_s * 1e3 / args.steps:.1f} ms of host time in "
                     f"{opt.hook_calls // args.steps} calls; ckpt's device buffers "
                     f"{outside / 2 ** 20:.0f} MiB")
            if opt.left_gated:
                extra += f"; {opt.left_gated / args.steps:.1f} parameters left gated per step"
        print(f"#   {name}: forward {phase[0]:.1f} ms, backward {phase[1]:.1f} ms, step "
              f"{phase[2]:.1f} ms (GPU time between the stream's marks; host time in the calls "
              f"{host[0] * 1e3 / args.steps:.1f}, {host[1] * 1e3 / args.steps:.1f}, "
              f"{host[2] * 1e3 / args.steps:.1f}){extra}")
    peak = torch.cuda.max_memory_allocated() + outside
    held = getattr(opt, "held", None)
    if isinstance(opt, Ckpt):
        opt.opt.close()
    del opt, net, ids
    params = args.params
    return ms, peak, kind, params, held


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=2560)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--phases", action="store_true",
                    help="also print each run's forward, backward and step time")
    ap.add_argument("--max-norm", type=float, default=1.0,
                    help="the clipped runs' max_norm (clip_grad_norm_ / clip_grad_norm)")
    ap.add_argument("--unit-mib", type=int, default=0,
                    help="ckpt's unit size in MiB of masters (0: its default, 8)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every row this many times, taking turns; report each row's best")
    ap.add_argument("--clipping", choices=("both", "off", "on"), default="both",
                    help="run the rows without clipping, with it, or both (default)")
    ap.add_argument("--only", action="append", default=None,
                    help="run only these rows (torch-fused, ckpt-f32-plain, ckpt-f32-overlap, "
                         "ckpt-f32-forward, ckpt-bf16-plain, ckpt-bf16-overlap, "
                         "ckpt-bf16-forward); torch-fused always runs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/train_step.py needs a CUDA device")
    net, _ = llama(args)
    args.params = sum(p.numel() for p in net.parameters())
    del net
    rows = ["torch-fused", "ckpt-f32-plain", "ckpt-f32-overlap", "ckpt-f32-forward",
            "ckpt-bf16-plain", "ckpt-bf16-overlap", "ckpt-bf16-forward"]
    if args.only:
        rows = ["torch-fused"] + [r for r in rows[1:] if r in args.only]
    print(f"# {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq}, "
          f"{args.steps} timed steps after {args.warmup}; each row the best of {args.repeat} "
          f"run(s), the rows taking turns")
    h2d, d2h = pcie_rates()
    clips = {"both": (0.0, args.max_norm), "off": (0.0,), "on": (args.max_norm,)}[args.clipping]
    best = {}  # (name, clip) -> the run with the least step time.
    for r in range(args.repeat):
        for clip in clips:
            for name in (["no-step"] if clip == clips[0] else []) + rows:
                result = run(name, args, 0.0 if name == "no-step" else clip)
                if (name, clip) not in best or result[0] < best[(name, clip)][0]:
                    best[(name, clip)] = result
                if args.repeat > 1:
                    print(f"#   round {r + 1}, clipping {clip:g}: {name} {result[0]:.1f} ms",
                          flush=True)
    compute_ms = best[("no-step", clips[0])][0]
    print(f"# forward + backward alone: {compute_ms:.1f} ms; PCIe with both directions busy: "
          f"{h2d:.1f} GB/s in, {d2h:.1f} GB/s out")
    # The streamed step moves the masters and both moments in and out: 12 B/param each way with
    # F32 moments, 8 with BF16. No schedule beats the larger of that and the compute.
    bounds = {}
    for moments, per_param in (("f32", 12), ("bf16", 8)):
        pcie_ms = args.params * per_param / min(h2d, d2h) / 1e6
        bounds[moments] = max(compute_ms, pcie_ms)
        print(f"# bound, {moments} moments: max(compute {compute_ms:.1f}, state over PCIe "
              f"{pcie_ms:.1f}) = {bounds[moments]:.1f} ms")
    for clip in clips:
        base = best[(rows[0], clip)]
        print(f"# model: {base[2]}, {base[3] / 1e6:.0f}M parameters; clipping "
              f"{f'at {clip:g}' if clip else 'off'}")
        print(f"{'optimizer':20} {'step ms':>9} {'x torch':>8} {'x bound':>8} "
              f"{'peak GiB':>9} {'x torch':>8}  speculation held")
        for name in rows:
            ms, peak, _, _, held = best[(name, clip)]
            bound = "" if name == "torch-fused" else f"{ms / bounds[name.split('-')[1]]:8.2f}"
            note = "" if held is None or "plain" in name else \
                f"  {held}/{args.steps + args.warmup}"
            print(f"{name:20} {ms:9.1f} {ms / base[0]:8.2f} {bound:>8} {peak / 2 ** 30:9.2f} "
                  f"{peak / base[1]:8.2f}{note}", flush=True)

if __name__ == "__main__":
    main()
