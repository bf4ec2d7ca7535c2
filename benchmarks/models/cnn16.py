"""A small ResNet-style CNN as a user would write it: a stem, 16 residual blocks with batch norm, a
classifier head; CIFAR-sized inputs. benchmarks/bench_fidelity.py runs its closed loop on it (a model
the cost model and its calibration were not tuned on):

    OMP_NUM_THREADS=1 python benchmarks/bench_fidelity.py --model benchmarks/models/cnn16.py:build
"""
import torch
from torch import nn
from harmony_opt.measure.decompose import LayeredModel, decompose


class Stem(nn.Sequential):
    pass


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + self.skip(x))


class Head(nn.Sequential):
    pass


def build():
    widths = [32] * 4 + [64] * 4 + [128] * 4 + [256] * 4
    blocks, cin = [], 32
    for i, w in enumerate(widths):
        blocks.append(Block(cin, w, 2 if (i % 4 == 0 and i > 0) else 1))
        cin = w
    net = nn.Sequential(Stem(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()), *blocks,
                        Head(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10)))
    layers = decompose(net, nn.CrossEntropyLoss(), split_at=(Stem, Block, Head))
    return LayeredModel("cnn16", layers, make_batch=lambda b, g: (torch.randn(b, 3, 32, 32, generator=g),
                                                                  torch.randint(0, 10, (b,), generator=g)))
