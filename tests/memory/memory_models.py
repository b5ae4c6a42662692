"""Small models shared by the memory tests: an MLP, a CNN and a transformer, each a stack of named blocks."""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width=256, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CNN(nn.Module):
    def __init__(self, channels=16):
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()),
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                          nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU()),
        ])
        self.head = nn.Linear(2 * channels, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


class Transformer(nn.Module):
    def __init__(self, vocab=128, dim=64, heads=4, layers=2, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=dropout, batch_first=True)
            for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(kind, seed=0):
    """(model, example input) of a given kind, seeded."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(), torch.randn(64, 256)
    if kind == "cnn":
        return CNN(), torch.randn(8, 3, 32, 32)
    if kind == "transformer":
        return Transformer(), torch.randint(0, 128, (8, 32))
    raise ValueError(kind)


def loss_of(output):
    return output.float().square().mean()
