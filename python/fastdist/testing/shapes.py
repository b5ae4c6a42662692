"""A generated image set for convergence experiments: grey images of 8 shape classes (bars at four angles, box,
disc, cross, ring) at random positions and sizes, with noise. No files, no downloads: a function of (n, seed)."""
from __future__ import annotations

import math

import torch

from fastdist.testing.corpus import generator


def shapes_dataset(n: int, seed: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """n images [n, 1, size, size] of 8 classes and their labels; a function of (n, seed) only."""
    g = generator("shapes", seed, n)
    labels = torch.randint(0, 8, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")
    cy = 4 + torch.rand(n, generator=g) * (size - 8)
    cx = 4 + torch.rand(n, generator=g) * (size - 8)
    r = 2.5 + torch.rand(n, generator=g) * 2.5
    dy, dx = yy[None] - cy[:, None, None], xx[None] - cx[:, None, None]
    rr = r[:, None, None]
    dist = (dx ** 2 + dy ** 2).sqrt()
    masks = []
    for angle in (0.0, math.pi / 4, math.pi / 2, 3 * math.pi / 4):  # bars
        along = dx * math.cos(angle) + dy * math.sin(angle)
        across = -dx * math.sin(angle) + dy * math.cos(angle)
        masks.append((along.abs() <= rr) & (across.abs() <= 0.8))
    masks.append((dx.abs() <= rr) & (dy.abs() <= rr) & ((dx.abs() >= rr - 1) | (dy.abs() >= rr - 1)))  # box
    masks.append(dist <= rr * 0.8)  # disc
    masks.append(((dx.abs() <= 0.8) | (dy.abs() <= 0.8)) & (dx.abs() <= rr) & (dy.abs() <= rr))  # cross
    masks.append((dist <= rr) & (dist >= rr - 1.2))  # ring
    img = torch.stack(masks, 1)[torch.arange(n), labels].float()
    img = img * (0.6 + 0.4 * torch.rand(n, 1, 1, generator=g)) + 0.25 * torch.randn(n, size, size, generator=g)
    return img[:, None], labels
