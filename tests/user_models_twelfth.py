"""A twelfth set of models written the way users write them, for tests/test_optimizer_user_models_twelfth.py.

The earlier sets cover special functions one at a time (tests/test_optimizer_numeric_idioms.py) and a few
probabilistic heads (Normal, Categorical, Bernoulli; Poisson NLL). These are the probabilistic, statistical,
time-series and scientific models that chain them as their reference implementations do: DeepAR with a negative-
binomial likelihood by lgamma (digamma in its backward) and a Student-t one by torch.distributions.StudentT;
torch.distributions' Gamma, Beta, Dirichlet, LogNormal and Poisson log_prob and a LogNormal rsample from given
noise; Gaussian NLL with full=True, a pinball (quantile) loss and a Tweedie loss whose power is learned (pow with
a tensor exponent); Cox's partial likelihood (sort by time, logcumsumexp, mean over the events); a Weibull AFT
with censoring and a Kumaraswamy severity (log_prob of TransformedDistributions: the log of a ones_like, a
full_like raised to a power); CORAL ordinal regression with cumulative sigmoids; a discrete-time survival model
with cumprod hazards; a head of special functions (xlogy, xlog1py, log_ndtr, ndtr, erfc, erfcx, i0, i0e, i1, i1e,
sinc, logit with eps, expit, softplus with beta and threshold); PatchTST with RevIN (per-instance normalisation
by hand, learned affine, de-normalisation); N-BEATS with polynomial and Fourier bases; a TCN of causal dilated
convolutions under weight_norm; TFT's gated residual networks and variable selection; targets with missing values
(nan_to_num, torch.where on isnan, nanmean, nansum); and a numerics zoo (clamp with tensor bounds, copysign,
frexp/ldexp, integer pow, floor_divide and remainder of negatives). Sizes are odd and tiny; every input and noise
comes from a seeded generator. Each model is a `tests.user_models.Case`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributions import Beta, Dirichlet, Gamma, Kumaraswamy, LogNormal, Poisson, StudentT, Weibull

from tests.user_models import Case, classify
from tests.user_models_more import bf16, fp64, own_loss


# --- probabilistic forecasting -----------------------------------------------------------------------------

def negative_binomial_log_likelihood(z: Tensor, mu: Tensor, alpha: Tensor) -> Tensor:
    """DeepAR's negative-binomial log-likelihood of counts z with mean mu and shape alpha, as its paper writes it."""
    r = 1.0 / alpha
    return (torch.lgamma(z + r) - torch.lgamma(z + 1.0) - torch.lgamma(r)
            + r * torch.log(r / (r + mu)) + z * torch.log(mu / (r + mu)))


class DeepAR(nn.Module):
    """DeepAR: an LSTM over the lagged target and covariates; a negative-binomial head for the counts (mean and
    shape by softplus, scaled by the series' mean as the paper does) and a Student-t head for a real series
    (degrees of freedom 2 + softplus); the loss is the mean negative log-likelihood of both over the steps."""

    def __init__(self, covariates: int = 3, hidden: int = 7) -> None:
        super().__init__()
        self.rnn = nn.LSTM(covariates + 2, hidden, batch_first=True)
        self.nb = nn.Linear(hidden, 2)
        self.t = nn.Linear(hidden, 3)

    def forward(self, counts: Tensor, real: Tensor, covariates: Tensor) -> tuple:
        scale = 1.0 + counts.mean(1, keepdim=True)
        lagged = torch.cat([torch.zeros_like(counts[:, :1]), counts[:, :-1] / scale], 1)
        real_lagged = F.pad(real[:, :-1], (1, 0))
        h, _ = self.rnn(torch.cat([lagged[..., None], real_lagged[..., None], covariates], -1))
        mu_raw, alpha_raw = self.nb(h).unbind(-1)
        mu, alpha = F.softplus(mu_raw) * scale, F.softplus(alpha_raw) / scale.sqrt() + 1e-3
        nb_ll = negative_binomial_log_likelihood(counts, mu, alpha)
        df_raw, loc, scale_raw = self.t(h).unbind(-1)
        student = StudentT(2.0 + F.softplus(df_raw), loc, F.softplus(scale_raw) + 1e-3)
        t_ll = student.log_prob(real)
        return mu, -(nb_ll.mean() + t_ll.mean())


class DistributionHeads(nn.Module):
    """A regression net whose heads parameterise torch.distributions: Gamma (concentration, rate by softplus)
    on positive targets, Beta on targets in (0, 1), Dirichlet on compositions, LogNormal on positive targets and
    Poisson on counts; a LogNormal rsample from given noise enters a reconstruction term. Every log_prob is
    averaged into the loss."""

    def __init__(self, d: int = 5, hidden: int = 8, parts: int = 3) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, hidden), nn.Softplus(), nn.Linear(hidden, 7 + parts))
        self.parts = parts

    def forward(self, x: Tensor, positive: Tensor, unit: Tensor, composition: Tensor, counts: Tensor,
                noise: Tensor) -> tuple:
        h = self.trunk(x)
        pos = F.softplus(h[:, :6]) + 1e-2
        gamma = Gamma(pos[:, 0], pos[:, 1]).log_prob(positive)
        beta = Beta(pos[:, 2], pos[:, 3]).log_prob(unit)
        dirichlet = Dirichlet(F.softplus(h[:, 7:]) + 0.1).log_prob(composition)
        log_normal = LogNormal(h[:, 4], pos[:, 5])
        ln = log_normal.log_prob(positive)
        poisson = Poisson(pos[:, 4]).log_prob(counts)
        sample = log_normal.loc + log_normal.scale * noise            # rsample with the noise given
        recon = (sample.exp() - positive).pow(2).mean()
        nll = -(gamma.mean() + beta.mean() + dirichlet.mean() + ln.mean() + poisson.mean())
        return h, nll + 0.1 * recon


class RegressionLosses(nn.Module):
    """The regression losses of forecasting libraries: Gaussian NLL with full=True and a per-target variance,
    the pinball loss over quantiles (max((q - 1) e, q e)), and Tweedie's deviance whose power p in (1, 2) is
    learned through a sigmoid: mu^(1-p) and mu^(2-p) are pow with a tensor exponent."""

    def __init__(self, d: int = 6, hidden: int = 7) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, 5))
        self.register_buffer("quantiles", torch.tensor([0.1, 0.5, 0.9]))
        self.power_logit = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: Tensor, y: Tensor, claims: Tensor) -> tuple:
        h = self.trunk(x)
        mean, var = h[:, 0], F.softplus(h[:, 1]) + 1e-3
        gauss = F.gaussian_nll_loss(mean, y, var, full=True)
        error = y[:, None] - h[:, 2:5]
        pinball = torch.max((self.quantiles - 1) * error, self.quantiles * error).sum(-1).mean()
        p = 1.0 + torch.sigmoid(self.power_logit)
        mu = torch.exp(h[:, 0].clamp(max=5.0))
        tweedie = (-claims * mu.pow(1 - p) / (1 - p) + mu.pow(2 - p) / (2 - p)).mean()
        return h, gauss + pinball + tweedie


# --- survival and ordinal ----------------------------------------------------------------------------------

class CoxPH(nn.Module):
    """DeepSurv's Cox partial likelihood: risks sorted by descending time, the log of each risk set's sum by
    logcumsumexp, the negative log-likelihood averaged over the observed events (censored rows only enter the
    risk sets)."""

    def __init__(self, d: int = 6, hidden: int = 7) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.SELU(), nn.Linear(hidden, 1, bias=False))

    def forward(self, x: Tensor, time: Tensor, event: Tensor) -> tuple:
        risk = self.net(x).squeeze(-1)
        order = torch.argsort(time, descending=True)
        risk, event = risk[order], event[order]
        log_risk_set = torch.logcumsumexp(risk, 0)
        partial = (risk - log_risk_set) * event
        return risk, -partial.sum() / event.sum().clamp(min=1)


class WeibullAFT(nn.Module):
    """A parametric survival model (Weibull accelerated failure time, as lifelines and pycox fit it): the
    scale from the covariates, a learned shape; events score Weibull.log_prob of their time, censored rows
    the log-survival -(t / scale) ** shape; a bounded severity in (0, 1) scores Kumaraswamy.log_prob. Both
    distributions are TransformedDistributions whose log_prob takes the log of a ones_like and raises a
    full_like to a power."""

    def __init__(self, d: int = 5, hidden: int = 6) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 3))
        self.log_shape = nn.Parameter(torch.tensor(0.2))

    def forward(self, x: Tensor, time: Tensor, event: Tensor, severity: Tensor) -> tuple:
        h = self.net(x)
        scale, shape = F.softplus(h[:, 0]) + 0.1, self.log_shape.exp().expand_as(time)
        events = Weibull(scale, shape).log_prob(time)
        censored = -(time / scale) ** shape
        survival = torch.where(event, events, censored)
        a, b = F.softplus(h[:, 1]) + 0.2, F.softplus(h[:, 2]) + 0.2
        bounded = Kumaraswamy(a, b).log_prob(severity)
        return scale, -(survival.mean() + bounded.mean())


class CoralOrdinal(nn.Module):
    """CORAL (Cao et al.): one shared weight vector and K-1 ordered biases; the labels expand to cumulative
    binary targets (label > k), the loss is the binary cross-entropy of the cumulative sigmoids written with
    logsigmoid, and the prediction is the count of probabilities over 0.5."""

    def __init__(self, d: int = 5, hidden: int = 6, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(d, hidden), nn.Tanh())
        self.fc = nn.Linear(hidden, 1, bias=False)
        self.biases = nn.Parameter(torch.arange(classes - 1, 0, -1).float() / classes)

    def forward(self, x: Tensor, label: Tensor) -> tuple:
        logits = self.fc(self.features(x)) + self.biases
        levels = (label[:, None] > torch.arange(logits.shape[1], device=x.device)).float()
        loss = -(F.logsigmoid(logits) * levels + (F.logsigmoid(logits) - logits) * (1 - levels)).sum(1).mean()
        expected_rank = torch.sigmoid(logits).sum(1)
        return expected_rank, loss


class DiscreteSurvival(nn.Module):
    """A discrete-time survival net (Nnet-survival, DeepHit style): hazards by sigmoid per interval, survival
    by cumprod of 1 - hazard, the likelihood of an event in interval t (S(t-1) h(t)) or of censoring after it
    (S(t)) picked by gather; log of the product clamped away from 0."""

    def __init__(self, d: int = 5, hidden: int = 7, intervals: int = 6) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, intervals))

    def forward(self, x: Tensor, interval: Tensor, event: Tensor) -> tuple:
        hazard = torch.sigmoid(self.net(x))
        survival = torch.cumprod(1 - hazard, 1)
        before = torch.cat([torch.ones_like(survival[:, :1]), survival[:, :-1]], 1)
        at = interval[:, None]
        event_likelihood = before.gather(1, at) * hazard.gather(1, at)
        censored_likelihood = survival.gather(1, at)
        likelihood = torch.where(event[:, None], event_likelihood, censored_likelihood)
        return survival, -torch.log(likelihood.clamp(min=1e-7)).mean()


class SpecialFunctionHead(nn.Module):
    """A scientific regression net whose features pass through torch.special: the log-likelihood terms xlogy
    and xlog1py, a probit link by log_ndtr and ndtr, erfc and its scaled erfcx, Bessel features i0, i0e, i1,
    i1e of a bounded input, sinc, logit with eps of a sigmoid, expit, and softplus with beta and threshold."""

    def __init__(self, d: int = 5, hidden: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.head = nn.Linear(13 * hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        p = torch.sigmoid(h)
        bounded = 2.0 * torch.tanh(h)
        feats = [torch.special.xlogy(p, p + 0.5), torch.special.xlog1py(h, p),
                 torch.special.log_ndtr(h), torch.special.ndtr(h), torch.special.erfc(h),
                 torch.special.erfcx(h.abs()), torch.special.i0(bounded), torch.special.i0e(h),
                 torch.special.i1(bounded), torch.special.i1e(h), torch.special.sinc(h),
                 torch.special.logit(p, eps=1e-3) + torch.special.expit(-h),
                 F.softplus(h, beta=2.0, threshold=1.5)]
        return self.head(torch.cat(feats, -1))


# --- time series -------------------------------------------------------------------------------------------

class PatchTST(nn.Module):
    """PatchTST with RevIN: each series normalised by its own mean and (biased) std with eps, a learned affine,
    patches by unfold with a stride, a channel-independent Transformer encoder, a flatten head, then the
    affine undone and the statistics put back; the loss is the MSE to the horizon."""

    def __init__(self, lookback: int = 11, horizon: int = 3, patch: int = 4, stride: int = 2, d: int = 8) -> None:
        super().__init__()
        self.patch, self.stride = patch, stride
        patches = (lookback - patch) // stride + 1
        self.affine_weight, self.affine_bias = nn.Parameter(torch.ones(1)), nn.Parameter(torch.zeros(1))
        self.embed = nn.Linear(patch, d)
        self.position = nn.Parameter(torch.randn(patches, d) * 0.1)
        self.encoder = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(patches * d, horizon)

    def forward(self, x: Tensor, future: Tensor) -> tuple:
        b, c, _ = x.shape
        mean = x.mean(-1, keepdim=True).detach()
        std = torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5).detach()
        z = (x - mean) / std * self.affine_weight + self.affine_bias
        tokens = self.embed(z.unfold(-1, self.patch, self.stride)).reshape(b * c, -1, self.position.shape[1])
        h = self.encoder(tokens + self.position)
        y = self.head(h.flatten(1)).reshape(b, c, -1)
        y = (y - self.affine_bias) / (self.affine_weight + 1e-10)
        y = y * std + mean
        return y, F.mse_loss(y, future)


class NBeats(nn.Module):
    """Interpretable N-BEATS: a trend block whose basis is the polynomial t^i (integer powers of a time grid)
    and a seasonality block whose basis is cos and sin of 2 pi k t; each block's backcast is subtracted from
    the residual (doubly residual stacking) and the forecasts summed; the loss is the sMAPE-like
    |y - f| / (|y| + |f| + eps)."""

    def __init__(self, lookback: int = 9, horizon: int = 4, hidden: int = 10, degree: int = 3,
                 harmonics: int = 2) -> None:
        super().__init__()
        t_back = torch.arange(lookback) / lookback
        t_fore = torch.arange(horizon) / horizon
        powers = torch.arange(degree + 1)
        self.register_buffer("poly_back", t_back[None, :] ** powers[:, None])
        self.register_buffer("poly_fore", t_fore[None, :] ** powers[:, None])
        k = torch.arange(1, harmonics + 1)[:, None]
        for name, t in (("fourier_back", t_back), ("fourier_fore", t_fore)):
            self.register_buffer(name, torch.cat([torch.cos(2 * math.pi * k * t), torch.sin(2 * math.pi * k * t)]))
        self.trend = nn.Sequential(nn.Linear(lookback, hidden), nn.ReLU(), nn.Linear(hidden, 2 * (degree + 1)))
        self.season = nn.Sequential(nn.Linear(lookback, hidden), nn.ReLU(), nn.Linear(hidden, 4 * harmonics))

    def forward(self, x: Tensor, future: Tensor) -> tuple:
        residual, forecast = x, 0.0
        for block, back, fore in ((self.trend, self.poly_back, self.poly_fore),
                                  (self.season, self.fourier_back, self.fourier_fore)):
            theta_b, theta_f = block(residual).chunk(2, -1)
            residual = residual - theta_b @ back
            forecast = forecast + theta_f @ fore
        smape = ((future - forecast).abs() / (future.abs() + forecast.abs() + 1e-4)).mean()
        return forecast, smape


class TCN(nn.Module):
    """Bai et al.'s TCN: residual blocks of two causal dilated Conv1d (left padding by F.pad, dilations 1, 2,
    4) under torch.nn.utils.parametrizations.weight_norm, ReLU, a 1x1 downsample where channels change; the
    last step's features classify."""

    def __init__(self, channels: int = 3, hidden: int = 5, classes: int = 3, kernel: int = 3) -> None:
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.kernel = kernel
        self.convs = nn.ModuleList()
        self.downsample = nn.ModuleList()
        c_in = channels
        for dilation in (1, 2, 4):
            self.convs.append(nn.ModuleList([wn(nn.Conv1d(c_in, hidden, kernel, dilation=dilation)),
                                             wn(nn.Conv1d(hidden, hidden, kernel, dilation=dilation))]))
            self.downsample.append(nn.Conv1d(c_in, hidden, 1) if c_in != hidden else nn.Identity())
            c_in = hidden
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        for (conv1, conv2), down in zip(self.convs, self.downsample):
            pad = (self.kernel - 1) * conv1.dilation[0]
            h = F.relu(conv1(F.pad(x, (pad, 0))))
            h = F.relu(conv2(F.pad(h, (pad, 0))))
            x = F.relu(h + down(x))
        return self.head(x[:, :, -1])


class GatedResidualNetwork(nn.Module):
    """TFT's GRN: ELU(W2 a + W3 c), a dense layer, a GLU gate, add the (projected) input, LayerNorm."""

    def __init__(self, d_in: int, hidden: int, d_out: int, context: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.context = nn.Linear(context, hidden, bias=False) if context else None
        self.fc2 = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden, 2 * d_out)
        self.skip = nn.Linear(d_in, d_out) if d_in != d_out else nn.Identity()
        self.norm = nn.LayerNorm(d_out)

    def forward(self, a: Tensor, c: Tensor | None = None) -> Tensor:
        h = self.fc1(a)
        if self.context is not None:
            h = h + self.context(c)
        h = self.fc2(F.elu(h))
        return self.norm(self.skip(a) + F.glu(self.gate(h), -1))


class TFTSelection(nn.Module):
    """TFT's variable selection: each scalar variable embedded and passed through its own GRN, the weights a
    softmax of a GRN over all of them with a static context, the selected embedding a weighted sum; then a
    GRN enrichment over time and a quantile head trained with the pinball loss."""

    def __init__(self, variables: int = 4, d: int = 6, static: int = 3) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(variables, d) * 0.5)
        self.per_variable = nn.ModuleList([GatedResidualNetwork(d, d, d) for _ in range(variables)])
        self.selection = GatedResidualNetwork(variables * d, d, variables, context=static)
        self.enrich = GatedResidualNetwork(d, d, d, context=static)
        self.head = nn.Linear(d, 3)
        self.register_buffer("quantiles", torch.tensor([0.1, 0.5, 0.9]))

    def forward(self, x: Tensor, static: Tensor, y: Tensor) -> tuple:
        emb = x[..., None] * self.embed                                   # (B, T, V, d)
        context = static[:, None, :].expand(-1, x.shape[1], -1)
        weights = torch.softmax(self.selection(emb.flatten(2), context), -1)
        processed = torch.stack([grn(emb[..., i, :]) for i, grn in enumerate(self.per_variable)], -2)
        selected = (weights[..., None] * processed).sum(-2)
        q = self.head(self.enrich(selected, context))
        error = y[..., None] - q
        return q, torch.max(self.quantiles * error, (self.quantiles - 1) * error).mean()


class MissingTargets(nn.Module):
    """A multi-target regressor trained on targets with missing values (NaN): the mask by isnan, the targets
    zero-filled by nan_to_num and by torch.where for the loss, the per-target error averaged by nanmean over
    the NaN-masked error and by nansum divided by the count; the inputs' NaNs filled by nan_to_num with
    posinf/neginf."""

    def __init__(self, d: int = 5, hidden: int = 7, targets: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, targets))

    def forward(self, x: Tensor, y: Tensor) -> tuple:
        x = torch.nan_to_num(x, nan=0.0, posinf=3.0, neginf=-3.0)
        pred = self.net(x)
        missing = torch.isnan(y)
        filled = torch.where(missing, pred.detach(), y)
        squared = (pred - filled).pow(2)
        error = torch.where(missing, torch.full_like(squared, float("nan")), squared)
        per_target = torch.nanmean(error, 0)
        absolute = torch.nansum((pred - y).abs(), 0) / (~missing).sum(0).clamp(min=1)
        zero_filled = ((pred - torch.nan_to_num(y)) * ~missing).pow(2).mean()
        return pred, per_target.sum() + absolute.mean() + zero_filled


class NumericsZoo(nn.Module):
    """Scientific-code numerics inside a model: clamp with per-feature tensor bounds, copysign of a magnitude
    onto a sign, a mantissa/exponent split by frexp and its inverse ldexp, integer powers, floor_divide and
    remainder of negative numbers (float and integer) as periodic coordinates."""

    def __init__(self, d: int = 5, hidden: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.register_buffer("low", torch.linspace(-1.5, -0.5, hidden))
        self.register_buffer("high", torch.linspace(0.5, 1.5, hidden))
        self.head = nn.Linear(7 * hidden, classes)

    def forward(self, x: Tensor, cell: Tensor) -> Tensor:
        h = self.inp(x)
        clamped = torch.clamp(h, self.low, self.high)
        signed = torch.copysign(h.abs() + 0.1, x[:, :1] - 0.2)
        mantissa, exponent = torch.frexp(h.detach())
        rebuilt = torch.ldexp(mantissa, exponent) * h + mantissa
        powers = h ** 3 - 0.5 * h ** 2 + torch.pow(h, -2).clamp(max=4.0)
        wrapped = torch.remainder(3.0 * h, 2.0) - torch.floor_divide(3.0 * h.detach(), 2.0) * 0.1
        period = (torch.remainder(cell, 3) + torch.floor_divide(cell, 4)).to(h.dtype)[:, None]
        return self.head(torch.cat([clamped, signed, rebuilt, powers, wrapped, period * h, exponent.to(h.dtype)], -1))


# --- the cases ---------------------------------------------------------------------------------------------

def _forecast(g: torch.Generator) -> tuple:
    counts = torch.poisson(torch.rand(3, 7, generator=g) * 6, generator=g)
    return (counts, torch.randn(3, 7, generator=g), torch.randn(3, 7, 3, generator=g)), None


def _distributions(g: torch.Generator) -> tuple:
    n = 7
    composition = torch.rand(n, 3, generator=g) + 0.1
    return (torch.randn(n, 5, generator=g), torch.rand(n, generator=g) * 3 + 0.1,
            torch.rand(n, generator=g) * 0.8 + 0.1, composition / composition.sum(-1, keepdim=True),
            torch.randint(0, 6, (n,), generator=g).float(), torch.randn(n, generator=g)), None


def _regression(g: torch.Generator) -> tuple:
    claims = torch.where(torch.rand(9, generator=g) < 0.4, 0.0, torch.rand(9, generator=g) * 4)
    return (torch.randn(9, 6, generator=g), torch.randn(9, generator=g), claims), None


def _survival(g: torch.Generator) -> tuple:
    time = torch.randperm(9, generator=g).float() + torch.rand(9, generator=g)
    return (torch.randn(9, 6, generator=g), time, (torch.rand(9, generator=g) < 0.6).float()), None


def _censored(g: torch.Generator) -> tuple:
    return (torch.randn(9, 5, generator=g), torch.rand(9, generator=g) * 3 + 0.05, torch.rand(9, generator=g) < 0.6,
            torch.rand(9, generator=g) * 0.9 + 0.05), None


def _ordinal(g: torch.Generator) -> tuple:
    return (torch.randn(9, 5, generator=g), torch.randint(0, 5, (9,), generator=g)), None


def _intervals(g: torch.Generator) -> tuple:
    return (torch.randn(9, 5, generator=g), torch.randint(0, 6, (9,), generator=g),
            torch.rand(9, generator=g) < 0.5), None


def _features(d: int, n: int = 7):
    def batch(g: torch.Generator) -> tuple:
        return (torch.randn(n, d, generator=g),), torch.randint(0, 3, (n,), generator=g)
    return batch


def _series(g: torch.Generator) -> tuple:
    x = torch.randn(2, 3, 11, generator=g).cumsum(-1) * 0.5 + torch.randn(2, 3, 1, generator=g) * 3
    return (x, torch.randn(2, 3, 3, generator=g) + x[..., -1:]), None


def _univariate(g: torch.Generator) -> tuple:
    t = torch.arange(13) / 4
    x = torch.sin(t + torch.rand(5, 1, generator=g) * 6) + 0.1 * torch.randn(5, 13, generator=g) + 2
    return (x[:, :9], x[:, 9:]), None


def _channels(g: torch.Generator) -> tuple:
    return (torch.randn(3, 3, 10, generator=g),), torch.randint(0, 3, (3,), generator=g)


def _tft(g: torch.Generator) -> tuple:
    return (torch.randn(2, 5, 4, generator=g), torch.randn(2, 3, generator=g), torch.randn(2, 5, generator=g)), None


def _missing(g: torch.Generator) -> tuple:
    x = torch.randn(9, 5, generator=g)
    x[1, 2], x[4, 0], x[6, 3] = float("nan"), float("inf"), float("-inf")
    y = torch.randn(9, 3, generator=g)
    y[torch.rand(9, 3, generator=g) < 0.3] = float("nan")
    return (x, y), None


def _cells(g: torch.Generator) -> tuple:
    x = torch.randn(7, 5, generator=g)
    return (x, torch.randint(-9, 9, (7,), generator=g)), torch.randint(0, 3, (7,), generator=g)


def cases() -> list[Case]:
    deepar = Case("deepar_nb_student_t", DeepAR, _forecast, own_loss)
    heads = Case("distribution_heads", DistributionHeads, _distributions, own_loss)
    regression = Case("regression_losses_tweedie", RegressionLosses, _regression, own_loss)
    cox = Case("cox_partial_likelihood", CoxPH, _survival, own_loss)
    weibull = Case("weibull_aft_kumaraswamy", WeibullAFT, _censored, own_loss)
    coral = Case("coral_ordinal", CoralOrdinal, _ordinal, own_loss)
    survival = Case("discrete_survival_cumprod", DiscreteSurvival, _intervals, own_loss)
    special = Case("special_function_head", SpecialFunctionHead, _features(5), classify)
    patchtst = Case("patchtst_revin", PatchTST, _series, own_loss)
    nbeats = Case("nbeats_bases", NBeats, _univariate, own_loss)
    tcn = Case("tcn_weight_norm", TCN, _channels, classify)
    tft = Case("tft_variable_selection", TFTSelection, _tft, own_loss)
    missing = Case("missing_targets_nan", MissingTargets, _missing, own_loss)
    numerics = Case("numerics_zoo", NumericsZoo, _cells, classify)
    return [deepar, heads, regression, cox, weibull, coral, survival, special, patchtst, nbeats, tcn, tft, missing,
            numerics,
            *(bf16(c) for c in (patchtst, tcn, tft, weibull)),
            *(fp64(c) for c in (deepar, heads, regression, cox, weibull, special, nbeats, missing, numerics))]
