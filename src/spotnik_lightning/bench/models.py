"""Models for the benchmarks: a real ResNet-50 (small images) and parameter-shape stand-ins.

``resnet50()`` is the real architecture (bottleneck blocks [3, 4, 6, 3], 25.6 M parameters).
``shaped(name)`` builds a module holding parameters with the *shapes* of a well-known network —
ResNet-50, VGG-16, BERT-base exactly; Inception-V3 by its layer and parameter counts (94 convolutions
with batch norm, 23.8 M parameters) — whose forward costs one multiply-add per parameter. Those
measure what the synchronisation costs (buckets, all-reduce, commit) with as little compute to
hide it behind as possible, i.e. the least favourable case for an atomic commit.
"""

from __future__ import annotations

import torch
from torch import nn


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet50(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(_Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, classes)]
    return nn.Sequential(*layers)


def _resnet50_shapes() -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in resnet50().parameters()]


def _vgg16_shapes() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    cin = 3
    for c in (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512):
        shapes += [(c, cin, 3, 3), (c,)]
        cin = c
    for fin, fout in ((25088, 4096), (4096, 4096), (4096, 1000)):
        shapes += [(fout, fin), (fout,)]
    return shapes


def _bert_base_shapes() -> list[tuple[int, ...]]:
    h, ff = 768, 3072
    shapes: list[tuple[int, ...]] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,)]


def _inception_v3_shapes() -> list[tuple[int, ...]]:
    # 94 conv layers (+ batch-norm scale/shift) and the 2048 x 1000 classifier; widths grow like the
    # real network's, scaled so the total is Inception-V3's 23.8 M parameters.
    shapes: list[tuple[int, ...]] = []
    cin, target = 3, 23_800_000 - 2048 * 1000 - 1000
    widths = [32, 32, 64, 80, 192] + [64, 96, 128, 160, 192] * 8 + [320, 384, 448] * 17
    widths = widths[:94]
    raw = []
    for w in widths:
        raw.append((w, cin))
        cin = w
    scale = (target / sum(w * c * 9 for w, c in raw)) ** 0.5
    cin = 3
    for w, _ in raw:
        w2 = max(8, int(w * scale))
        shapes += [(w2, cin, 3, 3), (w2,), (w2,)]
        cin = w2
    return shapes + [(1000, 2048), (1000,)]


SHAPES = {"resnet50": _resnet50_shapes, "vgg16": _vgg16_shapes, "inception_v3": _inception_v3_shapes,
          "bert_base": _bert_base_shapes}


class Shaped(nn.Module):
    """Parameters with a named network's shapes; ``forward(x)`` = Σ_p <p, x_p> with x_p from the
    batch scalar, so backward writes one gradient per parameter at one flop per element."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in SHAPES:
            raise ValueError(f"unknown model shape {name!r}; one of {sorted(SHAPES)}")
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(*s, generator=g) * 0.01) for s in SHAPES[name]())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.mean()
        return sum((p * scale).sum() for p in self.ps) / len(self.ps)  # type: ignore[return-value]


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
