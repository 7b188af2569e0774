"""A fourteenth set of user code, for tests/test_optimizer_user_models_fourteenth.py: hand-written and recent
optimizers and training-step mechanics, compiled together with the model's step, and two attention models whose
position terms are computed inside the compiled graph.

The earlier sets train with torch.optim's SGD, Adam and AdamW (tests/test_optimizer_user_models_third.py adds
clipping, parameter groups and Nesterov) and check torch.optim's foreach updates one by one
(tests/test_optimizer_correctness.py). These are the optimizers researchers write themselves, as their papers'
reference code does: Lion (the sign of an interpolated momentum, decoupled decay), LAMB (a per-parameter trust
ratio of norms, 1 where either norm is 0), Muon (Newton-Schulz orthogonalisation of 2-D momenta in bf16 with the
quintic coefficients, a transpose for tall matrices, scaled by sqrt(max(1, rows / cols)); AdamW for the vectors),
Sophia (the momentum over a clipped hessian estimate), schedule-free AdamW (y, z and x sequences by lerp),
a factored Adafactor with RMS clipping and a relative step written without .item(), and pure-bf16 weights updated
with Kahan compensation or with stochastic rounding by int32 bit manipulation (a hash of the bits as the noise,
so that the compiled step draws what eager draws). The training-step mechanics around them: a GradScaler-like
unscale with an isfinite check that skips the step by torch.where and backs the scale off, gradient accumulation
over micro-batches, an lr given as a 0-d tensor changed between steps, an EMA of the weights by lerp_, and SAM's
perturbation by the gradient over its global norm between two forward and backward passes.

The models: T5's relative-position buckets (log, floor by an int cast, min, where, both the bidirectional and the
causal form) indexing a learned bias, and ALiBi with slopes for a head count that is not a power of two (the
interleaved extra slopes), both computed in the compiled graph. Sizes are odd and tiny; inputs come from seeded
generators. Each model is a `tests.user_models.Case`; each optimizer a torch.optim.Optimizer.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case, classify
from tests.user_models_more import bf16, fp64, own_loss


# --- position terms computed in the graph --------------------------------------------------------------------

def relative_position_bucket(relative_position: Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> Tensor:
    """T5's bucket of each query-key offset, as Hugging Face's T5Attention computes it: exact buckets for small
    offsets, logarithmic ones up to max_distance, the sign in the upper half when bidirectional."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact)).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, if_large)


class T5RelativeAttention(nn.Module):
    """An encoder self-attention with T5's bidirectional bucketed bias and a decoder self-attention with the
    causal one, each bias a learned per-head table indexed by the buckets of the query-key offsets (computed
    from aranges in the forward, as T5 does); no scaling of the scores, RMS norms, a classifier on the mean."""

    def __init__(self, vocab: int = 29, dim: int = 12, heads: int = 3, buckets: int = 8, max_distance: int = 9,
                 classes: int = 3) -> None:
        super().__init__()
        self.heads, self.buckets, self.max_distance = heads, buckets, max_distance
        self.emb = nn.Embedding(vocab, dim)
        self.encoder_bias, self.decoder_bias = nn.Embedding(buckets, heads), nn.Embedding(buckets, heads)
        self.encoder_qkv, self.decoder_qkv = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, 3 * dim, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def position_bias(self, table: nn.Embedding, length: int, bidirectional: bool) -> Tensor:
        context = torch.arange(length, device=table.weight.device)[:, None]
        memory = torch.arange(length, device=table.weight.device)[None, :]
        bucket = relative_position_bucket(memory - context, bidirectional, self.buckets, self.max_distance)
        return table(bucket).permute(2, 0, 1)[None]                                  # (1, H, T, T)

    def attend(self, x: Tensor, qkv: nn.Linear, bias: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-1, -2) + bias, -1)
        return (weights @ v).transpose(1, 2).reshape(b, t, d)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        h = self.emb(idx)
        h = h + self.attend(self.norm1(h), self.encoder_qkv, self.position_bias(self.encoder_bias, t, True))
        causal = torch.triu(torch.full((t, t), float("-inf"), device=h.device, dtype=h.dtype), 1)
        h = h + self.attend(self.norm2(h), self.decoder_qkv, self.position_bias(self.decoder_bias, t, False) + causal)
        return self.head(h.mean(1))


def alibi_slopes(heads: int, device: torch.device) -> Tensor:
    """ALiBi's slopes as its reference code gives them for any head count: the geometric sequence of the
    largest power of two below `heads`, then every other slope of twice that many; here from aranges."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = base ** torch.arange(1, closest + 1, device=device, dtype=torch.float32)
    if closest < heads:
        extra = (2.0 ** (-4.0 / closest)) ** torch.arange(1, 2 * (heads - closest), 2, device=device,
                                                          dtype=torch.float32)
        slopes = torch.cat([slopes, extra])
    return slopes


class ALiBiDecoder(nn.Module):
    """A causal decoder block without position embeddings: the scores plus the slope times the (non-positive)
    key-minus-query distance, -inf above the diagonal by masked_fill; slopes for 6 heads, computed in the
    forward; LayerNorm, a SwiGLU MLP, the next-token cross-entropy."""

    def __init__(self, vocab: int = 23, dim: int = 18, heads: int = 6) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.gate, self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor, targets: Tensor) -> tuple:
        b, t = idx.shape
        x = self.emb(idx)
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        position = torch.arange(t, device=idx.device)
        distance = (position[None, :] - position[:, None]).to(x.dtype)
        bias = alibi_slopes(self.heads, idx.device).to(x.dtype)[:, None, None] * distance
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
        scores = scores.masked_fill(distance > 0, float("-inf"))
        x = x + self.proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, -1))
        h = self.ln2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class NormedMLP(nn.Module):
    """The model the optimizers train: matrices of both orientations (wide and tall, for Muon's transpose),
    a LayerNorm, biases (vectors, for the optimizers that treat them apart)."""

    def __init__(self, d: int = 7, hidden: int = 11, classes: int = 5) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(d, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.gelu(self.fc2(self.norm(torch.tanh(self.fc1(x))))))


# --- hand-written optimizers ---------------------------------------------------------------------------------

class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), as lucidrains' lion-pytorch writes it: decoupled decay, the sign of the
    interpolation of momentum and gradient, then the momentum's lerp_ toward the gradient."""

    def __init__(self, params, lr: float | Tensor = 1e-3, betas: tuple = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.clone().mul_(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update * -group["lr"])
                exp_avg.lerp_(p.grad, 1 - beta2)


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al. 2020): Adam's bias-corrected direction plus decoupled decay, scaled per parameter by
    the trust ratio |w| / |update|, 1 where either norm is 0 (torch.where, no .item())."""

    def __init__(self, params, lr: float = 1e-2, betas: tuple = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                step = state["step"]
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1 ** step)
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** step)
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(2), update.norm(2)
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * (-group["lr"] * trust))


def newton_schulz(g: Tensor, steps: int = 5) -> Tensor:
    """Muon's zeroth power of a matrix: five quintic Newton-Schulz iterations in bf16 with Keller Jordan's
    coefficients, on the transpose of a tall matrix, after normalising by the Frobenius norm."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon for the matrices (Nesterov momentum by lerp, orthogonalised by newton_schulz, scaled by
    sqrt(max(1, rows / cols)), decoupled decay) and AdamW for every other parameter, as modded-nanogpt groups
    them (a `use_muon` flag per group)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, adam_lr: float = 3e-3,
                 betas: tuple = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, momentum=momentum, adam_lr=adam_lr, betas=betas, eps=eps,
                                      weight_decay=weight_decay, use_muon=True))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if group["use_muon"]:
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf = state["momentum_buffer"]
                    buf.lerp_(p.grad, 1 - group["momentum"])
                    update = newton_schulz(p.grad.lerp(buf, group["momentum"]))
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update.to(p.dtype), alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)
                    continue
                if not state:
                    state["step"] = 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                beta1, beta2 = group["betas"]
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].lerp_(p.grad.square(), 1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** state["step"])).sqrt().add_(group["eps"])
                p.mul_(1 - group["adam_lr"] * group["weight_decay"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["adam_lr"] / (1 - beta1 ** state["step"]))


def muon_groups(model: nn.Module) -> list[dict]:
    """modded-nanogpt's split: the hidden matrices by Muon, the vectors and the output layer by AdamW."""
    hidden = [p for name, p in model.named_parameters() if p.dim() == 2 and not name.startswith("out")]
    rest = [p for name, p in model.named_parameters() if p.dim() != 2 or name.startswith("out")]
    return [{"params": hidden}, {"params": rest, "use_muon": False}]


class SophiaG(torch.optim.Optimizer):
    """Sophia (Liu et al. 2023), the reference code's update: decoupled decay, an EMA momentum, the ratio
    |m| / (rho * batch * h + eps) clipped at 1 times sign(m). The hessian estimate's EMA is refreshed every
    `interval` steps (`update_hessian`, here from the squared gradient, Sophia-G's estimator for a
    cross-entropy loss without its sampled labels)."""

    def __init__(self, params, lr: float = 1e-2, betas: tuple = (0.965, 0.99), rho: float = 0.04,
                 weight_decay: float = 0.1, batch: int = 9):
        super().__init__(params, dict(lr=lr, betas=betas, rho=rho, weight_decay=weight_decay, batch=batch))

    @torch.no_grad()
    def update_hessian(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self._state(p)
                state["hessian"].mul_(group["betas"][1]).addcmul_(p.grad, p.grad, value=1 - group["betas"][1])

    def _state(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["exp_avg"], state["hessian"] = torch.zeros_like(p), torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self._state(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].mul_(group["betas"][0]).add_(p.grad, alpha=1 - group["betas"][0])
                ratio = (state["exp_avg"].abs() / (group["rho"] * group["batch"] * state["hessian"] + 1e-15)
                         ).clamp(None, 1)
                p.addcmul_(state["exp_avg"].sign(), ratio, value=-group["lr"])


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """Schedule-free AdamW (Defazio et al. 2024), the reference's step in its train mode: the parameters hold
    y, the interpolation of the averaged x and the base z; the gradient at y, divided by Adam's bias-corrected
    denominator, plus decay at y, moves z; x is the running average of z with weight 1 / k, and y = lerp(z, x,
    beta1) is written back (warmup-free, so every weight is 1)."""

    def __init__(self, params, lr: float = 1e-2, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, k=0))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["k"] += 1
            k, (beta1, beta2) = group["k"], group["betas"]
            for y in group["params"]:
                state = self.state[y]
                if not state:
                    state["z"], state["x"] = y.clone(), y.clone()
                    state["exp_avg_sq"] = torch.zeros_like(y)
                z, x, v = state["z"], state["x"], state["exp_avg_sq"]
                v.mul_(beta2).addcmul_(y.grad, y.grad, value=1 - beta2)
                denom = (v / (1 - beta2 ** k)).sqrt_().add_(group["eps"])
                direction = y.grad / denom + group["weight_decay"] * y
                z.sub_(direction, alpha=group["lr"])
                x.lerp_(z, 1.0 / (k + 1))
                y.copy_(torch.lerp(z, x, beta1))


class FactoredAdafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer and Stern 2018) as fairseq writes it, every scalar a tensor (no .item(), so that the
    step compiles whole: torch.optim.Adafactor's per-parameter .item() calls send its step to eager): row and
    column means of g^2 + eps for matrices (a full second moment for vectors), beta2 = 1 - k^-0.8, the update
    RMS-clipped at `clip`, a relative step min(1e-2, 1/sqrt(k)) scaled by the parameter's RMS (at least 1e-3)."""

    def __init__(self, params, eps: float = 1e-30, clip: float = 1.0, decay_rate: float = -0.8):
        super().__init__(params, dict(eps=eps, clip=clip, decay_rate=decay_rate, k=0))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["k"] += 1
            k = group["k"]
            beta2 = 1.0 - k ** group["decay_rate"]
            for p in group["params"]:
                state = self.state[p]
                squared = p.grad * p.grad + group["eps"]
                if p.dim() == 2:
                    if not state:
                        state["row"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                        state["col"] = torch.zeros(p.shape[1], dtype=p.dtype, device=p.device)
                    state["row"].mul_(beta2).add_(squared.mean(-1), alpha=1 - beta2)
                    state["col"].mul_(beta2).add_(squared.mean(-2), alpha=1 - beta2)
                    row_factor = (state["row"] / state["row"].mean(-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    update = p.grad * row_factor * state["col"].rsqrt().unsqueeze(-2)
                else:
                    if not state:
                        state["second"] = torch.zeros_like(p)
                    state["second"].mul_(beta2).add_(squared, alpha=1 - beta2)
                    update = p.grad * state["second"].rsqrt()
                update.div_((update.pow(2).mean().sqrt() / group["clip"]).clamp_(min=1.0))
                scale = p.pow(2).mean().sqrt().clamp(min=1e-3) * min(1e-2, 1 / math.sqrt(k))
                p.sub_(update * scale)


class KahanSGD(torch.optim.Optimizer):
    """SGD with momentum on bf16 weights with Kahan compensation (as in "Revisiting BFloat16 Training"): the
    fp32 update minus the bf16 compensation buffer is added in fp32, rounded to bf16, and what the rounding lost
    becomes the new compensation."""

    def __init__(self, params, lr: float = 0.05, momentum: float = 0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                    state["compensation"] = torch.zeros_like(p)
                buf, comp = state["momentum"], state["compensation"]
                buf.mul_(group["momentum"]).add_(p.grad.float())
                update = -group["lr"] * buf - comp.float()
                new = p.float() + update
                rounded = new.to(torch.bfloat16)
                comp.copy_((rounded.float() - p.float()) - update)
                p.copy_(rounded)


def stochastic_round_to_bf16(x: Tensor, salt: int) -> Tensor:
    """fp32 to bf16 with stochastic rounding by bit manipulation: add 16 bits of noise to the fp32 bits (a
    multiplicative hash of the bits and `salt`, wrapping int32 arithmetic) and truncate to the top 16."""
    bits = x.view(torch.int32)
    mixed = bits * 1103515245 + (12345 + salt)
    noise = (mixed ^ (mixed >> 15)) & 0xFFFF
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW on bf16 weights with fp32 moments: the update computed in fp32 and stochastically rounded back
    to the bf16 weight (stochastic_round_to_bf16, salted by the step count)."""

    def __init__(self, params, lr: float = 1e-2, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, k=0))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["k"] += 1
            k, (beta1, beta2) = group["k"], group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                g = p.grad.float()
                state["exp_avg"].lerp_(g, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** k)).sqrt() + group["eps"]
                master = p.float() * (1 - group["lr"] * group["weight_decay"])
                master = master - group["lr"] / (1 - beta1 ** k) * state["exp_avg"] / denom
                p.copy_(stochastic_round_to_bf16(master, k))


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as davda54/sam writes it: `first_step` moves every parameter by rho times its
    gradient over the gradients' global norm (remembering the move), the caller's second forward and backward run
    at that point, `second_step` moves back and takes the base optimizer's step with the new gradients."""

    def __init__(self, params, base: type, rho: float = 0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base = base(self.param_groups, **kwargs)

    @torch.no_grad()
    def first_step(self) -> None:
        norm = torch.stack([p.grad.norm(2) for group in self.param_groups for p in group["params"]]).norm(2)
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                self.state[p]["old_p"] = p.clone()
                p.add_(p.grad * scale)

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.copy_(self.state[p]["old_p"])
        self.base.step()


class DynamicLossScaler:
    """torch.amp.GradScaler's mechanics by hand and without .item(), around SGD with momentum whose lr is a 0-d
    tensor (changed in place between steps, so the compiled step reads it): `step` unscales every gradient by
    1 / scale, checks that all are finite, moves the momenta and parameters only where they are (torch.where),
    halves the scale after an overflow and doubles it after `interval` clean steps in a row."""

    def __init__(self, params, lr: Tensor, momentum: float = 0.9, scale: float = 2.0 ** 12, interval: int = 2):
        self.params, self.lr, self.momentum, self.interval = list(params), lr, momentum, interval
        self.scale = torch.tensor(scale)
        self.clean_steps = torch.zeros((), dtype=torch.int64)
        self.momenta = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        inverse = self.scale.double().reciprocal().float()
        finite = torch.stack([torch.isfinite(p.grad).all() for p in self.params]).all()
        for p, buf in zip(self.params, self.momenta):
            moved = buf * self.momentum + p.grad * inverse
            buf.copy_(torch.where(finite, moved, buf))
            p.sub_(torch.where(finite, self.lr * moved, torch.zeros_like(p)))
        self.clean_steps.copy_(torch.where(finite, self.clean_steps + 1, 0))
        grow = self.clean_steps >= self.interval
        self.scale.copy_(torch.where(finite, torch.where(grow, self.scale * 2, self.scale), self.scale * 0.5))
        self.clean_steps.copy_(torch.where(grow, 0, self.clean_steps))


# --- the cases -----------------------------------------------------------------------------------------------

def _tokens(vocab: int, n: int = 2, t: int = 9):
    def batch(g: torch.Generator) -> tuple:
        return (torch.randint(0, vocab, (n, t), generator=g),), torch.randint(0, 3, (n,), generator=g)
    return batch


def _next_tokens(g: torch.Generator) -> tuple:
    idx = torch.randint(0, 23, (2, 10), generator=g)
    return (idx, torch.roll(idx, -1, 1)), None


def cases() -> list[Case]:
    t5 = Case("t5_relative_buckets", T5RelativeAttention, _tokens(29), classify)
    alibi = Case("alibi_six_heads", ALiBiDecoder, _next_tokens, own_loss)
    return [t5, alibi, bf16(alibi), fp64(t5)]
