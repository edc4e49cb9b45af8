#!/usr/bin/python3
"""Side-by-side training-step timings: mapping_networks (C++) against Debian's PyTorch 1.13.

Usage:  /usr/bin/python3 bench/compare_torch.py [--build build] [--threads 2] [--repeats 7] [--json FILE]
                                              [--convs-only | --no-convs] [--conv-cpu-time]

Runs, in this one invocation and with the same thread count:
  * our Google Benchmark binary build/bench/mn_bench_train_step (median of --repeats runs), and
  * the same steps in PyTorch (median over --repeats timed blocks after warm-up),
then prints one table of medians and ratios (ours / PyTorch; < 1 means we are faster). --json also
writes the figures to FILE; as DIR/compare_torch.json next to `./mn bench`'s results (`./mn bench
--torch` does that), mn_bench_report prints and charts them with the rest.

Then, per convolution (every distinct conv of CNN2, CNN1 and ResNet-20 at batch 128, the table
CONV_LAYERS below, the twin of bench/bench_conv.cpp's kConvLayers): forward + backward of
build/bench/mn_bench_conv against F.conv2d + backward, same threads, ratio ours / torch.
--convs-only skips the training steps, --no-convs the convolutions; --conv-cpu-time times them in
CPU time (with --threads 1: steadier than wall time while other processes share the cores).

PyTorch variants of the mapped steps:
  same     the same math as ours: per group theta = s * (W z + alpha |z|^2), with W in the same
           block-orthogonal form (a [k-1, L] x [L, L] GEMM plus a small tail GEMV);
  dense    W stored explicitly (n x L) and applied as a GEMV, no modulated matrix;
  literal  the reference library's computation: W' = W + alpha 1 z^T materialised every step, then
           theta = W' z (what marn does).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
from torch_targets import cnn1, cnn2, mlp, resnet20, vit  # noqa: E402  (the twins of mapping/targets.h)


def time_steps(step, repeats, inner, clock=time.perf_counter):
    for _ in range(3):
        step()
    samples = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            step()
        samples.append((clock() - t0) / inner * 1e3)
    return statistics.median(samples)


def direct_step(batch, make_target=cnn2, device="cpu"):
    net = make_target().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step():
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


class Group:
    """One layer-wise group: latent z, fixed map W (n x L), per-element scale s."""

    def __init__(self, names, shapes, latent, mode, alpha=0.01, device="cpu"):
        self.names, self.shapes, self.mode, self.alpha = names, shapes, mode, alpha
        self.n = sum(math.prod(s) for s in shapes)
        n, L = self.n, latent
        # Drawn on the CPU (the same numbers on any device), then moved.
        self.z = (torch.randn(L) / math.sqrt(L)).to(device).requires_grad_(True)
        self.s = (torch.rand(n) * 0.1 + 0.01).to(device)
        if mode == "same" and n >= 2 * L:
            k = n // L
            # sqrt(n / k) folded into the factors, as ours does (no extra pass over the output)
            self.scale = math.sqrt(n / k)
            self.q = (torch.linalg.qr(torch.randn(L, L))[0] * self.scale).to(device)
            self.signs = (torch.randint(0, 2, (k - 1, L)).float() * 2 - 1).to(device)
            self.tail = (torch.linalg.qr(torch.randn(n - (k - 1) * L, L))[0] * self.scale).to(device)
        else:
            w = torch.linalg.qr(torch.randn(max(n, L), min(n, L)))[0]
            self.w = ((w if n >= L else w.t()).contiguous() * math.sqrt(max(n, L))).to(device)
            self.q = None

    def theta(self):
        z = self.z
        if self.mode == "literal":
            w_mod = self.w + self.alpha * z.unsqueeze(0)  # W' = W + alpha 1 z^T, materialised
            out = w_mod @ z
        elif self.q is not None:
            rep = ((self.signs * z) @ self.q.t()).reshape(-1)
            out = torch.cat([rep, self.tail @ z]) + self.alpha * (z * z).sum()
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


def mapped_step(make_target, latent, input_shape, mode, device="cpu"):
    target = make_target().to(device)
    groups = {}
    for name, p in target.named_parameters():
        groups.setdefault(name.rsplit(".", 1)[0], []).append((name, tuple(p.shape)))
    gens = [Group([n for n, _ in g], [s for _, s in g], latent, mode, device=device) for g in groups.values()]
    opt = torch.optim.Adam([g.z for g in gens], lr=1e-2)
    x = torch.randn(*input_shape, device=device)
    y = torch.randint(0, 10, (input_shape[0],), device=device)

    def step():
        params = {}
        for g in gens:
            params.update(g.tensors())
        logits = torch.func.functional_call(target, params, (x,)) if hasattr(torch, "func") else \
            torch.nn.utils.stateless.functional_call(target, params, (x,))
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def ours(build, threads, repeats):
    binary = os.path.join(build, "bench", "mn_bench_train_step")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    # Only the plain steps: BM_MappedStepBound (the bandwidth bound) is ./mn bench's business.
    out = subprocess.run([binary, f"--benchmark_repetitions={repeats}", "--benchmark_report_aggregates_only=true",
                          "--benchmark_format=json", "--benchmark_filter=^BM_(CNN1|CNN2|MLP|ResNet20|ViT)_"],
                         env=env, check=True, capture_output=True, text=True).stdout
    medians = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("aggregate_name") == "median":
            medians[b["run_name"].split("/")[0]] = b["real_time"]
    return medians


# name: (x shape, weight shape, stride, padding, bias, input needs a gradient); bench_conv.cpp's kConvLayers.
CONV_LAYERS = {
    "cnn2.conv1": ((128, 1, 28, 28), (16, 1, 3, 3), 1, 0, True, False),
    "cnn2.conv2": ((128, 16, 13, 13), (32, 16, 3, 3), 1, 0, True, True),
    "cnn1.conv1": ((128, 1, 28, 28), (32, 1, 3, 3), 1, 1, True, False),
    "cnn1.conv2": ((128, 32, 14, 14), (64, 32, 3, 3), 1, 1, True, True),
    "cnn1.conv3": ((128, 64, 7, 7), (128, 64, 3, 3), 1, 1, True, True),
    "cnn1.conv4": ((128, 128, 7, 7), (128, 128, 3, 3), 1, 1, True, True),
    "resnet20.stem": ((128, 1, 28, 28), (16, 1, 3, 3), 1, 1, False, False),
    "resnet20.s1": ((128, 16, 28, 28), (16, 16, 3, 3), 1, 1, False, True),
    "resnet20.s2.down": ((128, 16, 28, 28), (32, 16, 3, 3), 2, 1, False, True),
    "resnet20.s2.ds": ((128, 16, 28, 28), (32, 16, 1, 1), 2, 0, False, True),
    "resnet20.s2": ((128, 32, 14, 14), (32, 32, 3, 3), 1, 1, False, True),
    "resnet20.s3.down": ((128, 32, 14, 14), (64, 32, 3, 3), 2, 1, False, True),
    "resnet20.s3.ds": ((128, 32, 14, 14), (64, 32, 1, 1), 2, 0, False, True),
    "resnet20.s3": ((128, 64, 7, 7), (64, 64, 3, 3), 1, 1, False, True),
}
# A conv meets issue 22's target when ours / torch <= this.
CONV_TARGET_RATIO = 1.2


def conv_step(x_shape, w_shape, stride, pad, bias, input_grad):
    x = (torch.randn(*x_shape) * 0.1).requires_grad_(input_grad)
    w = (torch.randn(*w_shape) * 0.1).requires_grad_(True)
    b = (torch.randn(w_shape[0]) * 0.1).requires_grad_(True) if bias else None
    grad = torch.ones_like(F.conv2d(x.detach(), w.detach(), None if b is None else b.detach(), stride, pad))

    def step():
        for t in (x, w, b):
            if t is not None:
                t.grad = None
        F.conv2d(x, w, b, stride, pad).backward(grad)
    return step


def ours_convs(build, threads, repeats, cpu_time=False):
    """Median forward + backward ms of each layer of bench/mn_bench_conv, keyed by layer name (wall
    time, or the benchmark thread's CPU time)."""
    binary = os.path.join(build, "bench", "mn_bench_conv")
    if not os.path.exists(binary):  # not built: ours shows as n/a
        return {}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([binary, f"--benchmark_repetitions={repeats}", "--benchmark_report_aggregates_only=true",
                          "--benchmark_format=json", "--benchmark_filter=^BM_ConvForwardBackward/"],
                         env=env, check=True, capture_output=True, text=True).stdout
    field = "cpu_time" if cpu_time else "real_time"
    return {b["label"]: b[field] for b in json.loads(out)["benchmarks"] if b.get("aggregate_name") == "median"}


def conv_rows(build, threads, repeats, cpu_time=False):
    mine = ours_convs(build, threads, repeats, cpu_time)
    rows = []
    for name, spec in CONV_LAYERS.items():
        theirs = time_steps(conv_step(*spec), repeats, 3, time.process_time if cpu_time else time.perf_counter)
        rows.append({"conv": name, "ours_ms": mine.get(name), "torch_ms": theirs})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE (read by mn_bench_report)")
    ap.add_argument("--convs-only", action="store_true", help="only the per-convolution rows")
    ap.add_argument("--no-convs", action="store_true", help="skip the per-convolution rows")
    ap.add_argument("--conv-cpu-time", action="store_true",
                    help="time the convolutions in CPU time, not wall time: steadier on a busy machine, but only "
                         "comparable with --threads 1 (at more threads it counts the OpenMP workers' spinning)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    doc = {"threads": args.threads, "torch": torch.__version__, "repeats": args.repeats, "rows": []}
    if not args.convs_only:
        doc["rows"] = step_rows(args)
    if not args.no_convs:
        convs = conv_rows(args.build, args.threads, args.repeats, args.conv_cpu_time)
        clock = "CPU" if args.conv_cpu_time else "wall"
        print(f"\nconvolutions, forward + backward, batch 128 (medians, {clock} ms; ratio = ours / torch; "
              f"target <= {CONV_TARGET_RATIO})")
        print(f"{'conv':20s} {'ours':>9s} {'torch':>9s} {'ratio':>7s}")
        for r in convs:
            ours_ms, ms = r["ours_ms"], r["torch_ms"]
            ratio = f"{ours_ms / ms:7.2f}" if ours_ms else "    n/a"
            ours_txt = f"{ours_ms:9.2f}" if ours_ms else "      n/a"
            print(f"{r['conv']:20s} {ours_txt} {ms:9.2f} {ratio}")
        doc["convs"] = convs
        doc["conv_target_ratio"] = CONV_TARGET_RATIO
        doc["conv_clock"] = clock
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


def step_rows(args):
    mine = ours(args.build, args.threads, args.repeats)
    rows = [
        ("CNN2 direct, batch 128, Adam", mine.get("BM_CNN2_DirectStep"),
         {"torch": time_steps(direct_step(128), args.repeats, 5)}),
        ("CNN1 direct, batch 128, Adam", mine.get("BM_CNN1_DirectStep"),
         {"torch": time_steps(direct_step(128, cnn1), args.repeats, 2)}),
        ("CNN2 layerwise 4x672, batch 256", mine.get("BM_CNN2_LayerwiseStep"),
         {m: time_steps(mapped_step(cnn2, 672, (256, 1, 28, 28), m), args.repeats, 3)
          for m in ("same", "dense", "literal")}),
        ("MLP 784-256-256-10 layerwise L=64, batch 64", mine.get("BM_MLP_LayerwiseStep"),
         {m: time_steps(mapped_step(mlp, 64, (64, 784), m), args.repeats, 10) for m in ("same", "dense", "literal")}),
        ("ResNet-20 direct, batch 128, Adam", mine.get("BM_ResNet20_DirectStep"),
         {"torch": time_steps(direct_step(128, resnet20), args.repeats, 2)}),
        ("ResNet-20 layerwise 43x232, batch 128", mine.get("BM_ResNet20_LayerwiseStep"),
         {m: time_steps(mapped_step(resnet20, 232, (128, 1, 28, 28), m), args.repeats, 2) for m in ("same", "dense")}),
        ("ViT direct, batch 128, Adam", mine.get("BM_ViT_DirectStep"),
         {"torch": time_steps(direct_step(128, vit), args.repeats, 2)}),
    ]
    print(f"threads={args.threads} torch={torch.__version__} (medians, ms per step; ratio = ours / torch)")
    print(f"{'step':46s} {'ours':>9s}  {'torch variant':>14s} {'torch':>9s} {'ratio':>7s}")
    for label, ours_ms, theirs in rows:
        for variant, ms in theirs.items():
            ratio = f"{ours_ms / ms:7.2f}" if ours_ms else "    n/a"
            ours_txt = f"{ours_ms:9.2f}" if ours_ms else "      n/a"
            print(f"{label:46s} {ours_txt}  {variant:>14s} {ms:9.2f} {ratio}")
    return [{"step": label, "ours_ms": ours_ms, "torch_ms": theirs} for label, ours_ms, theirs in rows]


if __name__ == "__main__":
    main()
