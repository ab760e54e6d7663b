"""The Python step against the C++ step on the same state: ckpt.torch.StagedAdamW.step() (the
torch.optim.Optimizer, reading each gradient and writing each parameter in place) against the
same native call (ckpt_optimizer_step_masked, every parameter stepped) made directly with pointer
arrays prepared in advance, on the same optimizer, alternating. Prints both, and their ratio (goal <= 1.05 at 100M
parameters on the CPU engine).

    CKPT_LIB=build/capi/libckpt_c.so PYTHONPATH=python python3 bench/python_step.py \\
        [--params 100000000] [--tensors 200] [--dtype bf16] [--steps 15]
"""
import argparse
import ctypes
import statistics
import time

import torch

import ckpt.torch
from ckpt import _lib
from ckpt._lib import check, lib


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="bf16")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    per = a.params // a.tensors
    params = [torch.nn.Parameter(torch.randn(per, dtype=dtype) * 0.02) for _ in range(a.tensors)]
    for p in params:
        p.grad = torch.randn(per, dtype=dtype) * 1e-3
    opt = ckpt.torch.StagedAdamW(params, lr=1e-4, threads=a.threads)
    opt.step()  # Warm: the slabs' pages are touched.
    handle = opt._live()
    n = len(params)
    grads = (ctypes.c_void_p * n)(*[p.grad.data_ptr() for p in params])
    weights = (ctypes.c_void_p * n)(*[p.data_ptr() for p in params])
    skipped = ctypes.c_int(0)
    grad_dtype = _lib.BF16 if dtype == torch.bfloat16 else _lib.F32
    mask = (ctypes.c_uint8 * n)(*([1] * n))

    def native():
        check(lib.ckpt_optimizer_step_masked(handle, grads, weights, n, mask, n, grad_dtype, 1.0,
                                             0, None, ctypes.byref(skipped)))

    py, cc = [], []
    for _ in range(a.steps):
        t = time.perf_counter()
        opt.step()
        py.append(time.perf_counter() - t)
        t = time.perf_counter()
        native()
        cc.append(time.perf_counter() - t)
    p, c = statistics.median(py), statistics.median(cc)
    print(f"{a.params / 1e6:.0f}M parameters in {n} tensors, {a.dtype}, CPU engine, "
          f"torch {torch.__version__}: median of {a.steps} steps each, alternating")
    print(f"python step (StagedAdamW.step)   {p * 1e3:8.1f} ms")
    print(f"C++ step (the same native call)  {c * 1e3:8.1f} ms")
    print(f"ratio {p / c:.3f} (goal <= 1.05)")
    opt.close()


if __name__ == "__main__":
    main()
