"""A text classifier on nn.MultiheadAttention with a padding mask (the torch.nn way of writing attention).

lowconv model file: build_model() returns the model, example_inputs() its forward arguments.
"""
import torch
from torch import nn

LOGITS = True


class EncoderBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, padding):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=padding, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class TextClassifier(nn.Module):
    def __init__(self, vocab=1000, dim=64, depth=2, heads=4, classes=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([EncoderBlock(dim, heads) for _ in range(depth)])
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens, padding):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))


def build_model():
    return TextClassifier().eval()


def example_inputs():
    tokens = torch.randint(0, 1000, (4, 32))
    lengths = torch.tensor([32, 20, 9, 27])
    padding = torch.arange(32)[None, :] >= lengths[:, None]  # True = padding, ignored by attention
    return (tokens, padding)
