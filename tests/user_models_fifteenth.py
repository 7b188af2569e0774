"""A fifteenth set of models written the way users write them, for tests/test_optimizer_user_models_fifteenth.py.

The earlier sets cover a VAE, a diffusion UNet and WGAN-GP. These are the generative objectives and quantizers as
their reference implementations write them: a VQ-VAE (codebook lookup by argmin of expanded squared distances,
the straight-through z + (zq - z).detach(), commitment loss, an EMA codebook update by one_hot and index_add_ with
Laplace smoothing, dead codes reset by torch.where); residual VQ (a loop of quantizers on the residual); Finite
Scalar Quantization (tanh bounding with half-levels and offsets, round with a straight-through estimator, codes to
indices by a basis product and back by // and %, and torch.div with both rounding modes on negative floats and
ints, by scalars and tensors); lookup-free quantization (sign codes, per-sample and codebook entropies over code
probabilities, commitment); rectified flow (t by sigmoid of a normal, interpolation, velocity MSE, label dropout
by torch.where on a given mask); EDM's preconditioning (c_skip, c_out, c_in, c_noise = log(sigma) / 4 and its loss
weighting); a cosine DDPM schedule built in the step by cumprod and clamp, v-prediction and min-SNR weighting; a
consistency-training loss against an EMA target lerp_'d inside the step (pseudo-Huber); a Gumbel-softmax VQ
(scatter_ of the argmax, straight-through); a beta-VAE with free bits (clamp of the per-dim
KL); and GAN hinge and non-saturating losses. Sizes are odd and tiny; every input and noise comes from a seeded
generator (random masks and noise are inputs, so eager and compiled see the same values). Each model is a
`tests.user_models.Case`.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case
from tests.user_models_more import bf16, fp64, own_loss


def mlp(d_in: int, d_out: int, hidden: int = 11) -> nn.Module:
    """The small trunk every encoder and decoder here is made of."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.SiLU(), nn.Linear(hidden, d_out))


# --- vector quantization -----------------------------------------------------------------------------------

class VQVAE(nn.Module):
    """VQ-VAE with an EMA codebook (the Sonnet / taming implementation): squared distances expanded as
    |z|^2 - 2 z.e + |e|^2, argmin, one_hot encodings; codebook updated in training by EMA of counts and sums
    (index_add_), Laplace-smoothed counts, dead codes (usage under a threshold) reset to encoder outputs by
    torch.where; loss = reconstruction + beta * commitment; perplexity of the code usage."""

    def __init__(self, d_in: int = 7, d: int = 5, codes: int = 9, decay: float = 0.9, eps: float = 1e-5) -> None:
        super().__init__()
        self.encoder, self.decoder = mlp(d_in, d), mlp(d, d_in)
        self.decay, self.eps, self.codes = decay, eps, codes
        self.register_buffer("embedding", torch.randn(codes, d))
        self.register_buffer("cluster_size", torch.ones(codes))
        self.register_buffer("embed_sum", self.embedding.clone())

    def forward(self, x: Tensor) -> tuple:
        z = self.encoder(x)
        distances = (z.pow(2).sum(1, keepdim=True) - 2 * z @ self.embedding.t()
                     + self.embedding.pow(2).sum(1)[None])
        index = distances.argmin(1)
        encodings = F.one_hot(index, self.codes).type(z.dtype)
        quantized = encodings @ self.embedding
        if self.training:
            with torch.no_grad():
                ones = torch.ones_like(index, dtype=z.dtype)
                counts = torch.zeros(self.codes, dtype=z.dtype).index_add_(0, index, ones)
                self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
                self.embed_sum.mul_(self.decay).add_(encodings.t() @ z.detach(), alpha=1 - self.decay)
                n = self.cluster_size.sum()
                smoothed = (self.cluster_size + self.eps) / (n + self.codes * self.eps) * n
                dead = (self.cluster_size < 0.5)[:, None]
                replacement = z.detach()[torch.arange(self.codes) % z.shape[0]]
                self.embedding.copy_(torch.where(dead, replacement, self.embed_sum / smoothed[:, None]))
        commitment = F.mse_loss(z, quantized.detach())
        z_q = z + (quantized - z).detach()
        recon = self.decoder(z_q)
        probs = encodings.mean(0)
        perplexity = torch.exp(-torch.sum(probs * torch.log(probs + 1e-10)))
        return recon, F.mse_loss(recon, x) + 0.25 * commitment + 0.0 * perplexity


class ResidualVQ(nn.Module):
    """Residual VQ (SoundStream): each of a few learned codebooks quantizes what the previous ones left; the
    codebook loss (|sg(z) - e|^2) and commitment (|z - sg(e)|^2) summed over the stages; cdist distances."""

    def __init__(self, d_in: int = 7, d: int = 4, codes: int = 6, stages: int = 3) -> None:
        super().__init__()
        self.encoder, self.decoder = mlp(d_in, d), mlp(d, d_in)
        self.codebooks = nn.ParameterList(nn.Parameter(torch.randn(codes, d) * 0.5 ** s) for s in range(stages))

    def forward(self, x: Tensor) -> tuple:
        z = self.encoder(x)
        residual, total, loss = z, torch.zeros_like(z), z.new_zeros(())
        for codebook in self.codebooks:
            index = torch.cdist(residual.detach(), codebook).argmin(-1)
            chosen = codebook[index]
            loss = loss + F.mse_loss(chosen, residual.detach()) + 0.25 * F.mse_loss(residual, chosen.detach())
            chosen = residual + (chosen - residual).detach()
            total = total + chosen
            residual = residual - chosen.detach()
        recon = self.decoder(total)
        return recon, F.mse_loss(recon, x) + loss


def round_ste(z: Tensor) -> Tensor:
    """Round with a straight-through gradient, as FSQ's reference does."""
    return z + (z.round() - z).detach()


class FSQ(nn.Module):
    """Finite Scalar Quantization (Mentzer et al.'s reference): bound each channel by tanh to its number of levels
    (half-levels, an offset of 0.5 for even level counts, a shift of atanh(offset / half)), round with STE,
    normalise by the half width; codes to indices by a basis (cumprod of the levels) and back by // and %;
    the indices rebuilt into codes must equal the codes. Also torch.div's rounding modes on negative values
    (a signed bin of a centred code), by a tensor and a Python number, of a Python number by a tensor, in floats
    and ints."""

    def __init__(self, d_in: int = 7, levels: tuple = (7, 5, 4, 6)) -> None:
        super().__init__()
        self.encoder, self.decoder = mlp(d_in, len(levels)), mlp(len(levels), d_in)
        self.register_buffer("levels", torch.tensor(levels), persistent=False)
        self.register_buffer("basis", torch.cumprod(torch.tensor((1, *levels[:-1])), 0), persistent=False)

    def bound(self, z: Tensor, eps: float = 1e-3) -> Tensor:
        half_l = (self.levels - 1) * (1 + eps) / 2
        offset = torch.where(self.levels % 2 == 0, 0.5, 0.0)
        shift = (offset / half_l).atanh()
        return (z + shift).tanh() * half_l - offset

    def forward(self, x: Tensor) -> tuple:
        z = self.encoder(x)
        half_width = self.levels // 2
        codes = round_ste(self.bound(z)) / half_width
        index = ((codes * half_width + half_width) * self.basis).sum(-1).round().long()
        rebuilt = (index[:, None] // self.basis) % self.levels
        back = (rebuilt - half_width) / half_width
        signed = codes * half_width                         # whole numbers from -3 to 3
        bins = torch.cat([signed // 2, torch.div(signed, 2, rounding_mode="trunc"),
                          torch.div(signed - 0.5, -1.5, rounding_mode="floor"), (signed * 1.7) // -0.6,
                          torch.div(z, half_width, rounding_mode="floor"),
                          torch.div(z * 3, self.levels.float() - 4.5, rounding_mode="trunc"),
                          2.5 // (z.abs() + 0.5)], -1)
        int_bins = torch.cat([(rebuilt - half_width) // 2, torch.div(rebuilt - 3, 2, rounding_mode="trunc"),
                              index[:, None] // 7, torch.div(-index[:, None], 5, rounding_mode="floor")], -1)
        shifts = 0.1 * (bins.detach().sum(-1, keepdim=True) + int_bins.to(z.dtype).sum(-1, keepdim=True))
        recon = self.decoder(codes + (back - codes).detach()) + shifts
        return recon, F.mse_loss(recon, x) + 0.01 * (bins.detach() * z.repeat(1, 7)).mean()


class LookupFreeQuantizer(nn.Module):
    """Lookup-free quantization (MAGVIT-v2): codes are the signs of the latent (+/-1, STE); code probabilities by
    a softmax over -distances to all 2^d codes (built from the bits of arange by // and %) at a temperature; the
    entropy loss is the mean per-sample entropy minus the codebook (batch-averaged) entropy, plus commitment."""

    def __init__(self, d_in: int = 7, d: int = 3, temperature: float = 0.5) -> None:
        super().__init__()
        self.encoder, self.decoder = mlp(d_in, d), mlp(d, d_in)
        bits = (torch.arange(2 ** d)[:, None] // (2 ** torch.arange(d - 1, -1, -1))) % 2
        self.register_buffer("codebook", bits.float() * 2 - 1, persistent=False)
        self.temperature = temperature

    def forward(self, x: Tensor) -> tuple:
        z = self.encoder(x)
        quantized = torch.where(z > 0, 1.0, -1.0).to(z.dtype)
        z_q = z + (quantized - z).detach()
        distance = -2 * z @ self.codebook.to(z.dtype).t()
        prob = (-distance / self.temperature).softmax(-1)
        per_sample = -(prob * torch.log(prob.clamp_min(1e-5))).sum(-1).mean()
        average = prob.mean(0)
        codebook_entropy = -(average * torch.log(average.clamp_min(1e-5))).sum()
        commitment = F.mse_loss(z, quantized.detach())
        index = ((quantized > 0).long() * 2 ** torch.arange(z.shape[-1] - 1, -1, -1)).sum(-1)
        recon = self.decoder(z_q)
        loss = F.mse_loss(recon, x) + 0.1 * (per_sample - codebook_entropy) + 0.25 * commitment
        return recon + 0 * index[:, None], loss


# --- diffusion and flow objectives -------------------------------------------------------------------------

class Denoiser(nn.Module):
    """A small conditional network of (x, time, class): sinusoidal time features, a class embedding with a null
    class for classifier-free guidance."""

    def __init__(self, d: int = 6, classes: int = 4, hidden: int = 13) -> None:
        super().__init__()
        self.label = nn.Embedding(classes + 1, hidden)
        self.time = nn.Linear(6, hidden)
        self.inp = nn.Linear(d, hidden)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, d))
        self.null = classes

    def forward(self, x: Tensor, t: Tensor, label: Tensor) -> Tensor:
        freqs = torch.exp(-math.log(1000.0) * torch.arange(3, dtype=x.dtype) / 3)
        angles = t[:, None] * freqs[None] * 100
        time = torch.cat([angles.sin(), angles.cos()], -1)
        return self.out(self.inp(x) + self.time(time) + self.label(label))


class RectifiedFlow(nn.Module):
    """Rectified flow / flow matching (SD3's recipe): t = sigmoid(n) for a normal n (logit-normal), x_t = (1 - t)
    x0 + t eps, the network predicts the velocity eps - x0; labels dropped to the null class where a given mask
    says (classifier-free guidance training); one Euler step of the sampler from t to t/2."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Denoiser()

    def forward(self, x0: Tensor, noise: Tensor, normal: Tensor, label: Tensor, drop: Tensor) -> tuple:
        t = torch.sigmoid(normal)
        label = torch.where(drop, self.net.null, label)
        x_t = (1 - t[:, None]) * x0 + t[:, None] * noise
        velocity = self.net(x_t, t, label)
        loss = ((velocity - (noise - x0)) ** 2).mean(dim=list(range(1, x0.ndim))).mean()
        stepped = x_t - (t / 2)[:, None] * velocity
        return stepped, loss


class EDM(nn.Module):
    """EDM (Karras et al.) preconditioning as k-diffusion writes it: sigma = exp(P_mean + P_std n); c_skip =
    sd^2 / (sigma^2 + sd^2), c_out = sigma sd / sqrt(sigma^2 + sd^2), c_in = 1 / sqrt(sigma^2 + sd^2), c_noise =
    log(sigma) / 4; the loss weighted by (sigma^2 + sd^2) / (sigma sd)^2."""

    def __init__(self, sigma_data: float = 0.5) -> None:
        super().__init__()
        self.net, self.sigma_data = Denoiser(), sigma_data

    def denoise(self, x: Tensor, sigma: Tensor, label: Tensor) -> Tensor:
        sd = self.sigma_data
        c_skip = sd ** 2 / (sigma ** 2 + sd ** 2)
        c_out = sigma * sd / (sigma ** 2 + sd ** 2).sqrt()
        c_in = 1 / (sd ** 2 + sigma ** 2).sqrt()
        c_noise = sigma.log() / 4
        return c_skip[:, None] * x + c_out[:, None] * self.net(c_in[:, None] * x, c_noise, label)

    def forward(self, x0: Tensor, noise: Tensor, normal: Tensor, label: Tensor) -> tuple:
        sigma = (normal * 1.2 - 1.2).exp()
        weight = (sigma ** 2 + self.sigma_data ** 2) / (sigma * self.sigma_data) ** 2
        denoised = self.denoise(x0 + noise * sigma[:, None], sigma, label)
        return denoised, (weight[:, None] * (denoised - x0) ** 2).mean()


def cosine_alphas_cumprod(steps: int, s: float = 0.008, dtype: torch.dtype = torch.float32) -> Tensor:
    """Nichol & Dhariwal's cosine schedule as improved-diffusion builds it: betas from the ratio of f(t), clamped
    at 0.999, then the cumulative product of 1 - beta."""
    t = torch.linspace(0, steps, steps + 1, dtype=dtype)
    f = torch.cos((t / steps + s) / (1 + s) * math.pi * 0.5) ** 2
    betas = torch.clamp(1 - f[1:] / f[:-1], 0.0001, 0.999)
    return torch.cumprod(1 - betas, 0)


class DDPMVPrediction(nn.Module):
    """A DDPM step with v-prediction and min-SNR-5 weighting (Hang et al.), the schedule built in the step:
    alpha-bar gathered at integer timesteps, x_t = sqrt(ab) x0 + sqrt(1 - ab) eps, v = sqrt(ab) eps - sqrt(1 -
    ab) x0, weight min(snr, 5) / (snr + 1); the predicted x0 from v for a sample."""

    def __init__(self, steps: int = 50) -> None:
        super().__init__()
        self.net, self.steps = Denoiser(), steps

    def forward(self, x0: Tensor, noise: Tensor, timestep: Tensor, label: Tensor) -> tuple:
        alphas_cumprod = cosine_alphas_cumprod(self.steps, dtype=x0.dtype)
        ab = alphas_cumprod[timestep][:, None]
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        v = self.net(x_t, timestep.to(x0.dtype) / self.steps, label)
        target = ab.sqrt() * noise - (1 - ab).sqrt() * x0
        snr = ab / (1 - ab)
        weight = torch.clamp(snr, max=5.0) / (snr + 1)
        loss = (weight * (v - target) ** 2).mean()
        return ab.sqrt() * x_t - (1 - ab).sqrt() * v, loss


class ConsistencyTraining(nn.Module):
    """Consistency training (Song et al., improved): the boundary-condition parametrisation c_skip = sd^2 /
    ((sigma - sigma_min)^2 + sd^2), c_out = (sigma - sigma_min) sd / sqrt(sigma^2 + sd^2); the student at sigma_{n+1}
    against an EMA target at sigma_n under no_grad (the target's parameters a frozen copy), pseudo-Huber distance
    sqrt(d^2 + c^2) - c, weighted by 1 / (sigma_{n+1} - sigma_n)."""

    def __init__(self, sigma_data: float = 0.5, sigma_min: float = 0.002) -> None:
        super().__init__()
        self.net = Denoiser()
        self.target = copy.deepcopy(self.net).requires_grad_(False)
        with torch.no_grad():
            for p in self.target.parameters():
                p.mul_(0.97)
        self.sd, self.sigma_min = sigma_data, sigma_min

    def consistency(self, net: nn.Module, x: Tensor, sigma: Tensor, label: Tensor) -> Tensor:
        c_skip = self.sd ** 2 / ((sigma - self.sigma_min) ** 2 + self.sd ** 2)
        c_out = (sigma - self.sigma_min) * self.sd / (sigma ** 2 + self.sd ** 2).sqrt()
        return c_skip[:, None] * x + c_out[:, None] * net(x, 0.25 * torch.log(sigma + 1e-44), label)

    def forward(self, x0: Tensor, noise: Tensor, index: Tensor, label: Tensor) -> tuple:
        rho, n = 7.0, 11
        ramp = torch.arange(n, dtype=x0.dtype) / (n - 1)
        sigmas = (self.sigma_min ** (1 / rho) + ramp * (80.0 ** (1 / rho) - self.sigma_min ** (1 / rho))) ** rho
        sigma, sigma_next = sigmas[index], sigmas[index + 1]
        student = self.consistency(self.net, x0 + noise * sigma_next[:, None], sigma_next, label)
        with torch.no_grad():
            teacher = self.consistency(self.target, x0 + noise * sigma[:, None], sigma, label)
        c = 0.00054 * math.sqrt(x0.shape[1])
        distance = torch.sqrt((student - teacher) ** 2 + c ** 2) - c
        return student, (distance / (sigma_next - sigma)[:, None]).mean()


class ConsistencyEMAUpdate(ConsistencyTraining):
    """Consistency training as the original loop runs it with the target's update inside the step: the EMA
    decay from the discretisation (mu = exp(s0 log(mu0) / N)), each target parameter lerp_'d toward the online
    one under no_grad before the target is evaluated, and a step counter buffer incremented in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x0: Tensor, noise: Tensor, index: Tensor, label: Tensor) -> tuple:
        with torch.no_grad():
            n = 2 + self.step // 3
            mu = torch.exp(2 * math.log(0.9) / n.to(x0.dtype))
            for target, online in zip(self.target.parameters(), self.net.parameters()):
                target.lerp_(online, 1 - mu)
            self.step.add_(1)
        return super().forward(x0, noise, index, label)


class GumbelVQ(nn.Module):
    """A Gumbel-softmax quantizer (DALL-E's dVAE / taming's GumbelQuantize) from given Gumbel noise: soft one-hot
    codes at a temperature, made hard by scatter_ of the argmax with the straight-through y_hard - sg(y_soft) +
    y_soft; codes by an einsum with the codebook; the KL of the code distribution to the uniform prior."""

    def __init__(self, d_in: int = 7, codes: int = 9, d: int = 5, tau: float = 0.7) -> None:
        super().__init__()
        self.encoder, self.decoder = mlp(d_in, codes), mlp(d, d_in)
        self.codebook = nn.Embedding(codes, d)
        self.tau, self.codes = tau, codes

    def forward(self, x: Tensor, gumbel: Tensor) -> tuple:
        logits = self.encoder(x)
        soft = ((logits + gumbel) / self.tau).softmax(-1)
        index = soft.max(-1, keepdim=True)[1]
        hard = torch.zeros_like(logits).scatter_(-1, index, 1.0)
        one_hot = hard - soft.detach() + soft
        z_q = torch.einsum("bn,nd->bd", one_hot, self.codebook.weight)
        recon = self.decoder(z_q)
        q = logits.softmax(-1)
        kl = torch.sum(q * torch.log(q * self.codes + 1e-10), -1).mean()
        return recon, F.mse_loss(recon, x) + 5e-4 * kl


# --- latent-variable and adversarial objectives ------------------------------------------------------------

class BetaVAEFreeBits(nn.Module):
    """beta-VAE with free bits (Kingma et al. 2016): the KL per latent dimension averaged over the batch, clamped
    below at lambda before the sum, times beta; a Bernoulli decoder by BCE with logits; the reparametrised sample
    from given noise."""

    def __init__(self, d_in: int = 9, d: int = 5, beta: float = 4.0, free_bits: float = 0.1) -> None:
        super().__init__()
        self.encoder, self.decoder = mlp(d_in, 2 * d), mlp(d, d_in)
        self.beta, self.free_bits = beta, free_bits

    def forward(self, x: Tensor, noise: Tensor) -> tuple:
        mu, logvar = self.encoder(x).chunk(2, -1)
        z = mu + torch.exp(0.5 * logvar) * noise
        logits = self.decoder(z)
        recon = F.binary_cross_entropy_with_logits(logits, x, reduction="sum") / x.shape[0]
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp())
        kl_per_dim = torch.clamp(kl.mean(0), min=self.free_bits)
        return logits, recon + self.beta * kl_per_dim.sum()


class GANLosses(nn.Module):
    """A generator and a discriminator trained together: the discriminator's hinge loss (relu(1 - D(x)) + relu(1
    + D(G(z)))) on a detached fake, the generator's non-saturating loss softplus(-D(G(z))) and the hinge
    generator loss -D(G(z)), a feature-matching term, and the least-squares GAN loss, summed."""

    def __init__(self, d: int = 7, latent: int = 4) -> None:
        super().__init__()
        self.generator = mlp(latent, d)
        self.features = nn.Sequential(nn.Linear(d, 9), nn.LeakyReLU(0.2))
        self.critic = nn.Linear(9, 1)

    def forward(self, real: Tensor, latent: Tensor) -> tuple:
        fake = self.generator(latent)
        f_real, f_fake_d = self.features(real), self.features(fake.detach())
        d_real, d_fake = self.critic(f_real), self.critic(f_fake_d)
        d_loss = F.relu(1 - d_real).mean() + F.relu(1 + d_fake).mean()
        f_fake = self.features(fake)
        g_score = self.critic(f_fake)
        g_loss = F.softplus(-g_score).mean() - 0.1 * g_score.mean()
        matching = F.mse_loss(f_fake.mean(0), f_real.detach().mean(0))
        lsgan = 0.5 * ((d_real - 1) ** 2).mean() + 0.5 * (d_fake ** 2).mean()
        return fake, d_loss + g_loss + matching + lsgan


# --- the cases ---------------------------------------------------------------------------------------------

def _vectors(d: int, n: int = 9):
    def batch(g: torch.Generator) -> tuple:
        return (torch.randn(n, d, generator=g),), None
    return batch


def _diffusion(g: torch.Generator, n: int = 7) -> tuple:
    return torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g)


def _flow(g: torch.Generator) -> tuple:
    x0, noise = _diffusion(g)
    return (x0, noise, torch.randn(7, generator=g), torch.randint(0, 4, (7,), generator=g),
            torch.rand(7, generator=g) < 0.3), None


def _edm(g: torch.Generator) -> tuple:
    x0, noise = _diffusion(g)
    return (x0 * 0.5, noise, torch.randn(7, generator=g), torch.randint(0, 4, (7,), generator=g)), None


def _ddpm(g: torch.Generator) -> tuple:
    x0, noise = _diffusion(g)
    return (x0, noise, torch.randint(0, 50, (7,), generator=g), torch.randint(0, 4, (7,), generator=g)), None


def _consistency(g: torch.Generator) -> tuple:
    x0, noise = _diffusion(g)
    return (x0 * 0.5, noise, torch.randint(0, 10, (7,), generator=g), torch.randint(0, 4, (7,), generator=g)), None


def _gumbel(g: torch.Generator) -> tuple:
    u = torch.rand(9, 9, generator=g) * 0.98 + 0.01
    return (torch.randn(9, 7, generator=g), -torch.log(-torch.log(u))), None


def _binary(g: torch.Generator) -> tuple:
    return ((torch.rand(7, 9, generator=g) < 0.4).float(), torch.randn(7, 5, generator=g)), None


def _gan(g: torch.Generator) -> tuple:
    return (torch.randn(9, 7, generator=g) * 0.5 + 1, torch.randn(9, 4, generator=g)), None


def cases() -> list[Case]:
    vqvae = Case("vqvae_ema_codebook", VQVAE, _vectors(7), own_loss)
    rvq = Case("residual_vq", ResidualVQ, _vectors(7), own_loss)
    fsq = Case("fsq_div_modes", FSQ, _vectors(7), own_loss)
    lfq = Case("lookup_free_quantizer", LookupFreeQuantizer, _vectors(7), own_loss)
    flow = Case("rectified_flow_cfg_dropout", RectifiedFlow, _flow, own_loss)
    edm = Case("edm_preconditioning", EDM, _edm, own_loss)
    ddpm = Case("ddpm_cosine_v_min_snr", DDPMVPrediction, _ddpm, own_loss)
    consistency_ema = Case("consistency_ema_update_in_step", ConsistencyEMAUpdate, _consistency, own_loss)
    gumbel = Case("gumbel_vq_straight_through", GumbelVQ, _gumbel, own_loss)
    beta_vae = Case("beta_vae_free_bits", BetaVAEFreeBits, _binary, own_loss)
    gan = Case("gan_hinge_non_saturating", GANLosses, _gan, own_loss)
    # No float16 variants: cast to fp16, eager is the less accurate side against an fp64 run of the same model
    # (EDM's input gradients: eager's error 0.004 and an inf where the loss weight 1 / (sigma sd)^2 overflows,
    # tfsn's 0.0001 and finite; LFQ's encoder gradients: eager's error about twice tfsn's), and FSQ's levels
    # promote its codes to fp32.
    return [vqvae, rvq, fsq, lfq, flow, edm, ddpm, consistency_ema, gumbel, beta_vae, gan,
            *(bf16(c) for c in (vqvae, fsq, edm)),
            *(fp64(c) for c in (vqvae, fsq, edm, ddpm, consistency_ema))]
