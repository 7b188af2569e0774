"""A ninth set of models written the way users write them, for tests/test_optimizer_user_models_ninth.py.

The earlier sets cover transformers, convnets, recurrent and state-space sequence models, generative, scientific
and detection models and many losses. These are the training objectives of reinforcement learning, quantization-
aware training, tabular and recommender models and probabilistic heads, written as their reference
implementations are: PPO's clipped surrogate with torch.distributions (Categorical and Normal log_prob and
entropy), advantage normalisation, value clipping and GAE computed by a reversed Python loop over time writing
into a buffer in place; a recurrent policy (an LSTMCell stepped in a loop, its state reset at episode ends)
with invalid actions masked out of a Categorical; SAC's tanh-squashed Normal with the log-det correction by softplus, twin critics and a
learned temperature; DQN (gather of the chosen actions, double-DQN targets from a target network read under
no_grad, a Huber loss) with the target network updated by lerp_ (Polyak averaging) inside forward; fake
quantization with the straight-through estimator (x + (q - x).detach()), torch.fake_quantize_per_tensor_affine
and per_channel_affine, LSQ's learned step with its gradient scale; an FT-Transformer feature tokenizer (a
per-feature weight and bias, categorical embeddings by offsets, a CLS token); TabNet-style sparsemax and
entmax-1.5 by hand (sort, cumsum, support thresholds, gather); DLRM (nn.EmbeddingBag in sum mode with
per_sample_weights and in mean mode, pairwise dot interactions picked by torch.triu_indices), factorization
machines and DCN-v2 cross layers; a VAE-style head with KL between Normals by torch.distributions.kl_divergence,
a hard Gumbel-softmax by hand on given noise, label smoothing, a focal cross-entropy with ignore_index and
losses in the options the earlier sets do not use. Noise is an input (drawn from the batch's generator), so
every case is deterministic. Sizes are odd and tiny. Each model comes as a `tests.user_models.Case`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributions import Categorical, Normal, kl_divergence

from tests.user_models import Case, classify
from tests.user_models_more import bf16, fp64, own_loss


def mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


# --- reinforcement learning -------------------------------------------------------------------------------

class PPOCategoricalGAE(nn.Module):
    """CleanRL's PPO update for discrete actions on a rollout (T steps of N environments): the critic's values
    (detached) give GAE advantages by a reversed loop over time, written into a buffer in place; advantages are
    normalised; the policy loss is the clipped surrogate on Categorical log-probs, minus an entropy bonus."""

    def __init__(self, d: int = 5, actions: int = 4, hidden: int = 7, gamma: float = 0.9, lam: float = 0.8,
                 clip: float = 0.2) -> None:
        super().__init__()
        self.actor, self.critic = mlp(d, hidden, actions), mlp(d, hidden, 1)
        self.gamma, self.lam, self.clip = gamma, lam, clip

    def forward(self, obs: Tensor, actions: Tensor, old_logp: Tensor, rewards: Tensor, dones: Tensor) -> tuple:
        T, N = rewards.shape                                        # obs (T + 1, N, d): the last is bootstrap
        values = self.critic(obs).squeeze(-1)                       # (T + 1, N)
        with torch.no_grad():
            next_values = values.detach()
            advantages = torch.zeros_like(rewards)
            last = torch.zeros(N, dtype=rewards.dtype)
            for t in reversed(range(T)):
                nonterminal = 1.0 - dones[t].float()
                delta = rewards[t] + self.gamma * next_values[t + 1] * nonterminal - next_values[t]
                last = delta + self.gamma * self.lam * nonterminal * last
                advantages[t] = last
            returns = advantages + next_values[:-1]
        logits = self.actor(obs[:-1])
        dist = Categorical(logits=logits)
        logp = dist.log_prob(actions)
        ratio = (logp - old_logp).exp()
        adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        surrogate = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - self.clip, 1 + self.clip)).mean()
        value_loss = 0.5 * ((values[:-1] - returns) ** 2).mean()
        return logits, surrogate + 0.5 * value_loss - 0.01 * dist.entropy().mean()


class PPOGaussian(nn.Module):
    """PPO for continuous actions (the SB3 / CleanRL continuous form): a state-independent log_std parameter,
    Normal(mean, std).log_prob summed over action dims, the clipped value loss around the rollout's values,
    a ratio-clipping fraction metric read under no_grad, and the approximate KL (k3) folded into the loss."""

    def __init__(self, d: int = 6, act: int = 3, hidden: int = 9, clip: float = 0.25) -> None:
        super().__init__()
        self.mean, self.value = mlp(d, hidden, act), mlp(d, hidden, 1)
        self.log_std = nn.Parameter(torch.full((1, act), -0.3))
        self.clip = clip

    def forward(self, obs: Tensor, actions: Tensor, old_logp: Tensor, advantages: Tensor, returns: Tensor,
                old_values: Tensor) -> tuple:
        mean = self.mean(obs)
        dist = Normal(mean, self.log_std.expand_as(mean).exp())
        logp = dist.log_prob(actions).sum(-1)
        log_ratio = logp - old_logp
        ratio = log_ratio.exp()
        with torch.no_grad():
            clipped_fraction = ((ratio - 1.0).abs() > self.clip).float().mean()
        approx_kl = ((ratio - 1) - log_ratio).mean()
        adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        pg = -torch.min(adv * ratio, adv * ratio.clamp(1 - self.clip, 1 + self.clip)).mean()
        v = self.value(obs).squeeze(-1)
        v_clipped = old_values + torch.clamp(v - old_values, -self.clip, self.clip)
        v_loss = 0.5 * torch.max((v - returns) ** 2, (v_clipped - returns) ** 2).mean()
        loss = pg + 0.5 * v_loss - 1e-3 * dist.entropy().sum(-1).mean() + 0.1 * approx_kl
        return mean, loss + 0.0 * clipped_fraction


class RecurrentMaskedPolicy(nn.Module):
    """A recurrent actor-critic as PPO-LSTM implementations write it: an LSTMCell stepped over the rollout in a
    Python loop, its state zeroed where the previous step ended an episode; invalid actions masked out of the
    logits with the dtype's lowest value (masked_fill) before Categorical, whose entropy then counts only the
    valid ones; A2C's loss (policy gradient on detached advantages, value MSE, entropy bonus)."""

    def __init__(self, d: int = 4, hidden: int = 6, actions: int = 5) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(d, hidden)
        self.pi, self.v = nn.Linear(hidden, actions), nn.Linear(hidden, 1)

    def forward(self, obs: Tensor, dones: Tensor, valid: Tensor, actions: Tensor, returns: Tensor) -> tuple:
        T, N, _ = obs.shape
        h = c = obs.new_zeros(N, self.cell.hidden_size)
        hs = []
        for t in range(T):
            keep = (~dones[t]).to(obs.dtype).unsqueeze(-1)
            h, c = self.cell(obs[t], (h * keep, c * keep))
            hs.append(h)
        hs = torch.stack(hs)                                        # (T, N, hidden)
        logits = self.pi(hs)
        logits = logits.masked_fill(~valid, torch.finfo(logits.dtype).min)
        dist = Categorical(logits=logits)
        values = self.v(hs).squeeze(-1)
        advantages = (returns - values).detach()
        loss = -(dist.log_prob(actions) * advantages).mean() + 0.5 * F.mse_loss(values, returns) \
            - 0.01 * dist.entropy().mean()
        return logits, loss


class SACActor(nn.Module):
    """SAC's actor and temperature losses: mean and log_std heads (log_std squashed by tanh into a range),
    a reparameterized sample from given unit noise, a = tanh(u), log pi = Normal.log_prob(u) minus the tanh
    correction 2 (log 2 - u - softplus(-2u)); twin critics on (s, a) with the minimum taken; alpha = exp(log
    alpha) detached in the actor loss, and the temperature loss on the detached log-prob."""

    def __init__(self, d: int = 5, act: int = 2, hidden: int = 8, min_log_std: float = -5.0,
                 max_log_std: float = 2.0) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, hidden), nn.ReLU())
        self.mu, self.log_std = nn.Linear(hidden, act), nn.Linear(hidden, act)
        self.q1, self.q2 = mlp(d + act, hidden, 1), mlp(d + act, hidden, 1)
        self.log_alpha = nn.Parameter(torch.tensor(-0.5))
        self.target_entropy = -float(act)
        self.bounds = (min_log_std, max_log_std)

    def forward(self, obs: Tensor, noise: Tensor) -> tuple:
        h = self.trunk(obs)
        mu = self.mu(h)
        lo, hi = self.bounds
        log_std = lo + 0.5 * (hi - lo) * (torch.tanh(self.log_std(h)) + 1)
        std = log_std.exp()
        u = mu + std * noise
        action = torch.tanh(u)
        logp = Normal(mu, std).log_prob(u).sum(-1)
        logp = logp - (2 * (math.log(2) - u - F.softplus(-2 * u))).sum(-1)
        sa = torch.cat([obs, action], -1)
        q = torch.min(self.q1(sa), self.q2(sa)).squeeze(-1)
        alpha = self.log_alpha.exp()
        actor_loss = (alpha.detach() * logp - q).mean()
        alpha_loss = -(self.log_alpha * (logp + self.target_entropy).detach()).mean()
        return action, actor_loss + alpha_loss


class DQN(nn.Module):
    """Double DQN: Q(s, a) by gather of the taken actions; the next action by argmax of the online network,
    its value from the target network, both under no_grad; y = r + gamma (1 - done) Q'; a Huber loss. The
    target network (frozen parameters) follows the online one by Polyak averaging with lerp_ in forward."""

    def __init__(self, d: int = 6, actions: int = 5, hidden: int = 9, gamma: float = 0.95, tau: float = 0.1) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, actions))
        self.target = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, actions))
        self.target.requires_grad_(False)
        self.gamma, self.tau = gamma, tau

    def forward(self, obs: Tensor, actions: Tensor, rewards: Tensor, next_obs: Tensor, dones: Tensor) -> tuple:
        q_all = self.online(obs)
        q = q_all.gather(1, actions.unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            next_action = self.online(next_obs).argmax(dim=1, keepdim=True)
            next_q = self.target(next_obs).gather(1, next_action).squeeze(1)
            y = rewards + self.gamma * (1 - dones.float()) * next_q
            for target_p, p in zip(self.target.parameters(), self.online.parameters()):
                target_p.lerp_(p, self.tau)
        return q_all, F.huber_loss(q, y, delta=0.5) + 0.5 * F.smooth_l1_loss(q, y, beta=0.3)


# --- quantization-aware training --------------------------------------------------------------------------

def round_ste(x: Tensor) -> Tensor:
    """round() with the straight-through estimator: rounded forward, identity backward."""
    return x + (x.round() - x).detach()


class FakeQuantMLP(nn.Module):
    """QAT as written by hand and with the ATen ops: activations fake-quantized per tensor to uint8 from a
    running min/max (buffers updated in forward) by torch.fake_quantize_per_tensor_affine with tensor qparams, weights per output
    channel to int8 (symmetric, scale from the absolute max) by torch.fake_quantize_per_channel_affine, and a
    second layer's weight by hand: clamp(round_ste(w / s), -8, 7) * s, 4 bits."""

    def __init__(self, d: int = 7, hidden: int = 9, classes: int = 3, momentum: float = 0.1) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(d, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, classes)
        self.register_buffer("act_min", torch.tensor(0.0))
        self.register_buffer("act_max", torch.tensor(1.0))
        self.momentum = momentum

    def quantize_activation(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.act_min.lerp_(x.min().clamp(max=0.0), self.momentum)
            self.act_max.lerp_(x.max().clamp(min=0.0), self.momentum)
        scale = (self.act_max - self.act_min) / 255
        zero_point = torch.round(-self.act_min / scale).to(torch.int32)
        return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, 0, 255)

    def forward(self, x: Tensor) -> Tensor:
        w = self.fc1.weight
        scale = (w.detach().abs().amax(1) / 127).clamp(min=1e-8)
        w_q = torch.fake_quantize_per_channel_affine(w, scale, torch.zeros_like(scale, dtype=torch.int32), 0, -128, 127)
        h = self.quantize_activation(F.relu(F.linear(x, w_q, self.fc1.bias)))
        s = self.fc2.weight.detach().abs().max() / 7
        w2 = torch.clamp(round_ste(self.fc2.weight / s), -8, 7) * s
        h = F.hardtanh(F.linear(h, w2, self.fc2.bias))
        return self.head(h)


def grad_scale(x: Tensor, scale: float) -> Tensor:
    """x forward, its gradient times `scale` backward (LSQ's trick)."""
    return (x - x * scale).detach() + x * scale


class LSQLinear(nn.Linear):
    """Learned Step Size Quantization (Esser et al.): a learned step for the weight (signed, 3 bits) and for
    the input (unsigned after ReLU, 4 bits), each with its gradient scaled by 1 / sqrt(numel * Qp), values
    clamped to the range and rounded with the straight-through estimator."""

    def __init__(self, d_in: int, d_out: int, w_bits: int = 3, a_bits: int = 4) -> None:
        super().__init__(d_in, d_out)
        self.w_qn, self.w_qp = 2 ** (w_bits - 1), 2 ** (w_bits - 1) - 1
        self.a_qp = 2 ** a_bits - 1
        self.w_step = nn.Parameter(self.weight.detach().abs().mean() * 2 / math.sqrt(self.w_qp))
        self.a_step = nn.Parameter(torch.tensor(0.1))

    def forward(self, x: Tensor) -> Tensor:
        w_step = grad_scale(self.w_step, 1.0 / math.sqrt(self.weight.numel() * self.w_qp))
        a_step = grad_scale(self.a_step, 1.0 / math.sqrt(x[0].numel() * self.a_qp))
        w_q = round_ste(torch.clamp(self.weight / w_step, -self.w_qn, self.w_qp)) * w_step
        x_q = round_ste(torch.clamp(x / a_step, 0, self.a_qp)) * a_step
        return F.linear(x_q, w_q, self.bias)


class LSQNet(nn.Module):
    def __init__(self, d: int = 6, hidden: int = 11, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(d, hidden)
        self.q1, self.q2 = LSQLinear(hidden, hidden), LSQLinear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.q2(F.relu(self.q1(F.relu(self.stem(x)))))


# --- tabular and recommender models -----------------------------------------------------------------------

class FTTransformer(nn.Module):
    """FT-Transformer: numerical features tokenized as weight[f] * x[:, f] + bias[f], categorical ones by one
    nn.Embedding over all categories with per-feature offsets, a CLS token prepended, one pre-norm attention
    block (the first block's norm skipped, as in the paper) with a ReGLU feed-forward, the head on CLS."""

    def __init__(self, n_num: int = 3, cardinalities: tuple = (3, 5), d: int = 8, heads: int = 2,
                 classes: int = 3) -> None:
        super().__init__()
        self.num_weight = nn.Parameter(torch.randn(n_num, d) / math.sqrt(d))
        self.num_bias = nn.Parameter(torch.randn(n_num, d) / math.sqrt(d))
        self.register_buffer("cat_offsets", torch.tensor((0, *cardinalities[:-1])).cumsum(0))
        self.cat_emb = nn.Embedding(sum(cardinalities), d)
        self.cls = nn.Parameter(torch.randn(1, 1, d) / math.sqrt(d))
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm, self.final_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, 2 * 5), nn.Linear(5, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x_num: Tensor, x_cat: Tensor) -> Tensor:
        num = self.num_weight[None] * x_num[..., None] + self.num_bias[None]
        cat = self.cat_emb(x_cat + self.cat_offsets[None])
        x = torch.cat([self.cls.expand(x_num.shape[0], -1, -1), num, cat], 1)
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1) / math.sqrt(D // self.heads)).softmax(-1)
        x = x + self.out((att @ v).transpose(1, 2).reshape(B, S, D))
        a, b = self.ff1(self.norm(x)).chunk(2, -1)
        x = x + self.ff2(a * F.relu(b))
        return self.head(F.relu(self.final_norm(x[:, 0])))


def sparsemax(z: Tensor) -> Tensor:
    """Sparsemax (Martins & Astudillo) over the last dim by sorting: the support is the k with
    1 + k z_(k) > sum_{j<=k} z_(j), tau = (sum over the support - 1) / |support|, p = max(z - tau, 0)."""
    z = z - z.max(-1, keepdim=True).values
    z_sorted = torch.sort(z, dim=-1, descending=True).values
    k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype, device=z.device)
    cumsum = z_sorted.cumsum(-1)
    support = (1 + k * z_sorted) > cumsum
    k_z = support.sum(-1, keepdim=True)
    tau = (cumsum.gather(-1, k_z - 1) - 1) / k_z.to(z.dtype)
    return torch.clamp(z - tau, min=0)


def entmax15(x: Tensor) -> Tensor:
    """1.5-entmax over the last dim by sorting (Peters et al.'s exact algorithm, as in the entmax package, here differentiated
    by autograd): x / 2 shifted by its max, running means of the sorted values and their squares, tau from
    the quadratic, the support size by tau <= sorted, and p = max(x - tau*, 0) ** 2."""
    x = (x - x.max(-1, keepdim=True).values) / 2
    xs = torch.sort(x, dim=-1, descending=True).values
    rho = torch.arange(1, x.shape[-1] + 1, dtype=x.dtype, device=x.device)
    mean = xs.cumsum(-1) / rho
    mean_sq = (xs ** 2).cumsum(-1) / rho
    ss = rho * (mean_sq - mean ** 2)
    delta_nz = torch.clamp((1 - ss) / rho, 0)
    tau = mean - torch.sqrt(delta_nz)
    support = (tau <= xs).sum(-1, keepdim=True)
    tau_star = tau.gather(-1, support - 1)
    return torch.clamp(x - tau_star, min=0) ** 2


class TabNetLite(nn.Module):
    """TabNet's decision steps, cut down: per step an attentive transformer (Linear, ghost-free BatchNorm1d,
    times the prior, sparsemax) masks the features, the prior is multiplied by (gamma - mask), a GLU
    feature transformer, ReLU outputs summed; the mask entropy is the sparsity regulariser. The last step
    picks its mask with entmax-1.5 instead (as TabNet's later versions allow)."""

    def __init__(self, d: int = 7, n_d: int = 4, steps: int = 3, gamma: float = 1.3, classes: int = 3) -> None:
        super().__init__()
        self.steps, self.gamma, self.n_d = steps, gamma, n_d
        self.bn = nn.BatchNorm1d(d)
        self.attentive = nn.ModuleList([nn.Linear(n_d, d, bias=False) for _ in range(steps)])
        self.att_bn = nn.ModuleList([nn.BatchNorm1d(d) for _ in range(steps)])
        self.feature = nn.ModuleList([nn.Linear(d, 2 * 2 * n_d) for _ in range(steps + 1)])
        self.head = nn.Linear(n_d, classes)

    def forward(self, x: Tensor) -> tuple:
        x = self.bn(x)
        prior = torch.ones_like(x)
        a = F.glu(self.feature[0](x))[:, self.n_d:]
        out = torch.zeros(x.shape[0], self.n_d, dtype=x.dtype)
        sparsity = x.new_zeros(())
        for step in range(self.steps):
            scores = self.att_bn[step](self.attentive[step](a)) * prior
            mask = entmax15(scores) if step == self.steps - 1 else sparsemax(scores)
            sparsity = sparsity + (-mask * torch.log(mask + 1e-10)).sum(-1).mean()
            prior = prior * (self.gamma - mask)
            h = F.glu(self.feature[step + 1](x * mask))
            d, a = h[:, :self.n_d], h[:, self.n_d:]
            out += F.relu(d)
        return self.head(out), sparsity


def tabnet_loss(model: nn.Module, inputs: tuple, target: Tensor) -> tuple:
    logits, sparsity = model(*inputs)
    return logits, F.cross_entropy(logits, target) + 1e-3 * sparsity


class DLRM(nn.Module):
    """DLRM: a bottom MLP on dense features; sparse features as nn.EmbeddingBag lookups (one bag in sum mode
    with per_sample_weights, one in mean mode, both on flat indices with offsets, one plain Embedding); the
    pairwise dot products of the (dense + sparse) vectors by bmm, their strict upper triangle picked with
    torch.triu_indices; a top MLP on the concat; a click probability by BCE-with-logits."""

    def __init__(self, dense: int = 4, d: int = 5, vocab: tuple = (11, 7, 6), hidden: int = 9) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, hidden), nn.ReLU(), nn.Linear(hidden, d), nn.ReLU())
        self.bag_sum = nn.EmbeddingBag(vocab[0], d, mode="sum")
        self.bag_mean = nn.EmbeddingBag(vocab[1], d, mode="mean")
        self.emb = nn.Embedding(vocab[2], d)
        n = 4
        li, lj = torch.triu_indices(n, n, offset=1)
        self.register_buffer("li", li)
        self.register_buffer("lj", lj)
        self.top = nn.Sequential(nn.Linear(d + n * (n - 1) // 2, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense: Tensor, ids_a: Tensor, offsets_a: Tensor, weights_a: Tensor, ids_b: Tensor,
                offsets_b: Tensor, ids_c: Tensor, clicks: Tensor) -> tuple:
        x = self.bottom(dense)
        t = torch.stack([x, self.bag_sum(ids_a, offsets_a, per_sample_weights=weights_a),
                         self.bag_mean(ids_b, offsets_b), self.emb(ids_c)], 1)        # (B, 4, d)
        z = torch.bmm(t, t.transpose(1, 2))
        logit = self.top(torch.cat([x, z[:, self.li, self.lj]], 1)).squeeze(1)
        return logit, F.binary_cross_entropy_with_logits(logit, clicks)


class FMDCN(nn.Module):
    """A factorization machine (linear term plus 0.5 ((sum v x)^2 - sum (v x)^2) over one-hot fields by
    embedding) beside a DCN-v2 tower: two cross layers x_{l+1} = x0 * (W x_l + b) + x_l, the second low-rank
    (U (V x)), in parallel with a deep MLP; the logits are the FM score plus the tower's head."""

    def __init__(self, fields: int = 3, vocab: int = 13, k: int = 4, classes: int = 1) -> None:
        super().__init__()
        self.linear = nn.Embedding(vocab, 1)
        self.v = nn.Embedding(vocab, k)
        self.bias = nn.Parameter(torch.zeros(()))
        d = fields * k + 2
        self.cross_full = nn.Linear(d, d)
        self.cross_u, self.cross_v = nn.Linear(3, d), nn.Linear(d, 3, bias=False)
        self.deep = nn.Sequential(nn.Linear(d, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU())
        self.head = nn.Linear(d + 5, classes)

    def forward(self, ids: Tensor, dense: Tensor, target: Tensor) -> tuple:
        e = self.v(ids)                                          # (B, fields, k)
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1, keepdim=True) + self.linear(ids).sum(1) + self.bias
        x0 = torch.cat([e.flatten(1), dense], 1)
        x = x0 * self.cross_full(x0) + x0
        x = x0 * self.cross_u(self.cross_v(x)) + x
        score = (fm + self.head(torch.cat([x, self.deep(x0)], 1))).squeeze(1)
        return score, F.mse_loss(score, target)


# --- distributions and losses -----------------------------------------------------------------------------

def gumbel_softmax_hard(logits: Tensor, gumbels: Tensor, tau: float) -> Tensor:
    """F.gumbel_softmax(hard=True) on given Gumbel noise: the soft sample, its argmax as a one-hot by
    scatter_, and the straight-through y_hard - y_soft.detach() + y_soft."""
    y_soft = ((logits + gumbels) / tau).softmax(-1)
    index = y_soft.max(-1, keepdim=True)[1]
    y_hard = torch.zeros_like(logits).scatter_(-1, index, 1.0)
    return y_hard - y_soft.detach() + y_soft


class ProbabilisticHeads(nn.Module):
    """A VAE-style encoder with Normal posteriors and KL to a learned Normal prior by kl_divergence, a rsample
    from given noise, a discrete latent by hard Gumbel-softmax (KL of its Categorical to uniform), and a
    classifier trained with label smoothing plus a focal cross-entropy whose ignored labels (-100) are
    masked out of its mean; forward returns (logits, loss)."""

    def __init__(self, d: int = 7, z: int = 3, codes: int = 5, classes: int = 4, gamma: float = 2.0) -> None:
        super().__init__()
        self.enc = nn.Linear(d, 2 * z + codes)
        self.prior_mu, self.prior_log_sigma = nn.Parameter(torch.zeros(z)), nn.Parameter(torch.zeros(z))
        self.codebook = nn.Linear(codes, z, bias=False)
        self.head = nn.Linear(2 * z, classes)
        self.z, self.gamma = z, gamma

    def forward(self, x: Tensor, noise: Tensor, gumbels: Tensor, label: Tensor) -> tuple:
        h = self.enc(x)
        mu, log_sigma, code_logits = h.split([self.z, self.z, h.shape[1] - 2 * self.z], -1)
        posterior = Normal(mu, F.softplus(log_sigma) + 1e-4)
        prior = Normal(self.prior_mu, self.prior_log_sigma.exp())
        kl = kl_divergence(posterior, prior).sum(-1).mean()
        z = posterior.loc + posterior.scale * noise
        code = gumbel_softmax_hard(code_logits, gumbels, tau=0.7)
        uniform = Categorical(logits=torch.zeros_like(code_logits))
        kl_code = kl_divergence(Categorical(logits=code_logits), uniform).mean()
        logits = self.head(torch.cat([z, self.codebook(code)], -1))
        smooth = F.cross_entropy(logits, label.clamp(min=0), label_smoothing=0.1)
        valid = label != -100
        ce = F.cross_entropy(logits, label, reduction="none", ignore_index=-100)
        pt = torch.exp(-ce)
        focal = ((1 - pt) ** self.gamma * ce).sum() / valid.sum().clamp(min=1)
        return logits, smooth + focal + 0.1 * kl + 0.1 * kl_code


class LossOptions(nn.Module):
    """Losses in the options the earlier suites leave out: Poisson NLL on rates (log_input=False, full=True,
    Stirling's term), Gaussian NLL with one variance per sample broadcast over the targets (full=False, eps),
    cosine embedding with reduction="sum", margin ranking with reduction="none" then a masked mean,
    multilabel soft margin with per-class weights, multilabel margin on label lists padded with -1 (a row's labels
end at its first -1), and Bernoulli.log_prob."""

    def __init__(self, d: int = 6, out: int = 5) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, 8), nn.Softplus(), nn.Linear(8, out + 1))
        self.register_buffer("class_weight", torch.tensor([1.0, 0.5, 2.0, 1.5, 0.8]))

    def forward(self, x: Tensor, y: Tensor, counts: Tensor, sign: Tensor, multi: Tensor, label_lists: Tensor) -> tuple:
        counts = counts.detach()            # labels; Stirling's term has no finite gradient at a count of 0
        h, hy = self.trunk(x), self.trunk(y)
        s, var_logit = h[:, :-1], h[:, -1:]
        rate = F.softplus(s) + 1e-3
        pois = F.poisson_nll_loss(rate, counts, log_input=False, full=True)
        gauss = F.gaussian_nll_loss(s, counts, F.softplus(var_logit), full=False, eps=1e-4)
        cos = F.cosine_embedding_loss(s, hy[:, :-1], sign, margin=0.2, reduction="sum")
        ranked = F.margin_ranking_loss(s[:, 0], hy[:, 0], sign, margin=0.1, reduction="none")
        keep = sign > 0
        rank = (ranked * keep).sum() / keep.sum()
        mls = F.multilabel_soft_margin_loss(s, multi, weight=self.class_weight)
        mlm = F.multilabel_margin_loss(s, label_lists)
        bern = -torch.distributions.Bernoulli(logits=s).log_prob(multi).mean()
        return s, pois + gauss + 0.1 * cos + rank + mls + mlm + bern


# --- the cases --------------------------------------------------------------------------------------------

def _rollout(g: torch.Generator) -> tuple:
    T, N, d, actions = 5, 3, 5, 4
    obs = torch.randn(T + 1, N, d, generator=g)
    acts = torch.randint(0, actions, (T, N), generator=g)
    old_logp = torch.log(torch.rand(T, N, generator=g) * 0.4 + 0.1)
    rewards = torch.randn(T, N, generator=g)
    dones = torch.rand(T, N, generator=g) < 0.25
    return (obs, acts, old_logp, rewards, dones), None


def _masked_rollout(g: torch.Generator) -> tuple:
    T, N, actions = 5, 3, 5
    valid = torch.rand(T, N, actions, generator=g) < 0.6
    valid[..., 0] = True                                            # a no-op is always allowed
    acts = torch.multinomial(valid.view(-1, actions).float(), 1, generator=g).view(T, N)
    return (torch.randn(T, N, 4, generator=g), torch.rand(T, N, generator=g) < 0.25, valid, acts,
            torch.randn(T, N, generator=g)), None


def _continuous(g: torch.Generator) -> tuple:
    n = 11
    obs, actions = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g) * 0.8
    old_logp = -3.0 + 0.5 * torch.randn(n, generator=g)
    advantages, returns, old_values = (torch.randn(n, generator=g) for _ in range(3))
    return (obs, actions, old_logp, advantages, returns, old_values), None


def _sac(g: torch.Generator) -> tuple:
    return (torch.randn(7, 5, generator=g), torch.randn(7, 2, generator=g)), None


def _transitions(g: torch.Generator) -> tuple:
    n = 9
    return (torch.randn(n, 6, generator=g), torch.randint(0, 5, (n,), generator=g), torch.randn(n, generator=g),
            torch.randn(n, 6, generator=g), torch.rand(n, generator=g) < 0.3), None


def _features(d: int, n: int = 9) -> Callable:
    def batch(g: torch.Generator) -> tuple:
        return (torch.randn(n, d, generator=g),), torch.randint(0, 3, (n,), generator=g)
    return batch


def _tabular(g: torch.Generator) -> tuple:
    n = 5
    x_cat = torch.stack([torch.randint(0, 3, (n,), generator=g), torch.randint(0, 5, (n,), generator=g)], 1)
    return (torch.randn(n, 3, generator=g), x_cat), torch.randint(0, 3, (n,), generator=g)


def _clicks(g: torch.Generator) -> tuple:
    n = 4
    ids_a = torch.randint(0, 11, (9,), generator=g)
    offsets_a = torch.tensor([0, 2, 2, 6])                          # an empty bag: sums to zeros
    ids_b = torch.randint(0, 7, (7,), generator=g)
    offsets_b = torch.tensor([0, 1, 4, 5])
    return (torch.randn(n, 4, generator=g), ids_a, offsets_a, torch.rand(9, generator=g) + 0.5, ids_b, offsets_b,
            torch.randint(0, 6, (n,), generator=g), (torch.rand(n, generator=g) < 0.5).float()), None


def _fields(g: torch.Generator) -> tuple:
    n = 7
    return (torch.randint(0, 13, (n, 3), generator=g), torch.randn(n, 2, generator=g),
            torch.randn(n, generator=g)), None


def _probabilistic(g: torch.Generator) -> tuple:
    n = 7
    label = torch.randint(0, 4, (n,), generator=g)
    label[torch.tensor([2, 5])] = -100
    gumbels = -torch.empty(n, 5).exponential_(generator=g).log()
    return (torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g), gumbels, label), None


def _loss_options(g: torch.Generator) -> tuple:
    n = 8
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    sign[0] = 1.0
    multi = torch.rand(n, 5, generator=g) < 0.4
    # each row's labels, then -1, then stale classes from a reused buffer (ignored after the -1)
    labels = torch.where(multi, torch.arange(5), 5).sort(-1).values
    padding = labels == 5
    stale = torch.randint(0, 5, labels.shape, generator=g)
    label_lists = torch.where(padding & (padding.cumsum(-1) == 1), -1, torch.where(padding, stale, labels))
    return (torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g),
            torch.poisson(torch.rand(n, 5, generator=g) * 3, generator=g), sign, multi.float(), label_lists), None


def cases() -> list[Case]:
    ppo_gaussian = Case("ppo_gaussian_value_clip", PPOGaussian, _continuous, own_loss)
    sac = Case("sac_tanh_normal", SACActor, _sac, own_loss)
    lsq = Case("lsq_quantized", LSQNet, _features(6), classify)
    ft = Case("ft_transformer", FTTransformer, _tabular, classify)
    tabnet = Case("tabnet_sparsemax_entmax", TabNetLite, _features(7), tabnet_loss)
    fm_dcn = Case("fm_dcn", FMDCN, _fields, own_loss)
    probabilistic = Case("probabilistic_heads", ProbabilisticHeads, _probabilistic, own_loss)
    recurrent = Case("recurrent_masked_policy", RecurrentMaskedPolicy, _masked_rollout, own_loss)
    return [Case("ppo_categorical_gae", PPOCategoricalGAE, _rollout, own_loss), ppo_gaussian, sac, recurrent,
            Case("double_dqn_polyak", DQN, _transitions, own_loss),
            Case("fake_quant_mlp", FakeQuantMLP, _features(7), classify), lsq, ft, tabnet,
            Case("dlrm_embedding_bags", DLRM, _clicks, own_loss), fm_dcn, probabilistic,
            Case("loss_options", LossOptions, _loss_options, own_loss),
            *(bf16(c) for c in (sac, recurrent, ft, fm_dcn)),
            *(fp64(c) for c in (ppo_gaussian, lsq, tabnet, probabilistic))]
