#!/usr/bin/python3
"""Loads weights that mn-train exported (OUT/weights.safetensors) into the same network in PyTorch with
load_state_dict(strict=True) and measures its test accuracy on Fashion-MNIST, normalised as mn-train
does, to compare with the accuracy mn-train reported.

    mn-train --target cnn2 --strategy layerwise --latent-dim 64 --epochs 1 --limit 2000 --json --out /tmp/x
    tests/parity/check_export.py --target cnn2 --weights /tmp/x/weights.safetensors --limit 2000

Not run by CI (CI has no Python); Debian's python3-torch provides torch. The safetensors file is read
directly (Debian 12 packages no safetensors module): 8-byte header length, JSON header, raw data.
"""
import argparse
import gzip
import json
import os
import struct

import torch
import torch.nn as nn

MEAN, STD = 0.2860, 0.3530  # the training split's statistics (nn/data/fashion_mnist.h)


def targets(name, hidden):
    if name == "cnn2":
        return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))
    if name == "mlp":
        layers, width = [nn.Flatten()], 784
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        return nn.Sequential(*layers, nn.Linear(width, 10))
    raise SystemExit(f"unknown target {name}")


def read_safetensors(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] != "F32":
            raise SystemExit(f"{name}: dtype {entry['dtype']}, expected F32")
        begin, end = entry["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.float32).reshape(entry["shape"])
    return out


def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = struct.unpack(">" + "I" * dims, raw[4:4 + 4 * dims])
    return torch.frombuffer(bytearray(raw[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="cnn2")
    p.add_argument("--mlp-hidden", default="256,256")
    p.add_argument("--weights", required=True)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--data", default=os.environ.get("MN_FASHION_MNIST_DIR") or "/usr/share/datasets/fashion-mnist")
    a = p.parse_args()
    net = targets(a.target, [int(h) for h in a.mlp_hidden.split(",")])
    print(net.load_state_dict(read_safetensors(a.weights), strict=True))
    images = read_idx(os.path.join(a.data, "t10k-images-idx3-ubyte.gz")).float().div(255).unsqueeze(1)
    labels = read_idx(os.path.join(a.data, "t10k-labels-idx1-ubyte.gz")).long()
    if a.limit > 0:
        images, labels = images[:a.limit], labels[:a.limit]
    net.eval()
    with torch.no_grad():
        correct = (net((images - MEAN) / STD).argmax(1) == labels).sum().item()
    print(json.dumps({"test_accuracy": correct / len(labels), "images": len(labels)}))


if __name__ == "__main__":
    main()
