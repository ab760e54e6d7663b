"""Muon's optimizer step on one GPU: ckpt.torch.StagedMuon on the CUDA engine (FP32 masters and
momentum in pinned host memory, each matrix streamed through slots sized by the largest, its
Newton-Schulz products on ckpt's own BF16 tensor-core kernel) against the peer, torch.optim.Muon
with its FP32 parameters and momentum on the GPU (torch >= 2.9; its products on cuBLAS). Also the
products alone, cuBLAS through torch.mm, on the same shapes: what ckpt's kernel would gain from
cuBLAS. Prints each step time (best of --steps after a warm-up, the device synchronized), the
GPU memory each holds, and the ratios.

    CKPT_LIB=build/capi/libckpt_c.so PYTHONPATH=python python3 bench/muon_vs_torch.py \\
        [--rows 1024] [--cols 4096] [--matrices 8] [--steps 5]
"""
import argparse
import time

import torch

import ckpt.torch


def best_step(opt, params, grads, steps):
    best = float("inf")
    for i in range(steps + 1):  # Step 0 warms up.
        for p, g in zip(params, grads):
            p.grad = g
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        if i > 0:
            best = min(best, time.perf_counter() - start)
    return best


def products_alone(rows, cols, steps, repeats=3):
    """torch's Newton-Schulz products (X X^T, b G + c G G, a X + H X) in BF16 on cuBLAS."""
    m, n = min(rows, cols), max(rows, cols)
    x = torch.full((m, n), 0.01, device="cuda", dtype=torch.bfloat16)
    best = float("inf")
    for r in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            g = x @ x.T
            h = torch.addmm(g, g, g, beta=-4.775, alpha=2.0315)
            x = torch.addmm(x, h, x, beta=3.4445)
        torch.cuda.synchronize()
        if r > 0:
            best = min(best, time.perf_counter() - start)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--matrices", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("muon_vs_torch.py needs a CUDA device")
    torch.manual_seed(0)
    shape = (args.rows, args.cols)
    init = [torch.randn(shape, device="cuda") * 0.02 for _ in range(args.matrices)]
    grads32 = [torch.randn(shape, device="cuda") * 1e-3 for _ in range(args.matrices)]
    m, n = min(shape), max(shape)
    flops = args.matrices * 5 * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)
    print(f"# {args.matrices} matrices of {args.rows} x {args.cols}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")

    rows = []
    if hasattr(torch.optim, "Muon"):
        params = [p.clone().requires_grad_() for p in init]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1)
        t = best_step(opt, params, grads32, args.steps)
        state = torch.cuda.memory_allocated() - before  # The momentum buffers.
        rows.append(("torch.optim.Muon (FP32 on the GPU)", t,
                     sum(p.numel() * 4 for p in params) + state))
        del opt, params
    else:
        print("# torch.optim.Muon: not in this torch (>= 2.9)")

    params = [p.bfloat16().requires_grad_() for p in init]
    grads16 = [g.bfloat16() for g in grads32]
    free_before = torch.cuda.mem_get_info()[0]
    opt = ckpt.torch.StagedMuon(params, lr=0.02, weight_decay=0.1)
    engine = free_before - torch.cuda.mem_get_info()[0]  # ckpt's slots, outside torch's allocator.
    t = best_step(opt, params, grads16, args.steps)
    rows.append(("ckpt StagedMuon (CUDA engine, BF16 weights)", t,
                 sum(p.numel() * 2 for p in params) + engine))
    del opt

    cublas = products_alone(args.rows, args.cols, 5) * args.matrices
    print(f"{'optimizer':45s} {'step ms':>9s} {'TFLOP/s':>8s} {'x torch':>8s} {'GPU MiB':>9s}")
    for name, t, mem in rows:
        print(f"{name:45s} {t * 1e3:9.2f} {flops / t / 1e12:8.1f} {t / rows[0][1]:8.2f} "
              f"{mem / 2**20:9.1f}")
    print(f"{'products alone, cuBLAS (torch.mm, BF16)':45s} {cublas * 1e3:9.2f} "
          f"{flops / cublas / 1e12:8.1f}")


if __name__ == "__main__":
    main()
