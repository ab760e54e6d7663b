"""A training step (forward, backward, optimizer step) of a BF16 Llama on one GPU: torch's fused
AdamW on FP32 master weights (the peer: every byte of optimizer state on the GPU) against
ckpt.torch.StagedAdamW on the CUDA engine, plain (the step after backward), overlapped (each
parameter's update streamed from its post-accumulate-grad hook while backward goes on) and
overlap="forward" (the tail left when backward ends runs behind the next forward, each module
waiting for its own parameters), with F32 and BF16 moments, and on the CPU engine
(ckpt-cpu-*: gradients to the host, the step on every core, weights back; plain,
overlapped: each gradient copied out as backward finishes it and stepped meanwhile, and
forward: the weights' copies back awaited by each module of the next forward), with and
without gradient clipping at 1.0. Prints each row's step time and peak GPU memory, both against the torch row (the goals
of #24: overlapped <= 1.10x the time with F32 moments, <= 1.05x with BF16, at <= 0.65x the
memory), and the time against two bounds measured in the same run: the larger of forward +
backward alone (no-step) and the state's bytes over PCIe (12 B/param each way with F32
moments, 8 with BF16) at the rate pinned copies reach with both directions busy; and the
measured floor, traffic-f32 / traffic-bf16: forward and backward with those bytes crossing PCIe
alongside from the start of each step, which is what no exact streamed step can beat (on a host
whose train loop is bound by its own calls, the copies' use of host memory slows the loop).

Every row keeps its own model and optimizer resident; after its warm-up each row's peak memory
is measured over a few steps (the other rows idle), then the rows take turns, a few steps each,
for a number of rounds: a row's time is its median round, its ratio to torch the median of its
rounds' ratios (the host's speed drifts by tens of percent within a minute; rows far apart in
time would compare machine states, not optimizers). A round of n steps runs n + 1 and times the
n periods from the end of the first forward to the end of the last (CUDA events): a step's
tail that the next forward hides (overlap="forward") is then counted as a steady loop has it.
The traffic rows copy one 256 MiB pinned buffer each way again and again: on a host whose
caches held that much, the floor would read low.

The model is transformers' LlamaForCausalLM when transformers imports (hidden 1024, 24 layers,
16 heads, MLP 2560, vocab 32000: 355M parameters), else a plain torch decoder of the same shape.
ckpt's device buffers live outside torch's caching allocator: they are measured from the
driver's free memory around the optimizer's construction, less what torch's allocator reserved
meanwhile, and added to torch's peak. With --phases, each row also prints its GPU and host time
per phase, and each ckpt row the host time its post-accumulate-grad hooks took on backward's
thread.

    CKPT_LIB=build/capi/libckpt_c.so PYTHONPATH=python python3 bench/train_step.py \\
        [--layers 24] [--hidden 1024] [--batch 8] [--seq 512] [--rounds 8] [--round-steps 4]
        [--warmup 4] [--max-norm 1.0] [--clipping both|off|on] [--only ckpt-f32-overlap]
        [--phases] [--unit-mib 8] [--cpu-threads 0]
"""
import argparse
import gc
import statistics
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
    def __init__(self, net, clip, moments, overlap, unit_bytes=0, engine="auto", threads=0):
        self.opt = ckpt.torch.StagedAdamW(net.named_parameters(), lr=1e-4, weight_decay=0.1,
                                          moments=moments, overlap=overlap,
                                          unit_bytes=unit_bytes, engine=engine,
                                          threads=threads)
        self.clip = clip
        self.held = 0
        self.early = 0  # Units updated during backward, over the steps counted.
        self.hook_s, self.hook_calls = 0.0, 0  # Host time in the gradient hooks, and calls.
        release = self.opt._release

        self.left_gated = 0  # Parameters no forward awaited, found by the next backward.

        def timed(index, p):
            start = time.perf_counter()
            release(index, p)
            self.hook_s += time.perf_counter() - start
            self.hook_calls += 1

        self.opt._release = timed  # What _gradient_ready calls, on backward's thread.

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def before_backward(self):
        self.left_gated += len(self.opt._ov.gated)

    def step(self):
        if self.clip:
            self.opt.clip_grad_norm(self.clip)
        self.opt.step()
        last = self.opt.last_overlap
        self.held += bool(last and last[1])
        self.early += last[0] if last else 0


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


class Traffic(NoStep):
    """Forward and backward with the state's PCIe traffic alongside: from the start of each step,
    `nbytes` cross PCIe each way on two side streams (from and into one pinned host buffer, in
    256 MiB copies), and the step ends when they have. What no exact streamed step can beat on
    this host: its bytes must cross, and while they do the host's memory serves them too (the
    train loop here is bound by the host's calls, which that slows)."""

    chunk = 256 << 20

    def __init__(self, net, nbytes):
        super().__init__(net)
        self.nbytes = nbytes
        self.host_in = torch.empty(self.chunk, dtype=torch.uint8).pin_memory()
        self.host_out = torch.empty(self.chunk, dtype=torch.uint8).pin_memory()
        self.dev_in = torch.empty(self.chunk, dtype=torch.uint8, device="cuda")
        self.dev_out = torch.empty(self.chunk, dtype=torch.uint8, device="cuda")
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def zero_grad(self):
        super().zero_grad()
        here = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(here)
        for at in range(0, self.nbytes, self.chunk):
            n = min(self.chunk, self.nbytes - at)
            with torch.cuda.stream(self.streams[0]):
                self.dev_in[:n].copy_(self.host_in[:n], non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.host_out[:n].copy_(self.dev_out[:n], non_blocking=True)

    def step(self):
        here = torch.cuda.current_stream()
        for s in self.streams:
            here.wait_stream(s)


class Row:
    """One row of the table: its own model and optimizer, resident while the rows take turns."""

    def __init__(self, name, args, clip):
        self.name = name
        allocated = torch.cuda.memory_allocated()
        free_before, _ = torch.cuda.mem_get_info()
        reserved_before = torch.cuda.memory_reserved()
        self.net, self.kind = llama(args)
        if name == "torch-fused":
            self.opt = TorchMasters(self.net, clip)
        elif name == "no-step":
            self.opt = NoStep(self.net)
        elif name.startswith("traffic-"):
            self.opt = Traffic(self.net, args.params * STATE_BYTES[name.split("-")[1]])
        else:  # ckpt[-cpu]-<moments>-<mode>
            parts = name.split("-")
            overlap = {"plain": False, "overlap": True, "forward": "forward"}[parts[-1]]
            self.opt = Ckpt(self.net, clip, parts[-2], overlap, args.unit_mib << 20,
                            engine="cpu" if parts[1] == "cpu" else "auto",
                            threads=args.cpu_threads)
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        # ckpt's device buffers: outside torch's allocator.
        outside = 0 if not isinstance(self.opt, Ckpt) else max(
            0, (free_before - free_after) - (torch.cuda.memory_reserved() - reserved_before))
        self.outside = outside
        g = torch.Generator(device="cuda").manual_seed(1)
        self.ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda",
                                 generator=g)
        self.rounds = []  # ms per step of each timed round.
        self.marks = []  # With --phases: per step, events before forward, after it, after
        self.host = [0.0, 0.0, 0.0]  # backward, after the step; host seconds in the three calls.
        self.timed_steps = 0
        self.steps_run = 0  # In the rounds: what the hooks' and held counts are over.
        for _ in range(args.warmup):
            self.step(False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(args.round_steps):
            self.step(False)
        torch.cuda.synchronize()
        # The other rows are idle and hold what they held before this one was built.
        self.peak = torch.cuda.max_memory_allocated() - allocated + outside
        if isinstance(self.opt, Ckpt):
            self.opt.hook_s, self.opt.hook_calls, self.opt.left_gated = 0.0, 0, 0
            self.opt.held = self.opt.early = 0

    def step(self, timed, forward_done=None):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if timed else None
        self.opt.zero_grad()
        t = [time.perf_counter()]
        if e:
            e[0].record()
        loss = self.net(input_ids=self.ids, labels=self.ids).loss
        t.append(time.perf_counter())
        if e:
            e[1].record()
        if forward_done is not None:
            forward_done.record()
        if isinstance(self.opt, Ckpt):
            self.opt.before_backward()
        loss.backward()
        t.append(time.perf_counter())
        if e:
            e[2].record()
        self.opt.step()
        t.append(time.perf_counter())
        if e:
            e[3].record()
            self.marks.append(e)
            for i in range(3):
                self.host[i] += t[i + 1] - t[i]

    def round(self, steps, phases):
        """steps + 1 steps; the time of the `steps` periods between the end of the first
        forward and the end of the last, per step."""
        torch.cuda.synchronize()
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        for i in range(steps + 1):
            self.step(phases and i > 0, ends[i])
        torch.cuda.synchronize()
        self.rounds.append(ends[0].elapsed_time(ends[-1]) / steps)
        self.timed_steps += steps  # With --phases, the steps that recorded their marks.
        self.steps_run += steps + 1

    def ms(self):
        return statistics.median(self.rounds)

    def phases(self):
        n, runs = self.timed_steps, self.steps_run
        phase = [sum(e[i].elapsed_time(e[i + 1]) for e in self.marks) / len(self.marks)
                 for i in range(3)]
        extra = ""
        if isinstance(self.opt, Ckpt):
            extra = (f"; hooks {self.opt.hook_s * 1e3 / runs:.1f} ms of host time in "
                     f"{self.opt.hook_calls // runs} calls; ckpt's device buffers "
                     f"{self.outside / 2 ** 20:.0f} MiB")
            if self.opt.left_gated:
                extra += f"; {self.opt.left_gated / runs:.1f} parameters left gated per step"
        return (f"#   {self.name}: forward {phase[0]:.1f} ms, backward {phase[1]:.1f} ms, step "
                f"{phase[2]:.1f} ms (GPU time between the stream's marks; host time in the calls "
                f"{self.host[0] * 1e3 / n:.1f}, {self.host[1] * 1e3 / n:.1f}, "
                f"{self.host[2] * 1e3 / n:.1f}){extra}")

    def close(self):
        if isinstance(self.opt, Ckpt):
            self.opt.opt.close()
        del self.opt, self.net, self.ids


# The streamed step's bytes per parameter each way: the master and both moments.
STATE_BYTES = {"f32": 12, "bf16": 8}


def measure(rows, args, clip):
    """Builds every row (each measures its peak memory as it is built, the others idle), then
    times `rounds` rounds of `round_steps` steps, the rows taking turns in every round."""
    gc.collect()
    torch.cuda.empty_cache()
    built = []
    for name in rows:
        built.append(Row(name, args, clip))
        print(f"#   built {name}", flush=True)
    for r in range(args.rounds):
        for row in built:
            row.round(args.round_steps, args.phases)
        print(f"#   round {r + 1}: " + ", ".join(f"{row.name} {row.rounds[-1]:.1f}"
                                               for row in built), flush=True)
    return built


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=2560)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=8,
                    help="timed rounds; in each, every row runs --round-steps steps in turn")
    ap.add_argument("--round-steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps of each row first")
    ap.add_argument("--phases", action="store_true",
                    help="also print each row's forward, backward and step time")
    ap.add_argument("--max-norm", type=float, default=1.0,
                    help="the clipped runs' max_norm (clip_grad_norm_ / clip_grad_norm)")
    ap.add_argument("--cpu-threads", type=int, default=0,
                    help="the CPU engine rows' threads (0: every core)")
    ap.add_argument("--unit-mib", type=int, default=0,
                    help="ckpt's unit size in MiB of masters (0: its default, 8)")
    ap.add_argument("--clipping", choices=("both", "off", "on"), default="both",
                    help="run the rows without clipping, with it, or both (default)")
    ap.add_argument("--only", action="append", default=None,
                    help="run only these rows (ckpt-f32-plain, ckpt-f32-overlap, "
                         "ckpt-f32-forward, ckpt-bf16-plain, ckpt-bf16-overlap, "
                         "ckpt-bf16-forward, ckpt-cpu-f32-plain, ckpt-cpu-f32-overlap, "
                         "ckpt-cpu-f32-forward, ckpt-cpu-bf16-plain, "
                         "ckpt-cpu-bf16-overlap, ckpt-cpu-bf16-forward: the CPU "
                         "engine); torch-fused and the reference rows always run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/train_step.py needs a CUDA device")
    if args.rounds < 1 or args.round_steps < 1:
        raise SystemExit("--rounds and --round-steps must be at least 1")
    net, _ = llama(args)
    args.params = sum(p.numel() for p in net.parameters())
    del net
    ckpt_rows = ["ckpt-f32-plain", "ckpt-f32-overlap", "ckpt-f32-forward",
                 "ckpt-bf16-plain", "ckpt-bf16-overlap", "ckpt-bf16-forward",
                 "ckpt-cpu-f32-plain", "ckpt-cpu-f32-overlap", "ckpt-cpu-f32-forward",
                 "ckpt-cpu-bf16-plain", "ckpt-cpu-bf16-overlap", "ckpt-cpu-bf16-forward"]
    if args.only:
        ckpt_rows = [r for r in ckpt_rows if r in args.only]
    moments_used = [m for m in STATE_BYTES
                    if any(f"-{m}-" in r and not r.startswith("ckpt-cpu-") for r in ckpt_rows)]
    print(f"# {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq}; "
          f"{args.warmup} untimed steps, then {args.rounds} rounds of {args.round_steps} steps "
          f"in which every row takes its turn; a row's time is its median round, 'x torch' the "
          f"median of its rounds' ratios to the torch row's of the same round")
    h2d, d2h = pcie_rates()
    clips = {"both": (0.0, args.max_norm), "off": (0.0,), "on": (args.max_norm,)}[args.clipping]
    for clip in clips:
        reference = ["torch-fused", "no-step"] + [f"traffic-{m}" for m in moments_used]
        built = measure(reference + ckpt_rows, args, clip)
        by = {row.name: row for row in built}
        torch_row = by["torch-fused"]
        compute_ms = by["no-step"].ms()
        print(f"# model: {torch_row.kind}, {args.params / 1e6:.0f}M parameters; clipping "
              f"{f'at {clip:g}' if clip else 'off'}")
        print(f"# forward + backward alone: {compute_ms:.1f} ms; PCIe with both directions "
              f"busy: {h2d:.1f} GB/s in, {d2h:.1f} GB/s out")
        # The streamed step moves the masters and both moments in and out: 12 B/param each way
        # with F32 moments, 8 with BF16. No schedule beats the larger of that and the compute;
        # and none beats the loop with those bytes crossing alongside (traffic-*), measured.
        floors = {}
        for m in moments_used:
            pcie_ms = args.params * STATE_BYTES[m] / min(h2d, d2h) / 1e6
            floors[m] = by[f"traffic-{m}"].ms()
            print(f"# bound, {m} moments: max(compute {compute_ms:.1f}, state over PCIe "
                  f"{pcie_ms:.1f}) = {max(compute_ms, pcie_ms):.1f} ms; measured floor "
                  f"(traffic-{m}: the loop with the state's bytes crossing alongside) "
                  f"{floors[m]:.1f} ms")
        if args.phases:
            for row in built:
                print(row.phases())
        print(f"{'row':20} {'step ms':>9} {'x torch':>8} {'x floor':>8} {'peak GiB':>9} "
              f"{'x torch':>8}  speculation held, units updated early")
        for row in built:
            ratio = statistics.median(a / b for a, b in zip(row.rounds, torch_row.rounds))
            streamed = row.name.startswith("ckpt-") and not row.name.startswith("ckpt-cpu-")
            moments = row.name.split("-")[-2] if streamed else None
            floor = f"{row.ms() / floors[moments]:8.2f}" if moments else ""
            held = getattr(row.opt, "held", None)
            note = "" if held is None or "plain" in row.name else \
                f"  {held}/{row.steps_run}, {row.opt.early / max(1, row.steps_run):.0f} " \
                f"units a step during backward"
            print(f"{row.name:20} {row.ms():9.1f} {ratio:8.2f} {floor:>8} "
                  f"{row.peak / 2 ** 30:9.2f} {row.peak / torch_row.peak:8.2f}{note}",
                  flush=True)
        for row in built:
            row.close()
        del built, by, torch_row


if __name__ == "__main__":
    main()
