"""Models and inputs for `tfsn optimize`: each FN returns a model, or a tuple of example inputs.

    tfsn optimize --model examples/optimize/models.py:gpt2_block --inputs examples/optimize/models.py:gpt2_inputs
    tfsn optimize --model examples/optimize/models.py:gpt2_block --inputs examples/optimize/models.py:gpt2_inputs --hardware h100
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

EMBD, HEADS, SEQ, BATCH = 192, 4, 116, 12


class Block(nn.Module):
    """A GPT-2 block: pre-norm causal self-attention and a GELU MLP, with residuals."""

    def __init__(self, n_embd: int = EMBD, n_head: int = HEADS) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.fc, self.out = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def gpt2_block() -> nn.Module:
    torch.manual_seed(0)
    return Block()


def gpt2_inputs() -> tuple:
    return (torch.randn(BATCH, SEQ, EMBD),)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256))


def mlp_inputs() -> tuple:
    return (torch.randn(512, 256),)
