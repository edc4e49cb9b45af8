"""PyTorch twins of the library's built-in targets (mapping/targets.h), with the same parameter and
buffer names (torchvision's for the ResNets and the ViT), so weights exported by mn-train load into them
with load_state_dict(strict=True). Plain torch: Debian ships no torchvision. Used by
tests/parity/make_targets.py (the targets' parity data) and bench/compare_torch.py.
"""
import collections

import torch
import torch.nn as nn
import torch.nn.functional as F


def cnn2():
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))


def cnn1():
    return nn.Sequential(nn.Conv2d(1, 32, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(64, 128, 3, 1, 1), nn.ReLU(),
                         nn.Conv2d(128, 128, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(1152, 256), nn.ReLU(), nn.Linear(256, 10))


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a skip; a 1x1 convolution + BatchNorm ("downsample")
    where the stride or the width changes, as torchvision names it."""

    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.downsample = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.downsample is None else self.downsample(x)
        return F.relu(out + skip)


class ResNet(nn.Module):
    """3x3 stride-1 stem for 1x28x28 inputs, stages of BasicBlocks, global average pool, fc."""

    def __init__(self, widths, blocks, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        inputs = widths[0]
        for stage, (width, count) in enumerate(zip(widths, blocks)):
            layers = []
            for b in range(count):
                layers.append(BasicBlock(inputs, width, 2 if (stage > 0 and b == 0) else 1))
                inputs = width
            setattr(self, f"layer{stage + 1}", nn.Sequential(*layers))
        self.stages = len(widths)
        self.fc = nn.Linear(inputs, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        for stage in range(self.stages):
            x = getattr(self, f"layer{stage + 1}")(x)
        return self.fc(x.mean(dim=(2, 3)))


def resnet20():
    return ResNet([16, 32, 64], [3, 3, 3])


def resnet18():
    return ResNet([64, 128, 256, 512], [2, 2, 2, 2])


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attention(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, width, heads, mlp_dim):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_dim), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp_dim, width),
                                 nn.Dropout(0.0))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, tokens, width, depth, heads, mlp_dim):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, width).normal_(std=0.02))
        self.layers = nn.Sequential(collections.OrderedDict(
            (f"encoder_layer_{i}", EncoderBlock(width, heads, mlp_dim)) for i in range(depth)))
        self.ln = nn.LayerNorm(width, eps=1e-6)

    def forward(self, x):
        return self.ln(self.layers(x + self.pos_embedding))


class VisionTransformer(nn.Module):
    """4x4 patches of a 1x28x28 image -> 49 tokens plus a class token, width 128, 4 blocks of 4 heads,
    MLP 512; torchvision's names (conv_proj, class_token, encoder.*, heads.head)."""

    def __init__(self, patch=4, width=128, depth=4, heads=4, mlp_dim=512, classes=10):
        super().__init__()
        self.width = width
        self.conv_proj = nn.Conv2d(1, width, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        tokens = (28 // patch) ** 2 + 1
        self.encoder = Encoder(tokens, width, depth, heads, mlp_dim)
        self.heads = nn.Sequential(collections.OrderedDict(head=nn.Linear(width, classes)))

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


def vit():
    return VisionTransformer()


TARGETS = {"cnn2": cnn2, "mlp": mlp, "resnet20": resnet20, "resnet18": resnet18, "vit": vit}
