#!/usr/bin/python3
"""The torch twins of the residual targets (mapping/resnet.h), for tests/test_resnet_targets.cpp.

Run by hand with Debian's python3-torch (1.13; torchvision is not installed, so the twins are written
here in plain torch with torchvision's module names):

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
"""
import copy
import json
import os
import struct
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_parity import OUT, save  # noqa: E402


class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """torchvision.models.ResNet's names, with a 3x3 stride-1 stem and no max pool."""

    def __init__(self, widths, blocks, in_channels=1, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        planes = widths[0]
        for k, (width, count) in enumerate(zip(widths, blocks)):
            stage = []
            for i in range(count):
                stage.append(BasicBlock(planes, width, 2 if k > 0 and i == 0 else 1))
                planes = width
            setattr(self, f"layer{k + 1}", nn.Sequential(*stage))
        self.stages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(planes, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        for k in range(self.stages):
            x = getattr(self, f"layer{k + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet20():
    return ResNet([16, 32, 64], [3, 3, 3])


def resnet18():
    return ResNet([64, 128, 256, 512], [2, 2, 2, 2])


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


if __name__ == "__main__":
    main()
