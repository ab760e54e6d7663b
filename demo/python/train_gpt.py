#!/usr/bin/env python3
"""A real training run with ckpt, in Python: a small GPT (byte-level, a few million parameters)
learns the licence texts every Debian machine ships (/usr/share/common-licenses) with
ckpt.torch.StagedAdamW, a warmup + cosine learning rate (torch's LambdaLR), and ckpt async saves
every --save-every steps. --crash-at S kills the process (SIGKILL) while the async save of step S
is being written; --resume loads LATEST and continues; the run then ends bit for bit where an
uninterrupted one ends (weights, masters, moments, the scheduler, the RNG, the data position),
which --dump FILE lets a test compare.

    python3 demo/python/train_gpt.py --out /tmp/run --steps 60 --crash-at 35
    python3 demo/python/train_gpt.py --out /tmp/run --steps 60 --resume
"""
import argparse
import glob
import math
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import ckpt  # noqa: E402
import ckpt.torch  # noqa: E402


def corpus():
    texts = []
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, "rb") as f:
                texts.append(f.read())
    data = b"\n".join(texts)
    if len(data) < 10000:
        raise SystemExit("train_gpt: /usr/share/common-licenses holds too little text")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    def __init__(self, dim, layers, heads, context):
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.pos = torch.nn.Embedding(context, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, 256, bias=False)

    def forward(self, ids):
        n = ids.shape[1]
        x = self.embed(ids) + self.pos(torch.arange(n, device=ids.device))
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=ids.device), 1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def batch(data, step, size, context):
    """The batch of `step`: a fixed function of the step, so the data position is the step."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - context - 1, (size,), generator=g)
    chunk = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
    return chunk[:, :-1], chunk[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory (checkpoints in OUT/ckpt)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--crash-at", type=int, default=0, help="SIGKILL during this step's save")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-save", action="store_true", help="the uninterrupted reference run")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=48)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=0, help="torch and ckpt threads (0: all)")
    p.add_argument("--device", default="cpu",
                   help="cpu (ckpt's CPU engine) or cuda (the model on the GPU, ckpt's CUDA "
                        "engine streaming the state from host memory)")
    p.add_argument("--dump", help="write the final state here (torch.save) for comparison")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="adamw (StagedAdamW), or muon (StagedMuon: Muon for the blocks' "
                        "matrices at lr --muon-lr, AdamW for the embeddings, head and norms)")
    p.add_argument("--muon-lr", type=float, default=0.02)
    args = p.parse_args()
    if args.device.startswith("cuda"):
        # A resume that ends bit for bit where an uninterrupted run ends needs the GPU's forward
        # and backward to be reproducible too: torch's deterministic kernels, and cuBLAS's own
        # setting for them (read when CUDA starts, so before the model moves there).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = corpus()
    model = GPT(args.dim, args.layers, args.heads, args.context).to(args.device)
    decay = [(n, q) for n, q in model.named_parameters() if q.dim() >= 2]
    plain = [(n, q) for n, q in model.named_parameters() if q.dim() < 2]
    if args.optimizer == "muon":  # The usual split: Muon for the hidden matrices only.
        hidden = [(n, q) for n, q in decay if n.startswith("blocks.")]
        others = [(n, q) for n, q in decay if not n.startswith("blocks.")]
        opt = ckpt.torch.StagedMuon([{"params": hidden},
                                     {"params": others, "use_muon": False, "weight_decay": 0.1},
                                     {"params": plain, "use_muon": False, "weight_decay": 0.0}],
                                    lr=args.muon_lr, weight_decay=0.1, adamw_lr=args.lr,
                                    adamw_betas=(0.9, 0.95), threads=args.threads)
    else:
        opt = ckpt.torch.StagedAdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": plain, "weight_decay": 0.0}],
                                     lr=args.lr, betas=(0.9, 0.95), threads=args.threads)
    warmup = max(1, args.steps // 10)

    def schedule(s):  # Linear warmup, then cosine to 10%.
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, args.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    nparams = sum(q.numel() for q in model.parameters())
    os.makedirs(args.out, exist_ok=True)
    ck = None if args.no_save else ckpt.Checkpointer(os.path.join(args.out, "ckpt"), opt)
    first = 1
    if args.resume:
        extra = ck.load()
        sched.load_state_dict(extra["sched"])
        torch.set_rng_state(extra["rng"])
        first = extra["next_step"]
        print(f"resumed from step {ck.loaded_step}: next step {first}, lr "
              f"{opt.param_groups[0]['lr']:.3e}", flush=True)
    else:
        print(f"GPT: {nparams} parameters ({args.layers} layers, dim {args.dim}), "
              f"{len(data)} bytes of licence text, {type(opt).__name__} (ckpt), async saves every "
              f"{args.save_every} steps", flush=True)
    pending = None
    start = time.time()
    for step in range(first, args.steps + 1):
        x, y = batch(data, step, args.batch, args.context)
        x, y = x.to(args.device), y.to(args.device)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        if pending is not None:  # The previous step's save was written while this one ran.
            pending.finalize()
            print(f"step {pending.step:4d}  async save committed", flush=True)
            pending = None
        if step % 5 == 0 or step == first:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {opt.param_groups[0]['lr']:.3e}",
                  flush=True)
        if ck is None:
            continue
        extra = {"sched": sched.state_dict(), "rng": torch.get_rng_state(), "next_step": step + 1}
        if step == args.steps:
            ck.save(step, extra=extra)
            print(f"step {step:4d}  saved (last step)", flush=True)
        elif step % args.save_every == 0 or step == args.crash_at:
            pending = ck.save_async(step, extra=extra)
            print(f"step {step:4d}  async save begun", flush=True)
            if step == args.crash_at:
                print(f"step {step:4d}  killed while its async save is in flight (SIGKILL)",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    print(f"trained steps {first}..{args.steps} in {time.time() - start:.1f} s", flush=True)
    if args.dump:
        state = {"params": {n: q.detach().cpu() for n, q in model.named_parameters()},
                 "masters": {n: opt.master(q) for n, q in model.named_parameters()},
                 "exp_avg": {n: opt.exp_avg(q) for n, q in model.named_parameters()},
                 "exp_avg_sq": {n: opt.exp_avg_sq(q) for n, q in model.named_parameters()},
                 "sched": sched.state_dict(), "rng": torch.get_rng_state(),
                 "group_steps": opt.group_steps()}
        torch.save(state, args.dump)
    if ck is not None:
        ck.close()
    opt.close()


if __name__ == "__main__":
    main()
