#!/usr/bin/env python3
"""PyTorch on the GPU: the training steps bench/bench_cuda_train_step.cpp times, with the same math.

Usage:  python3 bench/torch_cuda_step.py [--steps 50] [--warmup 10] [--out FILE]

Prints one JSON object (also written to --out): median ms per step, each step followed by
torch.cuda.synchronize() and timed by the host clock, as ours are.
  cnn2_layerwise_b256   CNN2 through a layerwise mapping network, 4 groups x 672, batch 256: per group
                        theta = s * (W z + alpha |z|^2) with W in the block-orthogonal form ours uses
                        (a [k-1, L] x [L, L] GEMM with random column signs plus a tail GEMV;
                        bench/compare_torch.py's "same" variant), functional_call, cross-entropy, Adam
                        on the four latents (lr 1e-2)
  cnn2_direct_b128/256  CNN2 trained directly, Adam (lr 1e-3)
  *_cpu                 the mapped step on this machine's CPU in PyTorch, for context
TF32 is off (torch.backends.cudnn.allow_tf32 and cuda.matmul.allow_tf32), as in our build, so both
compute in full f32. Without a GPU it prints {"skipped": "..."} and exits 0.
"""
import argparse
import json
import statistics
import sys
import time

import torch

import compare_torch  # the same models, groups and steps, on any device (bench/ is on sys.path)


def layerwise_group_count(make_target):
    return len({name.rsplit(".", 1)[0] for name, _ in make_target().named_parameters()})


def mapped_step(device, batch=256, latent=672):
    return compare_torch.mapped_step(compare_torch.cnn2, latent, (batch, 1, 28, 28), "same", device)


def direct_step(device, batch):
    return compare_torch.direct_step(batch, device=device)


def median_ms(step, device, steps, warmup):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--cpu-steps", type=int, default=10, help="0 leaves the CPU figure out")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        result = {"skipped": "torch.cuda.is_available() is False", "torch": torch.__version__}
    else:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.manual_seed(0)
        gpu = torch.device("cuda", 0)
        step, groups = mapped_step(gpu), layerwise_group_count(compare_torch.cnn2)
        result = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0),
            # read back, not asserted: what cuDNN and cuBLAS were told
            "tf32": {"cudnn": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32,
                     "float32_matmul_precision": torch.get_float32_matmul_precision()},
            "groups": groups,
            "steps": args.steps,
            "cnn2_layerwise_b256_ms": median_ms(step, gpu, args.steps, args.warmup),
            "cnn2_direct_b128_ms": median_ms(direct_step(gpu, 128), gpu, args.steps, args.warmup),
            "cnn2_direct_b256_ms": median_ms(direct_step(gpu, 256), gpu, args.steps, args.warmup),
        }
        if args.cpu_steps > 0:
            cpu = torch.device("cpu")
            result["cpu_threads"] = torch.get_num_threads()
            result["cnn2_layerwise_b256_cpu_ms"] = median_ms(mapped_step(cpu), cpu, args.cpu_steps, 2)
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
