"""Peak GPU memory of a training step (forward, backward, optimizer step) on the same BF16
model: torch.optim.AdamW on the BF16 parameters (its moments in BF16 on the GPU, no masters)
against ckpt.torch.StagedAdamW on the CUDA engine (masters and moments in host slabs, a few
bounded device buffers). ckpt's device buffers are allocated outside torch's caching allocator,
so they are measured from the driver's free memory around the optimizer's construction and
added to torch's peak. Prints both peaks and their ratio (goal <= 1.0: ckpt never needs more
GPU memory than torch's AdamW without masters).

    CKPT_LIB=build/capi/libckpt_c.so PYTHONPATH=python python3 bench/gpu_memory.py \\
        [--layers 8] [--width 4096] [--batch 16]
"""
import argparse
import gc

import torch

import ckpt.torch


def model(layers, width):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device="cuda", dtype=torch.bfloat16)


def peak_of(kind, layers, width, batch):
    """Peak bytes of the third training step, and the bytes held outside torch's allocator."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    net = model(layers, width)
    free_before, _ = torch.cuda.mem_get_info()
    allocated_before = torch.cuda.memory_allocated()
    if kind == "torch":
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    else:
        opt = ckpt.torch.StagedAdamW(net.named_parameters(), lr=1e-4)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    # What the construction took from the device beyond torch's own allocations.
    outside = max(0, (free_before - free_after) -
                  (torch.cuda.memory_allocated() - allocated_before))
    if kind == "torch":
        outside = 0
    x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
    for step in range(3):
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        net(x).float().pow(2).mean().backward()
        opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() + outside
    if kind == "ckpt":
        opt.close()
    del opt, net, x
    return peak, outside


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_memory.py needs a CUDA device")
    params = a.layers * (a.width * a.width + a.width)
    torch_peak, _ = peak_of("torch", a.layers, a.width, a.batch)
    ckpt_peak, outside = peak_of("ckpt", a.layers, a.width, a.batch)
    gib = 1 << 30
    print(f"{params / 1e6:.0f}M BF16 parameters ({a.layers} x Linear({a.width}, {a.width})), "
          f"batch {a.batch}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"torch AdamW (BF16 moments on the GPU, no masters)  peak {torch_peak / gib:7.3f} GiB")
    print(f"ckpt StagedAdamW (CUDA engine)                     peak {ckpt_peak / gib:7.3f} GiB "
          f"(of which {outside / gib:.3f} GiB of engine buffers)")
    print(f"ratio {ckpt_peak / torch_peak:.3f} (goal <= 1.0)")


if __name__ == "__main__":
    main()
