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
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def cnn2():
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))


class Group:
    """One layer-wise group: latent z [L], fixed factors of W (n x L), per-element scale s [n]."""

    def __init__(self, names, shapes, latent, device, alpha=0.01):
        self.names, self.shapes, self.alpha = names, shapes, alpha
        self.n = n = sum(math.prod(s) for s in shapes)
        L = latent
        self.z = (torch.randn(L) / math.sqrt(L)).to(device).requires_grad_(True)
        self.s = (torch.rand(n) * 0.1 + 0.01).to(device)
        if n >= 2 * L:
            k = n // L
            self.q = torch.linalg.qr(torch.randn(L, L))[0].to(device)
            self.signs = (torch.randint(0, 2, (k - 1, L)).float() * 2 - 1).to(device)
            self.tail = torch.linalg.qr(torch.randn(n - (k - 1) * L, L))[0].to(device)
            self.scale = math.sqrt(n / k)
            self.w = None
        else:
            w = torch.linalg.qr(torch.randn(max(n, L), min(n, L)))[0]
            self.w = ((w if n >= L else w.t()).contiguous() * math.sqrt(max(n, L))).to(device)
            self.q = None

    def theta(self):
        z = self.z
        if self.q is not None:
            rep = ((self.signs * z) @ self.q.t()).reshape(-1)
            out = torch.cat([rep, self.tail @ z]) * self.scale + self.alpha * (z * z).sum()
        else:
            out = self.w @ z + self.alpha * (z * z).sum()
        return self.s * out

    def tensors(self):
        flat, out, offset = self.theta(), {}, 0
        for name, shape in zip(self.names, self.shapes):
            size = math.prod(shape)
            out[name] = flat[offset:offset + size].view(shape)
            offset += size
        return out


def mapped_step(device, batch=256, latent=672):
    target = cnn2().to(device)
    groups = {}
    for name, p in target.named_parameters():
        groups.setdefault(name.rsplit(".", 1)[0], []).append((name, tuple(p.shape)))
    gens = [Group([n for n, _ in g], [s for _, s in g], latent, device) for g in groups.values()]
    opt = torch.optim.Adam([g.z for g in gens], lr=1e-2)
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step():
        params = {}
        for g in gens:
            params.update(g.tensors())
        loss = F.cross_entropy(torch.func.functional_call(target, params, (x,)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step, len(gens)


def direct_step(device, batch):
    net = cnn2().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step():
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


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
        step, groups = mapped_step(gpu)
        result = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0),
            "tf32": False,
            "groups": groups,
            "steps": args.steps,
            "cnn2_layerwise_b256_ms": median_ms(step, gpu, args.steps, args.warmup),
            "cnn2_direct_b128_ms": median_ms(direct_step(gpu, 128), gpu, args.steps, args.warmup),
            "cnn2_direct_b256_ms": median_ms(direct_step(gpu, 256), gpu, args.steps, args.warmup),
        }
        if args.cpu_steps > 0:
            cpu = torch.device("cpu")
            result["cpu_threads"] = torch.get_num_threads()
            result["cnn2_layerwise_b256_cpu_ms"] = median_ms(mapped_step(cpu)[0], cpu, args.cpu_steps, 2)
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
