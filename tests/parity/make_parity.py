#!/usr/bin/python3
"""Writes PyTorch reference data for the C++ parity tests (tests/test_parity.cpp).

Run by hand with Debian's python3-torch (1.13):   /usr/bin/python3 tests/parity/make_parity.py
Each case becomes tests/data/parity_<case>.safetensors holding inputs, parameters, outputs and
gradients under explicit names. The files are small and committed, so CI needs no Python.
The safetensors format is written directly (8-byte header length, JSON header, raw little-endian
data) because Debian 12 packages no safetensors module for Python.
"""
import json
import math
import os
import struct

import torch
import torch.nn.functional as F

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
torch.manual_seed(0)
torch.set_num_threads(1)


def save(case, tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        if t.dtype == torch.float32:
            dtype, raw = "F32", t.numpy().astype("<f4").tobytes()
        elif t.dtype == torch.int64:
            dtype, raw = "I64", t.numpy().astype("<i8").tobytes()
        elif t.dtype in (torch.bfloat16, torch.float16):  # the raw 16-bit patterns
            dtype = "BF16" if t.dtype == torch.bfloat16 else "F16"
            raw = t.view(torch.int16).numpy().astype("<i2").tobytes()
        else:
            raise TypeError(f"{name}: unsupported dtype {t.dtype}")
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    path = os.path.join(OUT, f"parity_{case}.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    print(f"wrote {path} ({8 + len(text) + offset} bytes)")


def leaf(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).requires_grad_(True)


def weighted_backward(y, name, out):
    """Backward of sum(w * y) for a fixed random weight w, stored as <name>_weight."""
    w = torch.rand_like(y) + 0.5
    (y * w).sum().backward()
    out[name + "_weight"] = w


def trajectories(makers, init, grads, out):
    """For each optimizer maker: a parameter from init, stepped with each gradient; <name>_step<i> after step i."""
    for name, make in makers.items():
        p = init.clone().requires_grad_(True)
        opt = make(p)
        for i, g in enumerate(grads):
            p.grad = g.clone()
            opt.step()
            out[f"{name}_step{i}"] = p.detach().clone()


def conv2d():
    out = {}
    configs = [("plain", 1, 0, 1, 1), ("stride_pad", 2, 1, 1, 1), ("dilation", 1, 2, 2, 1), ("groups", 1, 1, 1, 2)]
    for tag, stride, pad, dil, groups in configs:
        x = leaf(2, 4, 7, 6)
        w = leaf(6, 4 // groups, 3, 3, scale=0.3)
        b = leaf(6)
        y = F.conv2d(x, w, b, stride=stride, padding=pad, dilation=dil, groups=groups)
        weighted_backward(y, f"{tag}_y", out)
        out.update({f"{tag}_x": x, f"{tag}_w": w, f"{tag}_b": b, f"{tag}_y": y, f"{tag}_gx": x.grad,
                    f"{tag}_gw": w.grad, f"{tag}_gb": b.grad})
        out[f"{tag}_config"] = torch.tensor([stride, pad, dil, groups])
    save("conv2d", out)


def pooling():
    out = {}
    x = leaf(2, 3, 7, 7)
    y = F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True)
    weighted_backward(y, "max_y", out)
    out.update({"max_x": x, "max_y": y, "max_gx": x.grad})
    x2 = leaf(2, 3, 7, 7)
    y2 = F.avg_pool2d(x2, 3, stride=2, padding=1, ceil_mode=False, count_include_pad=False)
    weighted_backward(y2, "avg_y", out)
    out.update({"avg_x": x2, "avg_y": y2, "avg_gx": x2.grad})
    save("pooling", out)


def batch_norm():
    out = {}
    for mode in ("train", "eval"):
        x = leaf(4, 3, 5, 5)
        bn = torch.nn.BatchNorm2d(3, momentum=0.2)
        with torch.no_grad():
            bn.weight.copy_(torch.rand(3) + 0.5)
            bn.bias.copy_(torch.randn(3))
            bn.running_mean.copy_(torch.randn(3))
            bn.running_var.copy_(torch.rand(3) + 0.5)
        out[f"{mode}_running_mean_before"] = bn.running_mean.clone()
        out[f"{mode}_running_var_before"] = bn.running_var.clone()
        bn.train(mode == "train")
        y = bn(x)
        weighted_backward(y, f"{mode}_y", out)
        out.update({f"{mode}_x": x, f"{mode}_weight": bn.weight.detach(), f"{mode}_bias": bn.bias.detach(),
                    f"{mode}_y": y, f"{mode}_gx": x.grad, f"{mode}_gweight": bn.weight.grad,
                    f"{mode}_gbias": bn.bias.grad, f"{mode}_running_mean": bn.running_mean,
                    f"{mode}_running_var": bn.running_var})
    save("batch_norm", out, {"momentum": 0.2, "eps": 1e-5})


def lstm():
    out = {}
    model = torch.nn.LSTM(3, 4, num_layers=2, batch_first=True)
    x = leaf(2, 5, 3)
    y, (h, c) = model(x)
    w = torch.rand_like(y) + 0.5
    ((y * w).sum() + h.sum() + 2 * c.sum()).backward()
    out.update({"x": x, "y": y, "h_n": h, "c_n": c, "y_weight": w, "gx": x.grad})
    for name, p in model.named_parameters():
        out[name] = p.detach()
        out["grad_" + name] = p.grad
    save("lstm", out)


def losses():
    out = {}
    logits = leaf(6, 5)
    target = torch.tensor([0, 4, 2, 2, 1, 3])
    loss = F.cross_entropy(logits, target, label_smoothing=0.1)
    loss.backward()
    out.update({"ce_logits": logits, "ce_target": target, "ce_loss": loss.reshape(1), "ce_grad": logits.grad})
    logits2 = leaf(6, 5)
    target2 = torch.tensor([0, -100, 2, 2, -100, 3])
    loss2 = F.cross_entropy(logits2, target2, ignore_index=-100, reduction="mean")
    loss2.backward()
    out.update({"ce_ignore_logits": logits2, "ce_ignore_target": target2, "ce_ignore_loss": loss2.reshape(1),
                "ce_ignore_grad": logits2.grad})
    a, b = leaf(3, 4), torch.randn(3, 4)
    mse = F.mse_loss(a, b)
    mse.backward()
    out.update({"mse_a": a, "mse_b": b, "mse_loss": mse.reshape(1), "mse_grad": a.grad})
    x = leaf(4, 6)
    out.update({"act_x": x, "act_gelu": F.gelu(x), "act_softplus": F.softplus(x),
                "act_log_softmax": F.log_softmax(x, 1), "act_sigmoid": torch.sigmoid(x)})
    lin_w, lin_b = leaf(3, 6), leaf(3)
    lin = F.linear(x, lin_w, lin_b)
    out.update({"linear_w": lin_w, "linear_b": lin_b, "linear_y": lin})
    save("losses", out)


def optimizers():
    out = {}
    init = torch.randn(5)
    grads = [torch.randn(5) for _ in range(6)]
    for i, g in enumerate(grads):
        out[f"grad_{i}"] = g
    out["init"] = init
    cases = {
        "sgd": lambda p: torch.optim.SGD([p], lr=0.1),
        "sgd_momentum": lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
        "sgd_nesterov": lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        "adam": lambda p: torch.optim.Adam([p], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
        "adamw": lambda p: torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
    }
    trajectories(cases, init, grads, out)
    # Schedulers: learning rate after each of 8 epochs.
    sched = {
        "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
        "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=0.01),
    }
    for name, make in sched.items():
        o = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        s = make(o)
        lrs = []
        for _ in range(8):
            o.step()
            s.step()
            lrs.append(o.param_groups[0]["lr"])
        out[f"lr_{name}"] = torch.tensor(lrs, dtype=torch.float32)
    o = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    s = torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1, factor=0.5)
    metrics = [1.0, 0.9, 0.95, 0.97, 0.96, 0.5, 0.6, 0.7, 0.8]
    lrs = []
    for m in metrics:
        s.step(m)
        lrs.append(o.param_groups[0]["lr"])
    out["plateau_metrics"] = torch.tensor(metrics)
    out["lr_plateau"] = torch.tensor(lrs, dtype=torch.float32)
    save("optim", out)


def nan_propagation():
    """NaN through relu, clamp, maximum/minimum, max/min over all elements and over a dim, and
    max_pool2d, forward and backward (issue 16: NaN must not disappear)."""
    torch.manual_seed(16)
    nan = float("nan")
    out = {}
    base = torch.randn(4, 6)
    base[0, 1] = base[2, 0] = base[2, 5] = base[3, 3] = nan
    other = torch.randn(4, 6)
    other[0, 1] = other[1, 2] = other[3, 0] = nan
    other[1, 4] = base[1, 4]  # a tie
    out["x"], out["other"] = base, other

    def run(tag, f, *inputs):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        y = f(*leaves)
        weighted_backward(y, tag, out)
        out[tag] = y
        for i, t in enumerate(leaves):
            out[f"{tag}_g{i}"] = t.grad

    run("relu", F.relu, base)
    run("clamp", lambda t: torch.clamp(t, -0.5, 0.5), base)
    run("maximum", torch.maximum, base, other)
    run("minimum", torch.minimum, base, other)
    run("max_all", lambda t: t.max(), base)
    run("min_all", lambda t: t.min(), base)
    for name, fn, dim in (("max_dim1", torch.max, 1), ("min_dim0", torch.min, 0)):
        run(name, lambda t: fn(t, dim).values, base)
        out[name + "_indices"] = fn(base, dim).indices
    images = torch.randn(2, 2, 7, 7)
    images[0, 0, 1, 1] = images[0, 1, 6, 6] = images[1, 0, 0, 3] = nan
    out["images"] = images
    run("pool", lambda t: F.max_pool2d(t, 2), images)
    run("pool_pad_ceil", lambda t: F.max_pool2d(t, 3, stride=2, padding=1, ceil_mode=True), images)
    save("nan", out)


def adam_beta2():
    """Adam and AdamW with beta2 = 0.9999 for 5 steps: 1 - beta2 must be formed in double, as Python
    does, before rounding to float. Also stores the same runs in float64 (<name>_step<i>_f64) so the
    test can measure PyTorch-f32's own distance from the exact trajectory."""
    torch.manual_seed(16)
    out = {}
    init = torch.randn(64)
    grads = [torch.randn(64) for _ in range(5)]
    out["init"] = init
    for i, g in enumerate(grads):
        out[f"grad_{i}"] = g
    cases = {
        "adam": lambda p: torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.9999)),
        "adamw": lambda p: torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.9999), weight_decay=1e-2),
    }
    for name, make in cases.items():
        for dtype, suffix in ((torch.float32, ""), (torch.float64, "_f64")):
            p = init.to(dtype).clone().requires_grad_(True)
            opt = make(p)
            for i, g in enumerate(grads):
                p.grad = g.to(dtype).clone()
                opt.step()
                out[f"{name}_step{i}{suffix}"] = p.detach().clone().float()
    save("adam_beta2", out, {"lr": 0.1, "betas": (0.9, 0.9999), "adamw_weight_decay": 1e-2})


def var_std():
    """torch.var / torch.std spelled with one dim, a dim list, no dim, biased and keepdim: mn::var(x, 1)
    must mean torch.var(x, 1) (issue 16: it used to pick the all-element overload)."""
    torch.manual_seed(16)
    out = {}
    x = torch.randn(3, 4, 5)
    out["x"] = x
    specs = {
        "var_1": lambda t: torch.var(t, 1),
        "var_0_2": lambda t: torch.var(t, [0, 2]),
        "var_2_biased": lambda t: torch.var(t, 2, unbiased=False),
        "var_all": lambda t: torch.var(t),
        "std_1": lambda t: torch.std(t, 1),
        "std_1_biased_keepdim": lambda t: torch.std(t, 1, unbiased=False, keepdim=True),
        "std_last": lambda t: torch.std(t, -1),
    }
    for tag, fn in specs.items():
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        weighted_backward(y, tag, out)
        out[tag + "_y"] = y
        out[tag + "_gx"] = xi.grad
    save("var_std", out)


def attention():
    """Scaled dot-product attention in torch math (1.13 has no F.scaled_dot_product_attention):
    softmax(Q K^T * scale + mask) V, with an additive mask, the causal mask (j > i hidden, also for
    L != S), an explicit scale, and a fully hidden row (NaN as PyTorch gives); and
    torch.nn.MultiheadAttention with batch_first both ways (cross-attention, both masks, averaged
    weights) and self-attention with per-head weights. Module parameters are stored as
    <tag>_<parameter name>, their gradients as <tag>_grad_<parameter name>; PyTorch's boolean
    key_padding_mask (true = hide) is stored as the additive mask (-inf = hide) our API takes."""
    torch.manual_seed(18)
    out = {}
    inf = float("inf")

    def sdpa(q, k, v, mask=None, causal=False, scale=None):
        s = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
        scores = (q * s) @ k.transpose(-2, -1)
        if causal:
            L, S = q.size(-2), k.size(-2)
            mask = torch.zeros(L, S).masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -inf)
        if mask is not None:
            scores = scores + mask
        return torch.softmax(scores, -1) @ v

    mask = torch.randn(2, 1, 4, 6)
    mask[0, 0, 1, 2] = -inf
    mask[1, 0, 3, :5] = -inf
    hidden_row = torch.zeros(4, 6)
    hidden_row[2, :] = -inf
    configs = {
        "plain": ((2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 7), None, False, None),
        "mask": ((2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 7), mask, False, None),
        "causal": ((2, 5, 4), (2, 5, 4), (2, 5, 3), None, True, None),
        "causal_rect": ((2, 3, 4), (2, 5, 4), (2, 5, 3), None, True, None),
        "scale": ((3, 4, 5), (3, 6, 5), (3, 6, 2), None, False, 0.3),
        "hidden_row": ((2, 4, 5), (2, 6, 5), (2, 6, 3), hidden_row, False, None),
    }
    for tag, (qs, ks, vs, m, causal, scale) in configs.items():
        q, k, v = leaf(*qs), leaf(*ks), leaf(*vs)
        y = sdpa(q, k, v, m, causal, scale)
        weighted_backward(y, f"sdpa_{tag}_y", out)
        out.update({f"sdpa_{tag}_q": q, f"sdpa_{tag}_k": k, f"sdpa_{tag}_v": v, f"sdpa_{tag}_y": y,
                    f"sdpa_{tag}_gq": q.grad, f"sdpa_{tag}_gk": k.grad, f"sdpa_{tag}_gv": v.grad})
        if m is not None:
            out[f"sdpa_{tag}_mask"] = m
        out[f"sdpa_{tag}_config"] = torch.tensor([int(causal), 0 if scale is None else 1])
        if scale is not None:
            out[f"sdpa_{tag}_scale"] = torch.tensor([scale])

    E, H, L, S, N = 8, 2, 4, 5, 3
    for batch_first in (False, True):
        tag = f"mha_bf{int(batch_first)}"
        mha = torch.nn.MultiheadAttention(E, H, batch_first=batch_first)
        shape = (lambda T: (N, T, E)) if batch_first else (lambda T: (T, N, E))
        q, k, v = leaf(*shape(L)), leaf(*shape(S)), leaf(*shape(S))
        padding = torch.zeros(N, S, dtype=torch.bool)
        padding[0, 4] = True
        padding[2, 1:3] = True
        attn_mask = torch.randn(L, S) * 0.5
        y, w = mha(q, k, v, key_padding_mask=padding, attn_mask=attn_mask)
        wy, ww = torch.rand_like(y) + 0.5, torch.rand_like(w) + 0.5
        ((y * wy).sum() + (w * ww).sum()).backward()
        out.update({f"{tag}_q": q, f"{tag}_k": k, f"{tag}_v": v, f"{tag}_y": y, f"{tag}_w": w,
                    f"{tag}_y_weight": wy, f"{tag}_w_weight": ww, f"{tag}_gq": q.grad, f"{tag}_gk": k.grad,
                    f"{tag}_gv": v.grad, f"{tag}_attn_mask": attn_mask,
                    f"{tag}_key_padding_mask": torch.zeros(N, S).masked_fill(padding, -inf)})
        for name, p in mha.named_parameters():
            out[f"{tag}_{name}"] = p.detach()
            out[f"{tag}_grad_{name}"] = p.grad
    tag = "mha_self"
    mha = torch.nn.MultiheadAttention(E, 4)
    x = leaf(L, N, E)
    y, w = mha(x, x, x, average_attn_weights=False)
    wy, ww = torch.rand_like(y) + 0.5, torch.rand_like(w) + 0.5
    ((y * wy).sum() + (w * ww).sum()).backward()
    out.update({f"{tag}_x": x, f"{tag}_y": y, f"{tag}_w": w, f"{tag}_y_weight": wy, f"{tag}_w_weight": ww,
                f"{tag}_gx": x.grad})
    for name, p in mha.named_parameters():
        out[f"{tag}_{name}"] = p.detach()
        out[f"{tag}_grad_{name}"] = p.grad
    save("attention", out)


def losses_ext():
    """Class weights for cross_entropy / nll_loss (with label smoothing and ignore_index), the
    elementwise losses (BCE with logits, L1, smooth L1, KL divergence) under every reduction, and
    Adam/AdamW with amsgrad and RMSprop trajectories (issue 18)."""
    torch.manual_seed(18)
    out = {}
    logits = torch.randn(7, 5)
    target = torch.tensor([0, 4, -100, 2, 1, 3, 2])
    weight = torch.rand(5) + 0.25
    out.update({"ce_logits": logits, "ce_target": target, "ce_weight": weight})
    red_names = ["none", "mean", "sum"]
    for s in (0.0, 0.2):
        for r in red_names:
            x = logits.clone().requires_grad_(True)
            y = F.cross_entropy(x, target, weight=weight, ignore_index=-100, reduction=r, label_smoothing=s)
            weighted_backward(y, f"ce_s{int(s * 10)}_{r}", out)
            out[f"ce_s{int(s * 10)}_{r}_y"] = y.reshape(-1)
            out[f"ce_s{int(s * 10)}_{r}_g"] = x.grad
    # an in-range ignore_index (class 2) with weights
    x = logits.clone().requires_grad_(True)
    y = F.cross_entropy(x, target.clamp(min=0), weight=weight, ignore_index=2, label_smoothing=0.1)
    y.backward()
    out.update({"ce_ign2_y": y.reshape(1), "ce_ign2_g": x.grad})
    lp = torch.log_softmax(torch.randn(7, 5), 1)
    out["nll_input"] = lp
    for r in red_names:
        for tag, w in (("w", weight), ("nw", None)):
            x = lp.clone().requires_grad_(True)
            y = F.nll_loss(x, target, weight=w, ignore_index=-100, reduction=r)
            weighted_backward(y, f"nll_{tag}_{r}", out)
            out[f"nll_{tag}_{r}_y"] = y.reshape(-1)
            out[f"nll_{tag}_{r}_g"] = x.grad
    a, b = torch.randn(4, 3) * 3, torch.rand(4, 3)
    b[0, 0] = 0.0
    b[1, 1] = 1.0
    bw, pw = torch.rand(3) + 0.5, torch.rand(3) * 2 + 0.5
    out.update({"pw_a": a, "pw_b": b, "bce_weight": bw, "bce_pos_weight": pw})
    kl_in = torch.log_softmax(torch.randn(4, 3), 1)
    out["kl_input"] = kl_in
    d = torch.randn(4, 3)
    d[0, 0], d[1, 1] = 0.0, 1.0
    out["l1_b"] = a - d  # exact ties and |a - b| == 1 (smooth L1's kink for beta 1)
    cases = {
        "bce": lambda x, r: F.binary_cross_entropy_with_logits(x, b, reduction=r),
        "bce_w": lambda x, r: F.binary_cross_entropy_with_logits(x, b, weight=bw, pos_weight=pw, reduction=r),
        "l1": lambda x, r: F.l1_loss(x, a - d, reduction=r),
        "sl1": lambda x, r: F.smooth_l1_loss(x, a - d, reduction=r),
        "sl1_b05": lambda x, r: F.smooth_l1_loss(x, a - d, reduction=r, beta=0.5),
        "sl1_b0": lambda x, r: F.smooth_l1_loss(x, a - d, reduction=r, beta=0.0),
    }
    for name, fn in cases.items():
        for r in red_names:
            x = a.clone().requires_grad_(True)
            y = fn(x, r)
            weighted_backward(y, f"{name}_{r}", out)
            out[f"{name}_{r}_y"] = y.reshape(-1)
            out[f"{name}_{r}_g"] = x.grad
    for log_target in (False, True):
        t = torch.log(b + 1e-3) if log_target else b
        for r in red_names + ["batchmean"]:
            x = kl_in.clone().requires_grad_(True)
            y = F.kl_div(x, t, reduction=r, log_target=log_target)
            tag = f"kl_{'log' if log_target else 'prob'}_{r}"
            weighted_backward(y, tag, out)
            out[tag + "_y"] = y.reshape(-1)
            out[tag + "_g"] = x.grad
    # optimizers over 10 steps
    init = torch.randn(6)
    grads = [torch.randn(6) * (1.0 + 0.5 * math.sin(i)) for i in range(10)]
    out["opt_init"] = init
    for i, g in enumerate(grads):
        out[f"opt_grad_{i}"] = g
    opts = {
        "adam_ams": lambda p: torch.optim.Adam([p], lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                                               amsgrad=True),
        "adamw_ams": lambda p: torch.optim.AdamW([p], lr=0.05, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=True),
        "rms": lambda p: torch.optim.RMSprop([p], lr=0.01),
        "rms_mom": lambda p: torch.optim.RMSprop([p], lr=0.01, alpha=0.9, momentum=0.9),
        "rms_centered": lambda p: torch.optim.RMSprop([p], lr=0.01, centered=True, eps=1e-6),
        "rms_all": lambda p: torch.optim.RMSprop([p], lr=0.02, alpha=0.95, momentum=0.5, centered=True,
                                                 weight_decay=0.05),
    }
    trajectories(opts, init, grads, out)
    save("losses_ext", out)


def norm_activations():
    """layer_norm / group_norm (values and gradients of x, weight, bias) and the activations of
    issue 18 (values and input gradients, NaN and infinities included)."""
    torch.manual_seed(18)
    out = {}

    def param(*shape, positive=False):
        t = torch.rand(*shape) + 0.5 if positive else torch.randn(*shape)
        return t.requires_grad_(True)

    def record(tag, fn, x, w, b):
        y = fn(x, w, b)
        weighted_backward(y, tag + "_y", out)
        out.update({tag + "_x": x, tag + "_y": y, tag + "_gx": x.grad})
        if w is not None:
            out.update({tag + "_weight": w, tag + "_bias": b, tag + "_gweight": w.grad, tag + "_gbias": b.grad})

    for tag, shape, k, affine in (("ln1", (4, 7), 1, True), ("ln2", (2, 3, 4, 5), 2, True),
                                  ("ln3", (3, 2, 3, 4), 3, True), ("ln_plain", (5, 6), 1, False)):
        norm_shape = shape[-k:]
        x = (torch.randn(*shape) * 2 + 0.5).requires_grad_(True)
        w, b = (param(*norm_shape, positive=True), param(*norm_shape)) if affine else (None, None)
        record(tag, lambda x, w, b: F.layer_norm(x, norm_shape, w, b, eps=1e-5), x, w, b)
    for tag, shape, groups, affine in (("gn2", (3, 6, 4, 5), 2, True), ("gn1", (2, 4, 3), 1, True),
                                       ("gnC", (2, 4, 3, 3), 4, True), ("gn_flat", (4, 6), 3, True),
                                       ("gn_plain", (2, 6, 5), 3, False)):
        x = (torch.randn(*shape) * 2 - 0.3).requires_grad_(True)
        w, b = (param(shape[1], positive=True), param(shape[1])) if affine else (None, None)
        record(tag, lambda x, w, b: F.group_norm(x, groups, w, b, eps=1e-5), x, w, b)

    # Activations: random values, the boundaries (hardtanh bounds, softplus threshold), NaN, +-inf.
    # The special values go one element at a time: PyTorch 1.13's vectorised CPU loops disagree with
    # its scalar loops (and its CUDA kernels) at NaN for the elu and hardtanh gradients (NaN and 0
    # against the gradient itself); the library follows the scalar/CUDA formula.
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, 1.0, -1.0, 0.5, -2.0, 2.5, 10.0,
                            25.0, -25.0, 100.0, -100.0])
    randoms = 40
    x = torch.cat([torch.randn(randoms) * 4, special])
    activations = {
        "silu": F.silu, "logsigmoid": F.logsigmoid,
        "leaky_relu": F.leaky_relu, "leaky_relu_02": lambda t: F.leaky_relu(t, 0.2),
        "elu": F.elu, "elu_15": lambda t: F.elu(t, 1.5),
        "hardtanh": F.hardtanh, "hardtanh_m2_05": lambda t: F.hardtanh(t, -2.0, 0.5),
        "softplus": F.softplus, "softplus_2_5": lambda t: F.softplus(t, 2.0, 5.0),
    }
    out["act_x"] = x
    out["act_grad"] = torch.linspace(0.5, 1.5, x.numel())
    for tag, fn in activations.items():
        ys, gs = [], []
        for part in [x[:randoms]] + [x[i:i + 1] for i in range(randoms, x.numel())]:
            xi = part.clone().requires_grad_(True)
            y = fn(xi)
            start = len(torch.cat(ys)) if ys else 0
            y.backward(out["act_grad"][start:start + part.numel()])
            ys.append(y.detach())
            gs.append(xi.grad)
        out["act_" + tag + "_y"] = torch.cat(ys)
        out["act_" + tag + "_gx"] = torch.cat(gs)
    save("norm_activations", out, {"eps": 1e-5})


def index_ops():
    """gather, scatter_add, masked_fill, cumsum, amax, topk, argmax/argmin, adaptive pools, embedding."""
    torch.manual_seed(18)
    out = {}

    def backward(y, tag):
        w = torch.rand_like(y) + 0.5
        (y * w).sum().backward()
        out[tag + "_w"] = w

    x = leaf(2, 3, 7, 9)
    y = F.adaptive_avg_pool2d(x, (3, 4))
    backward(y, "avg")
    out.update({"pool_x": x, "avg_y": y, "avg_gx": x.grad})
    x2 = x.detach().clone().requires_grad_(True)
    y2, i2 = F.adaptive_max_pool2d(x2, (3, 4), return_indices=True)
    backward(y2, "max")
    out.update({"max_y": y2, "max_i": i2, "max_gx": x2.grad})

    gx = leaf(4, 6)
    gi = torch.randint(0, 6, (3, 5))
    g = torch.gather(gx, 1, gi)
    backward(g, "g")
    out.update({"g_x": gx, "g_index": gi, "g_y": g, "g_gx": gx.grad})
    gx2 = gx.detach().clone().requires_grad_(True)
    src = leaf(4, 6)
    si = torch.randint(0, 4, (4, 6))
    s = torch.scatter_add(gx2, 0, si, src)
    backward(s, "s")
    out.update({"s_index": si, "s_src": src, "s_y": s, "s_gx": gx2.grad, "s_gsrc": src.grad})

    rx = leaf(3, 8, 4)
    c = torch.cumsum(rx, 1)
    backward(c, "cumsum")
    out.update({"r_x": rx, "cumsum_y": c, "cumsum_gx": rx.grad})
    rx2 = rx.detach().clone().requires_grad_(True)
    m = torch.amax(rx2, (0, 2))
    backward(m, "amax")
    out.update({"amax_y": m, "amax_gx": rx2.grad})
    rx3 = rx.detach().clone().requires_grad_(True)
    tv, ti = torch.topk(rx3, 3, dim=1, largest=True)
    backward(tv, "topk")
    out.update({"topk_y": tv, "topk_i": ti, "topk_gx": rx3.grad})
    out["argmax"] = torch.argmax(rx.detach()).reshape(1)
    out["argmin"] = torch.argmin(rx.detach()).reshape(1)

    ew = leaf(7, 3)
    ei = torch.tensor([[1, 4, 4, 0], [6, 1, 2, 4]])
    e = F.embedding(ei, ew, padding_idx=1)
    backward(e, "e")
    out.update({"e_weight": ew, "e_index": ei, "e_y": e, "e_gw": ew.grad})
    mx = leaf(3, 4)
    mask = (torch.rand(3, 1) > 0.5).float()
    mask[0, 0], mask[1, 0] = 1.0, 0.0
    mf = mx.masked_fill(mask.bool(), -2.5)
    backward(mf, "mf")
    out.update({"mf_x": mx, "mf_mask": mask, "mf_y": mf, "mf_gx": mx.grad})
    save("index_ops", out)


def mixed_precision():
    """bf16/f16 conversions (ties, subnormals, overflow, NaN), bf16 ops (PyTorch computes them in f32 and
    rounds once), and a Linear/ReLU/Linear + conv2d model trained one backward under
    torch.autocast("cpu", bfloat16)."""
    torch.manual_seed(1300)
    out = {}
    specials = torch.tensor([0.0, -0.0, 1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, 1.0 + 2**-11, 1.0 + 3 * 2**-11,
                             65504.0, 65519.0, 65520.0, 70000.0, -65520.0, 2**-14, 2**-24, 2**-25, 1.5 * 2**-25,
                             2**-26, 3 * 2**-25, 1e-40, float("inf"), -float("inf"), 3.4e38, 3.3961776e38,
                             float("nan"), 1 / 3, -2.5e-3])
    x = torch.cat([specials, torch.randn(300) * 100, torch.randn(100) * 1e-5, torch.randn(100) * 1e5])
    out.update({"conv_x": x, "conv_bf16": x.bfloat16(), "conv_f16": x.half()})

    a, b = torch.randn(4, 6), torch.randn(4, 6)
    ab, bb = a.bfloat16(), b.bfloat16()
    out.update({"op_a": ab, "op_b": bb, "op_add": ab + bb, "op_mul": ab * bb, "op_div": ab / bb,
                "op_relu": torch.relu(ab), "op_gelu": F.gelu(ab), "op_exp": torch.exp(ab), "op_tanh": torch.tanh(ab),
                "op_sum1": ab.sum(1), "op_mean": ab.mean(), "op_softmax": torch.softmax(ab, 1),
                "op_mm": ab @ bb.t(), "op_a16": a.half(), "op_b16": b.half(), "op_add_f16": a.half() + b.half()})

    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    xs, img, y = torch.randn(5, 6), torch.randn(5, 2, 4, 4), torch.randint(0, 3, (5,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = net(xs)
        c = conv(img)
        z = h + c.mean((2, 3))
        loss = F.cross_entropy(z, y)
    loss.backward()
    out.update({"ac_x": xs, "ac_img": img, "ac_y": y, "ac_h": h, "ac_c": c, "ac_loss": loss.float()})
    for name, p in list(net.named_parameters()) + [("conv." + n, q) for n, q in conv.named_parameters()]:
        out["ac_" + name] = p.detach()
        out["ac_" + name + ".grad"] = p.grad
    save("mixed_precision", out, {"torch": torch.__version__, "h_dtype": h.dtype, "c_dtype": c.dtype,
                                  "z_dtype": z.dtype, "loss_dtype": loss.dtype})


CASES = {"conv2d": conv2d, "pooling": pooling, "batch_norm": batch_norm, "lstm": lstm, "losses": losses,
         "optim": optimizers, "nan": nan_propagation, "adam_beta2": adam_beta2, "var_std": var_std,
         "attention": attention, "losses_ext": losses_ext, "norm_activations": norm_activations,
         "index_ops": index_ops, "mixed_precision": mixed_precision}

if __name__ == "__main__":
    # With no arguments every case is written; otherwise only the named ones. The first six cases draw
    # from one generator in sequence (write them together to reproduce their committed files); a case
    # added later calls torch.manual_seed at its start, so it can be written alone.
    import sys
    names = sys.argv[1:] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; known: {sorted(CASES)}")
    os.makedirs(OUT, exist_ok=True)
    for n in names:
        CASES[n]()
