"""
Train a small GPT on generated text, with tfsn's checkpoint-restart and telemetry, its step compiled by
tfsn's kernel optimizer (`tfsn.optimize`): under `tfsn launch` the plan searched for this CPU by `tfsn plan`
(train.yaml's `model.entry` names `build` below), so the workers search nothing.

    tfsn launch examples/tiny-gpt/train.yaml              # 2 nodes x 1 worker on this machine
    python examples/tiny-gpt/train.py                     # one process, no controller
    torchrun --nproc-per-node 2 examples/tiny-gpt/train.py

Nothing is downloaded: the corpus is made from a seeded grammar of short sentences and sums,
so every rank of every run sees the same data in the same order, and a run restarted from a
checkpoint ends with the same weights, bit for bit, as one that never stopped.
Any setting below can be overridden from the environment: STEPS=50 python train.py
"""
import math
import os
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import tfsn

# -----------------------------------------------------------------------------
# config (each can be set as an environment variable of the same name, upper case)
seed = 1337
steps = 300            # total optimizer steps (tfsn passes `steps` from train.yaml)
batch_size = 16        # sequences per rank per step
block_size = 64        # context length
n_layer = 2
n_head = 4
n_embd = 128
dropout = 0.0
learning_rate = 3e-3
min_lr = 3e-4
warmup_steps = 20
weight_decay = 0.1
grad_clip = 1.0
optimize = 1           # 1: the step compiled by tfsn.optimize; 0: eager PyTorch (OPTIMIZE=0 python train.py)
log_interval = 10      # steps between loss lines (rank 0)
corpus_chars = 200_000
for _name, _default in list(globals().items()):
    if not _name.startswith("_") and isinstance(_default, (int, float)) and _name.upper() in os.environ:
        globals()[_name] = type(_default)(os.environ[_name.upper()])
if "TFSN_STEPS" in os.environ:
    steps = int(os.environ["TFSN_STEPS"])
# -----------------------------------------------------------------------------


def make_corpus(n_chars: int, rng: random.Random) -> str:
    """Short sentences from a tiny grammar, and sums with their answers: learnable structure."""
    names = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal"]
    verbs = ["sees", "likes", "helps", "finds", "calls", "meets"]
    things = ["the cat", "a dog", "the red ball", "a small box", "the old tree", "a blue cup"]
    parts, length = [], 0     # the length so far kept, not summed again per sentence (quadratic: 3 s at 200k chars)
    while length < n_chars:
        if rng.random() < 0.5:
            parts.append(f"{rng.choice(names)} {rng.choice(verbs)} {rng.choice(things)}. ")
        else:
            a, b = rng.randrange(50), rng.randrange(50)
            parts.append(f"{a}+{b}={a + b}. ")
        length += len(parts[-1])
    return "".join(parts)[:n_chars]


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention()
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        for module in self.modules():      # small init (GPT-2): keeps the first logits near uniform
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(self.ln_f(self.blocks(x)))  # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def lr_at(step):
    """Linear warmup, then cosine decay to min_lr; a function of the step, so resuming needs no state."""
    if step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return min_lr + 0.5 * (learning_rate - min_lr) * (1 + math.cos(math.pi * progress))


def batch(data, step, rank):
    """The batch of `rank` at `step`: a pure function of both, so a restarted run sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[s:s + block_size] for s in starts])
    y = torch.stack([data[s + 1:s + block_size + 1] for s in starts])
    return x, y


def build():
    """The model, one rank's batch and the loss (None: the model returns it): what `model.entry` names in
    train.yaml, so that `tfsn plan` prices this very step on every hardware type."""
    text = make_corpus(corpus_chars, random.Random(seed))
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    torch.manual_seed(seed)
    return GPT(len(chars)), batch(data, 0, 0), None


def main():
    run = tfsn.init(checkpoint_interval=50, steps=steps)
    text = make_corpus(corpus_chars, random.Random(seed))
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    torch.manual_seed(seed)
    model = GPT(len(chars))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.95))
    if run.world_size > 1:
        model = DDP(model)
    # The same computation as eager, as generated kernels; its first call captures and compiles the step.
    step_loss = tfsn.optimize(model) if optimize else model
    n_params = sum(p.numel() for p in model.parameters())
    start = run.restore(model=model, optimizer=optimizer)
    if run.rank == 0:
        print(f"{n_params / 1e6:.2f}M parameters, vocab {len(chars)}, {run.world_size} rank(s), "
              f"{torch.get_num_threads()} thread(s) each, starting at step {start} of {steps}", flush=True)

    tokens_per_step = batch_size * block_size * run.world_size
    t0, last = time.perf_counter(), start
    for step in run.steps(start, steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        x, y = batch(data, step, run.rank)
        loss = step_loss(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        run.log(loss=loss)
        run.checkpoint(model=model, optimizer=optimizer)
        if run.rank == 0 and (step % log_interval == 0 or step == steps - 1):
            dt = (time.perf_counter() - t0) / (step + 1 - last)
            print(f"step {step}: loss {loss.item():.4f}, {dt * 1000:.0f} ms/step, "
                  f"{tokens_per_step / dt:,.0f} tok/s", flush=True)
            t0, last = time.perf_counter(), step + 1
    run.finish()


if __name__ == "__main__":
    main()
