#!/usr/bin/python3
"""Parity data for the residual and attention targets (mapping/resnet.h, mapping/vit.h) from their
torch twins (tests/parity/torch_targets.py), for tests/test_resnet_targets.cpp and tests/test_vit_target.cpp.

Run by hand with Debian's python3-torch (1.13; torchvision is not installed, so the twins are written
in plain torch with torchvision's module names):

    build/examples/mn-train --target resnet20 --strategy direct --epochs 1 --limit 256 --batch-size 64 \
        --seed 7 --threads 2 --out /tmp/r20 --export tests/data/resnet20_weights.safetensors
    /usr/bin/python3 tests/parity/make_targets.py

The first command is how the committed tests/data/resnet20_weights.safetensors was made: our C++
side's export of a briefly trained resnet20 (so the BatchNorm running statistics are not the initial
zeros and ones). This script loads it into the twin with load_state_dict(strict=True): every name,
shape and buffer (num_batches_tracked included) must match, missing or unexpected ones fail. It then
writes tests/data/parity_resnet_targets.safetensors:
    input                 a fixed [4, 1, 28, 28] batch
    resnet20_eval         the twin's eval-mode output on it (running statistics)
    resnet20_train        its train-mode output (batch statistics), from a copy of the twin
    resnet20_running_mean_after  layer3.2.bn2.running_mean after that train-mode forward
and, in the metadata, each twin's named_parameters and named_buffers in torch's order, one
"name shape" per line (shape comma-separated, empty for a scalar): resnet20_parameters,
resnet20_buffers, resnet18_parameters, resnet18_buffers. No resnet18 weights are stored.

It also writes tests/data/parity_vit_target.safetensors: the default vit's names and shapes in the
metadata (vit_parameters), and a small ViT of the same structure (width 32, 2 blocks of 4 heads, MLP
64) with torch-initialised weights under "small.<name>", a fixed input and the twin's output
("small_output"), and the gradient of sum(output * output_weight) with respect to the input
("small_grad_input"), which the C++ side loads by name into mapping::VisionTransformer.
"""
import copy
import json
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_parity import OUT, save  # noqa: E402
from torch_targets import VisionTransformer, resnet18, resnet20, vit  # noqa: E402


def read_safetensors(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    dtypes = {"F32": torch.float32, "I64": torch.int64}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
    return out


def listing(named):
    return "\n".join(f"{name} {','.join(str(d) for d in t.shape)}" for name, t in named)


def main():
    torch.manual_seed(0)
    net = resnet20()
    print(net.load_state_dict(read_safetensors(os.path.join(OUT, "resnet20_weights.safetensors")), strict=True))
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        net.eval()
        y_eval = net(x)
        trained = copy.deepcopy(net).train()
        y_train = trained(x)
    r18 = resnet18()
    print("resnet20", sum(p.numel() for p in net.parameters()), "parameters;",
          "resnet18", sum(p.numel() for p in r18.parameters()))
    metadata = {
        "resnet20_parameters": listing(net.named_parameters()),
        "resnet20_buffers": listing(net.named_buffers()),
        "resnet18_parameters": listing(r18.named_parameters()),
        "resnet18_buffers": listing(r18.named_buffers()),
    }
    save("resnet_targets", {"input": x, "resnet20_eval": y_eval, "resnet20_train": y_train,
                            "resnet20_running_mean_after": trained.layer3[2].bn2.running_mean},
         metadata)


def vit_case():
    torch.manual_seed(1)
    small = VisionTransformer(width=32, depth=2, heads=4, mlp_dim=64)
    with torch.no_grad():  # a class token that is not all zeros, so its path is tested too
        small.class_token.normal_(std=0.5)
    x = torch.randn(3, 1, 28, 28, requires_grad=True)
    y = small(x)
    w = torch.rand_like(y) + 0.5
    (y * w).sum().backward()
    tensors = {f"small.{name}": t for name, t in small.state_dict().items()}
    tensors.update({"input": x, "small_output": y, "output_weight": w, "small_grad_input": x.grad})
    print("vit", sum(p.numel() for p in vit().parameters()), "parameters")
    save("vit_target", tensors, {"vit_parameters": listing(vit().named_parameters())})


if __name__ == "__main__":
    vit_case()
    main()
