"""A nineteenth set of models written the way users write them, for tests/test_optimizer_user_models_nineteenth.py.

The earlier sets cover a log-mel front end by unfold and DFT / mel matmuls with SpecAugment masks from arange
comparisons, an x-vector TDNN with masked statistics pooling, a Conformer, an RNN-T and F.ctc_loss
(tests/user_models_tenth.py), ArcFace, CosFace and SphereFace heads (tests/user_models_thirteenth.py), GAN hinge,
least-squares and feature-mean losses and a Gumbel-softmax VQ (tests/user_models_fifteenth.py), DLRM with
EmbeddingBag, factorization machines and DCN-v2's full-rank cross layers (tests/user_models_ninth.py). These are the
speech and recommendation models as their reference implementations write them:
- Speech: Whisper's log-mel spectrogram (pre-emphasis by x[:, 1:] - 0.97 * x[:, :-1], torch.stft with a Hann window
  buffer, the last frame dropped, |X|^2 through a mel filterbank buffer, clamp(min=1e-10).log10(), torch.maximum with
  the utterance's max - 8.0, (x + 4) / 4) with per-utterance CMVN over time, under a Conv1d-GELU encoder;
  torchaudio's MFCC by hand (a Hann-windowed real-DFT basis buffer applied to unfolded frames, AmplitudeToDB with
  top_db, the orthonormal DCT) with SpecAugment's iid frequency and time masks drawn by torch.rand inside the step
  (mask_along_axis_iid: widths and starts by .long(), masks from arange comparisons), before a GRU;
  parallel_wavegan's multi-resolution STFT loss (three FFT sizes, magnitudes by sqrt(clamp(re^2 + im^2, 1e-7)),
  spectral convergence as a ratio of Frobenius norms, L1 of log magnitudes); HiFi-GAN's multi-period discriminator
  (reflect pad to a multiple of the period, view(b, c, t / p, p), (k, 1) Conv2d, leaky_relu(0.1)) with its
  feature-matching loss over every layer's map and the least-squares generator and discriminator losses as lists;
  wav2vec 2.0's Gumbel codebook quantizer (grouped logits, the hard one-hot of (logits + g) / tau with a
  straight-through soft part on given Gumbel noise, codevectors by a broadcast product summed over the codes, the
  diversity loss from the batch-averaged softmax's perplexity, the contrastive loss over distractors picked by given
  indices with cosine similarity at temperature 0.1, identical distractors masked to -inf), and once as HF writes it,
  F.gumbel_softmax(hard=True) drawing its noise in the step; ECAPA-TDNN's attentive
  statistics pooling (a softmax over time, mean and std by sqrt(clamp(E[x^2] - mu^2, eps))) under SpeechBrain's
  additive angular margin (cos(theta + m) by cos m cos - sin m sin with sine = sqrt(clamp(1 - cos^2, 0, 1)), the
  easy-margin threshold by torch.where).
- Recommendation: DeepFM (one embedding table with per-field offsets, the FM second-order term by 0.5 ((sum e)^2 -
  sum e^2), a first-order embedding of width 1, a DNN over the flattened embeddings, BCE with logits); DCN-v2's
  low-rank mixture of cross experts (CrossNetMix: V, C, U per expert, tanh, softmax gating over the experts by
  einsum); DIN's target attention ([q, k, q - k, q * k] into an MLP with the Dice activation: BatchNorm1d without
  affine at eps 1e-9 in training mode, its running statistics written, alpha (1 - p) x + p x), history padding masked
  by torch.where to -2^32 + 1 before a softmax); a two-tower retrieval model (F.normalize towers, in-batch sampled
  softmax at a temperature, the logQ correction subtracting log of the item's sampling probability, accidental hits
  of the same item masked to finfo.min off the diagonal); matrix factorization with the BPR loss (-logsigmoid of the
  positive minus negative score, an L2 term on the looked-up rows); and listwise and pairwise ranking losses: ListNet
  (the softmax of the labels against log_softmax of the scores over a padded list), LambdaRank (ranks by argsort of
  argsort, gains 2^rel - 1, discounts 1 / log2(rank + 2), the ideal DCG from sorted labels, |delta NDCG| of each pair
  swapped as detached weights of a pairwise logistic loss) and RankNet.
Whole-model bf16 casts (every op of the user's rounding to bf16) of the recommendation models but DCN-v2, the MFCC
model, ECAPA, wav2vec 2.0 and HiFi-GAN come with bf16 autocast (DeepFM, two-tower) and fp64 variants. The MFCC model's cast found tfsn
pre-emphasising by x[1:] - 0.97 x[:-1] where eager's CPU sub rounds its alpha to bf16 (0.96875): over the audio's
DC offset the input gradient was 9% off eager's (optimizer/ir.py rounds alpha now). Left out: wav2vec 2.0 in fp64, whose quantizer computes
in fp32 by .float() as fairseq's does (both runs then hold fp32 rounding, not comparable at fp64's tolerance);
and bf16 torch.logit, where eager's
kernel is the less accurate side (31 of 65 values a bf16 ulp further from the fp64 logit than tfsn's).
Sizes are odd and tiny; every input and noise comes from a seeded generator (Gumbel noise and sampled indices are
inputs, so eager and compiled see the same values; the two cases that draw in the step seed the global generator
first, so eager and compiled draw the same). Each model is a `tests.user_models.Case`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case
from tests.user_models_more import bf16, fp64, own_loss


# --- speech ------------------------------------------------------------------------------------------------

def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> Tensor:
    """Triangular filters on the mel scale (librosa's slaney-less HTK form): (n_mels, n_fft // 2 + 1)."""
    def mel(f: Tensor) -> Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)
    bins = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges = 700.0 * (10 ** (torch.linspace(0, float(mel(torch.tensor(sample_rate / 2.0))), n_mels + 2) / 2595.0) - 1)
    lower = (bins[None] - edges[:-2, None]) / (edges[1:-1, None] - edges[:-2, None])
    upper = (edges[2:, None] - bins[None]) / (edges[2:, None] - edges[1:-1, None])
    return torch.clamp(torch.minimum(lower, upper), min=0.0)


class WhisperLogMel(nn.Module):
    """Whisper's log_mel_spectrogram after a pre-emphasis filter, per-utterance CMVN, then a Conv1d-GELU encoder
    and a mean-pooled classifier."""

    def __init__(self, n_fft: int = 16, hop: int = 5, n_mels: int = 7, classes: int = 5) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.register_buffer("filters", mel_filterbank(800, n_fft, n_mels), persistent=False)
        self.conv1 = nn.Conv1d(n_mels, 9, 3, padding=1)
        self.conv2 = nn.Conv1d(9, 9, 3, stride=2, padding=1)
        self.head = nn.Linear(9, classes)

    def log_mel(self, audio: Tensor) -> Tensor:
        audio = torch.cat([audio[:, :1], audio[:, 1:] - 0.97 * audio[:, :-1]], 1)
        stft = torch.stft(audio, self.n_fft, self.hop, window=self.window, return_complex=True)
        magnitudes = stft[..., :-1].abs() ** 2
        mel_spec = self.filters @ magnitudes
        log_spec = torch.clamp(mel_spec, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.amax(dim=(1, 2), keepdim=True) - 8.0)
        return (log_spec + 4.0) / 4.0

    def forward(self, audio: Tensor, label: Tensor) -> tuple:
        feats = self.log_mel(audio)
        feats = (feats - feats.mean(-1, keepdim=True)) / (feats.std(-1, keepdim=True) + 1e-5)
        h = F.gelu(self.conv2(F.gelu(self.conv1(feats))))
        logits = self.head(h.mean(-1))
        return logits, F.cross_entropy(logits, label)


def dct_matrix(n_mfcc: int, n_mels: int) -> Tensor:
    """torchaudio's create_dct with norm='ortho': (n_mels, n_mfcc)."""
    n = torch.arange(float(n_mels))
    k = torch.arange(float(n_mfcc)).unsqueeze(1)
    dct = torch.cos(math.pi / float(n_mels) * (n + 0.5) * k)
    dct[0] *= 1.0 / math.sqrt(2.0)
    dct *= math.sqrt(2.0 / float(n_mels))
    return dct.t()


def mask_along_axis_iid(specgrams: Tensor, mask_param: int, mask_value: float, axis: int) -> Tensor:
    """torchaudio.functional.mask_along_axis_iid: per example a band of width U(0, mask_param) starting at
    U(0, size - width), from torch.rand inside the step."""
    value = torch.rand(specgrams.shape[:axis - 1], device=specgrams.device) * mask_param
    min_value = torch.rand(specgrams.shape[:axis - 1], device=specgrams.device) * (specgrams.size(axis) - value)
    mask_start = min_value.long()[..., None, None]
    mask_end = (min_value.long() + value.long())[..., None, None]
    mask = torch.arange(0, specgrams.size(axis), device=specgrams.device)
    specgrams = specgrams.transpose(axis, -1)
    specgrams = specgrams.masked_fill((mask >= mask_start) & (mask < mask_end), mask_value)
    return specgrams.transpose(axis, -1)


class MFCCSpecAugment(nn.Module):
    """A pre-emphasis by torch.sub(x[:, 1:], x[:, :-1], alpha=0.97) and torchaudio's MFCC as its modules compute it,
    by hand: a DFT basis buffer (cos and -sin rows of a Hann-
    windowed real DFT) applied by matmul to frames from unfold, the power spectrum through a mel filterbank,
    AmplitudeToDB (10 log10(clamp(x, amin)) - 10 log10(max(amin, ref)), floored at the max - top_db per
    example), the orthonormal DCT; then SpecAugment's FrequencyMasking and TimeMasking (iid masks drawn by
    torch.rand in the step, the step seeding the generator as a training loop's seed does) and a GRU classifier."""

    def __init__(self, n_fft: int = 12, hop: int = 4, n_mels: int = 9, n_mfcc: int = 7, classes: int = 5,
                 top_db: float = 30.0) -> None:
        super().__init__()
        self.n_fft, self.hop, self.top_db = n_fft, hop, top_db
        window = torch.hann_window(n_fft)
        k = torch.arange(n_fft // 2 + 1)[:, None] * torch.arange(n_fft)[None] * (2 * math.pi / n_fft)
        self.register_buffer("dft", torch.cat([torch.cos(k), -torch.sin(k)]) * window, persistent=False)
        self.register_buffer("filters", mel_filterbank(800, n_fft, n_mels), persistent=False)
        self.register_buffer("dct", dct_matrix(n_mfcc, n_mels), persistent=False)
        self.gru = nn.GRU(n_mfcc, 9, batch_first=True)
        self.head = nn.Linear(9, classes)

    def forward(self, audio: Tensor, label: Tensor) -> tuple:
        audio = torch.sub(audio[:, 1:], audio[:, :-1], alpha=0.97)          # pre-emphasis
        padded = F.pad(audio[:, None], (self.n_fft // 2, self.n_fft // 2), mode="reflect")[:, 0]
        frames = padded.unfold(-1, self.n_fft, self.hop)                     # (b, frames, n_fft)
        spectrum = frames @ self.dft.t()
        real, imag = spectrum.chunk(2, -1)
        power = (real ** 2 + imag ** 2).transpose(1, 2)                       # (b, bins, frames)
        mel = self.filters @ power
        x_db = 10.0 * torch.log10(torch.clamp(mel, min=1e-10)) - 10.0 * math.log10(max(1e-10, 1.0))
        x_db = torch.max(x_db, (x_db.amax(dim=(-2, -1)) - self.top_db).view(-1, 1, 1))
        mfcc = torch.matmul(x_db.transpose(-1, -2), self.dct).transpose(-1, -2)   # (b, n_mfcc, frames)
        if self.training:
            mfcc = mask_along_axis_iid(mfcc, 3, 0.0, 1)
            mfcc = mask_along_axis_iid(mfcc, 4, 0.0, 2)
        out, _ = self.gru(mfcc.transpose(1, 2) / 10)
        logits = self.head(out[:, -1])
        return logits, F.cross_entropy(logits, label)


def stft_magnitude(x: Tensor, fft_size: int, hop: int, window: Tensor) -> Tensor:
    """parallel_wavegan's stft(): the magnitude, clamped under the sqrt, as (batch, frames, bins)."""
    spec = torch.stft(x, fft_size, hop, fft_size, window, return_complex=True)
    return torch.sqrt(torch.clamp(spec.real ** 2 + spec.imag ** 2, min=1e-7)).transpose(2, 1)


class MultiResolutionSTFTLoss(nn.Module):
    """A small waveform generator (Conv1d, tanh) trained by parallel_wavegan's multi-resolution STFT loss: per
    resolution the spectral convergence |Y - X|_F / |Y|_F and the L1 of log magnitudes, averaged."""

    def __init__(self, resolutions: tuple = ((16, 3), (8, 2), (32, 7))) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, 7, 5, padding=2), nn.Tanh(), nn.Conv1d(7, 1, 5, padding=2))
        self.resolutions = resolutions
        for fft_size, _ in resolutions:
            self.register_buffer(f"window_{fft_size}", torch.hann_window(fft_size), persistent=False)

    def forward(self, noisy: Tensor, clean: Tensor) -> tuple:
        y_hat = self.net(noisy[:, None])[:, 0]
        sc_loss = mag_loss = y_hat.new_zeros(())
        for fft_size, hop in self.resolutions:
            window = getattr(self, f"window_{fft_size}")
            x_mag = stft_magnitude(y_hat, fft_size, hop, window)
            y_mag = stft_magnitude(clean, fft_size, hop, window)
            sc_loss = sc_loss + torch.norm(y_mag - x_mag, p="fro") / torch.norm(y_mag, p="fro")
            mag_loss = mag_loss + F.l1_loss(torch.log(y_mag), torch.log(x_mag))
        n = len(self.resolutions)
        return y_hat, sc_loss / n + mag_loss / n


class PeriodDiscriminator(nn.Module):
    """HiFi-GAN's DiscriminatorP: the waveform folded into (t / period, period) after a reflect pad, (k, 1) Conv2d
    layers with leaky_relu(0.1); returns the flattened score and every layer's feature map."""

    def __init__(self, period: int) -> None:
        super().__init__()
        self.period = period
        self.convs = nn.ModuleList([nn.Conv2d(1, 4, (5, 1), (3, 1), padding=(2, 0)),
                                    nn.Conv2d(4, 6, (5, 1), (3, 1), padding=(2, 0)),
                                    nn.Conv2d(6, 6, (3, 1), 1, padding=(1, 0))])
        self.conv_post = nn.Conv2d(6, 1, (3, 1), 1, padding=(1, 0))

    def forward(self, x: Tensor) -> tuple:
        fmap = []
        b, c, t = x.shape
        if t % self.period != 0:
            n_pad = self.period - (t % self.period)
            x = F.pad(x, (0, n_pad), "reflect")
            t = t + n_pad
        x = x.view(b, c, t // self.period, self.period)
        for layer in self.convs:
            x = F.leaky_relu(layer(x), 0.1)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


def feature_loss(fmap_r: list, fmap_g: list) -> Tensor:
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss += torch.mean(torch.abs(rl - gl))
    return loss * 2


def discriminator_loss(disc_real_outputs: list, disc_generated_outputs: list) -> Tensor:
    loss = 0
    for dr, dg in zip(disc_real_outputs, disc_generated_outputs):
        loss += torch.mean((1 - dr) ** 2) + torch.mean(dg ** 2)
    return loss


def generator_loss(disc_outputs: list) -> Tensor:
    loss = 0
    for dg in disc_outputs:
        loss += torch.mean((1 - dg) ** 2)
    return loss


class HiFiGANLosses(nn.Module):
    """A tiny upsampling generator (ConvTranspose1d) against HiFi-GAN's multi-period discriminator (periods 2, 3,
    5 on a length no period divides): the discriminator loss on the detached fake, the generator's adversarial and
    feature-matching losses, and the mel-free L1 on the waveform."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Conv1d(3, 6, 3, padding=1), nn.LeakyReLU(0.1),
                                       nn.ConvTranspose1d(6, 4, 4, 2, 1), nn.LeakyReLU(0.1),
                                       nn.Conv1d(4, 1, 5, padding=2), nn.Tanh())
        self.discriminators = nn.ModuleList(PeriodDiscriminator(p) for p in (2, 3, 5))

    def forward(self, features: Tensor, audio: Tensor) -> tuple:
        y_g_hat = self.generator(features)
        y = audio[:, None]
        real_d = [d(y)[0] for d in self.discriminators]
        fake_d = [d(y_g_hat.detach())[0] for d in self.discriminators]
        loss_disc = discriminator_loss(real_d, fake_d)
        outs = [(d(y), d(y_g_hat)) for d in self.discriminators]
        fmap_r, fmap_g = [r[1] for r, _ in outs], [g[1] for _, g in outs]
        loss_fm = feature_loss(fmap_r, fmap_g)
        loss_gen = generator_loss([g[0] for _, g in outs])
        return y_g_hat, loss_disc + loss_gen + loss_fm + 45 * F.l1_loss(y_g_hat, y)


class Wav2Vec2Quantizer(nn.Module):
    """wav2vec 2.0 pretraining's quantizer and loss (fairseq's GumbelVectorQuantizer, HF's
    Wav2Vec2GumbelVectorQuantizer and compute_contrastive_logits): a feature encoder, a context network, grouped
    codebook logits, a hard Gumbel one-hot with the soft part's gradient (given noise), codevectors summed out of
    the codebook, the diversity loss, and the contrastive loss against distractors at temperature 0.1 with
    distractors equal to the positive masked to -inf."""

    def __init__(self, d_in: int = 5, d: int = 9, groups: int = 2, num_vars: int = 5, vq_dim: int = 6,
                 tau: float = 0.7) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, d), nn.GELU())
        self.context = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, vq_dim))
        self.weight_proj = nn.Linear(d, groups * num_vars)
        self.codevectors = nn.Parameter(torch.rand(1, groups * num_vars, vq_dim // groups))
        self.groups, self.num_vars, self.tau = groups, num_vars, tau

    def quantize(self, hidden: Tensor, gumbels: Tensor | None) -> tuple:
        b, t, _ = hidden.shape
        hidden = self.weight_proj(hidden).view(b * t * self.groups, -1)
        if gumbels is None:             # HF's form: drawn in the step
            probs = F.gumbel_softmax(hidden.float(), tau=self.tau, hard=True)
        else:                           # fairseq's hard Gumbel, by hand on given noise
            soft = ((hidden.float() + gumbels) / self.tau).softmax(-1)
            index = soft.max(-1, keepdim=True)[1]
            hard = torch.zeros_like(soft).scatter_(-1, index, 1.0)
            probs = hard - soft.detach() + soft
        avg_probs = torch.softmax(hidden.view(b * t, self.groups, -1).float(), dim=-1).mean(0)
        perplexity = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-7), dim=-1)).sum()
        probs = probs.type_as(hidden).view(b * t, -1)
        vectors = probs.unsqueeze(-1) * self.codevectors
        vectors = vectors.view(b * t, self.groups, self.num_vars, -1).sum(-2).view(b, t, -1)
        return vectors, perplexity

    def forward(self, frames: Tensor, mask: Tensor, negative_index: Tensor, gumbels: Tensor | None = None) -> tuple:
        features = self.encoder(frames)
        quantized, perplexity = self.quantize(features, gumbels)
        context = self.context(features.masked_fill(mask[..., None], 0.0))
        b, t, _ = quantized.shape
        negatives = quantized.view(b * t, -1)[negative_index.view(-1)].view(b, t, -1, quantized.shape[-1])
        negatives = negatives.permute(2, 0, 1, 3)
        targets = torch.cat([quantized[None], negatives], 0)
        logits = torch.cosine_similarity(context.float(), targets.float(), dim=-1).type_as(targets) / 0.1
        neg_is_pos = (quantized == negatives).all(-1)
        logits[1:][neg_is_pos] = float("-inf")
        logits = logits.transpose(0, 2).reshape(-1, logits.size(0))
        target = ((1 - mask.long()) * -100).transpose(0, 1).flatten()
        contrastive = F.cross_entropy(logits.float(), target, reduction="sum")
        total = self.groups * self.num_vars
        diversity = (total - perplexity) / total
        return context, contrastive / mask.sum() + 0.1 * diversity


class ECAPAAttentiveAAM(nn.Module):
    """A TDNN (dilated Conv1d, ReLU, BatchNorm1d) with ECAPA-TDNN's attentive statistics pooling (attention over
    time from the frames and their global mean and std, a softmax over time, the weighted mean and std), an
    embedding, and SpeechBrain's AdditiveAngularMargin on normalised weights."""

    def __init__(self, d_in: int = 5, channels: int = 9, emb: int = 7, speakers: int = 6, margin: float = 0.2,
                 scale: float = 30.0) -> None:
        super().__init__()
        self.tdnn = nn.Sequential(nn.Conv1d(d_in, channels, 3, dilation=2, padding=2), nn.ReLU(),
                                  nn.BatchNorm1d(channels))
        self.attention = nn.Sequential(nn.Conv1d(channels * 3, 5, 1), nn.Tanh(), nn.Conv1d(5, channels, 1))
        self.embed = nn.Linear(channels * 2, emb)
        self.weight = nn.Parameter(torch.randn(speakers, emb))
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)
        self.th, self.mm = math.cos(math.pi - margin), math.sin(math.pi - margin) * margin
        self.scale = scale

    @staticmethod
    def statistics(x: Tensor, w: Tensor, eps: float = 1e-12) -> tuple:
        mean = (w * x).sum(2)
        std = torch.sqrt((w * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(eps))
        return mean, std

    def forward(self, feats: Tensor, speaker: Tensor) -> tuple:
        x = self.tdnn(feats)
        t = x.shape[-1]
        uniform = torch.ones_like(x[:, :1]) / t
        mean, std = self.statistics(x, uniform)
        attn_in = torch.cat([x, mean.unsqueeze(2).repeat(1, 1, t), std.unsqueeze(2).repeat(1, 1, t)], 1)
        attn = F.softmax(self.attention(attn_in), dim=2)
        mean, std = self.statistics(x, attn)
        embedding = self.embed(torch.cat([mean, std], 1))
        cosine = F.linear(F.normalize(embedding), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - torch.pow(cosine, 2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine - self.th > 0, phi, cosine - self.mm)
        one_hot = F.one_hot(speaker, cosine.shape[1]).to(cosine.dtype)
        logits = self.scale * (one_hot * phi + (1.0 - one_hot) * cosine)
        return logits, F.cross_entropy(logits, speaker)


# --- recommendation ----------------------------------------------------------------------------------------

class DeepFM(nn.Module):
    """DeepFM (the deepctr-torch / pytorch-fm form): one table for all fields with per-field offsets, first-order
    weights of width 1 plus a bias, the FM interaction 0.5 * ((sum_f e_f)^2 - sum_f e_f^2), a DNN over the
    flattened embeddings, BCE with logits on a click label."""

    def __init__(self, field_dims: tuple = (5, 3, 7, 4), d: int = 5, hidden: int = 11) -> None:
        super().__init__()
        self.register_buffer("offsets", torch.tensor((0, *torch.tensor(field_dims).cumsum(0)[:-1].tolist())),
                             persistent=False)
        self.embedding = nn.Embedding(sum(field_dims), d)
        self.linear = nn.Embedding(sum(field_dims), 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense = nn.Linear(3, d)
        self.dnn = nn.Sequential(nn.Linear((len(field_dims) + 1) * d, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, fields: Tensor, dense: Tensor, click: Tensor) -> tuple:
        idx = fields + self.offsets[None]
        emb = torch.cat([self.embedding(idx), self.dense(dense)[:, None]], 1)
        square_of_sum = torch.sum(emb, dim=1) ** 2
        sum_of_square = torch.sum(emb ** 2, dim=1)
        fm = 0.5 * torch.sum(square_of_sum - sum_of_square, dim=1, keepdim=True)
        first = self.linear(idx).sum(1) + self.bias
        logit = (first + fm + self.dnn(emb.flatten(1))).squeeze(1)
        return torch.sigmoid(logit), F.binary_cross_entropy_with_logits(logit, click)


class DCNv2Mix(nn.Module):
    """DCN-v2's CrossNetMix (the official / deepctr-torch code): per layer, a mixture of low-rank experts x0 *
    (U tanh(C tanh(V^T x_l)) + b) gated by a softmax over the experts' gates; a parallel deep tower; a logit."""

    def __init__(self, d: int = 9, rank: int = 3, experts: int = 3, layers: int = 2) -> None:
        super().__init__()
        self.U = nn.ParameterList(nn.Parameter(torch.randn(experts, d, rank) * 0.3) for _ in range(layers))
        self.V = nn.ParameterList(nn.Parameter(torch.randn(experts, d, rank) * 0.3) for _ in range(layers))
        self.C = nn.ParameterList(nn.Parameter(torch.randn(experts, rank, rank) * 0.3) for _ in range(layers))
        self.gating = nn.ModuleList(nn.Linear(d, 1, bias=False) for _ in range(experts))
        self.bias = nn.ParameterList(nn.Parameter(torch.zeros(d, 1)) for _ in range(layers))
        self.deep = nn.Sequential(nn.Linear(d, 7), nn.ReLU(), nn.Linear(7, 5))
        self.out = nn.Linear(d + 5, 1)

    def cross(self, inputs: Tensor) -> Tensor:
        x_0 = inputs.unsqueeze(2)
        x_l = x_0
        for i in range(len(self.U)):
            output_of_experts, gating_score_of_experts = [], []
            for expert_id in range(len(self.gating)):
                gating_score_of_experts.append(self.gating[expert_id](x_l.squeeze(2)))
                v_x = torch.matmul(self.V[i][expert_id].t(), x_l)
                v_x = torch.tanh(v_x)
                v_x = torch.matmul(self.C[i][expert_id], v_x)
                v_x = torch.tanh(v_x)
                uv_x = torch.matmul(self.U[i][expert_id], v_x)
                dot_ = uv_x + self.bias[i]
                dot_ = x_0 * dot_
                output_of_experts.append(dot_.squeeze(2))
            output_of_experts = torch.stack(output_of_experts, 2)
            gating_score_of_experts = torch.stack(gating_score_of_experts, 1)
            moe_out = torch.matmul(output_of_experts, gating_score_of_experts.softmax(1))
            x_l = moe_out + x_l
        return x_l.squeeze(2)

    def forward(self, x: Tensor, click: Tensor) -> tuple:
        logit = self.out(torch.cat([self.cross(x), self.deep(x)], 1)).squeeze(1)
        return logit, F.binary_cross_entropy_with_logits(logit, click)


class Dice(nn.Module):
    """DIN's Dice activation as DeepCTR-Torch writes it: p = sigmoid(BatchNorm1d(x)) without affine, eps 1e-9
    (batch statistics in training), alpha (1 - p) x + p x."""

    def __init__(self, d: int, eps: float = 1e-9) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(d, eps=eps, affine=False)
        self.alpha = nn.Parameter(torch.full((d,), 0.25))

    def forward(self, x: Tensor) -> Tensor:
        x_p = torch.sigmoid(self.bn(x))
        return self.alpha * (1 - x_p) * x + x_p * x


class DIN(nn.Module):
    """Deep Interest Network: the candidate item's embedding attends over the user's behaviour history through
    the local activation unit (an MLP with Dice on [q, k, q - k, q * k]); padded positions get -2^32 + 1 before the
    softmax; the pooled interest, the candidate and a user feature go through an MLP with Dice; BCE with logits."""

    def __init__(self, items: int = 13, d: int = 5, hidden: int = 7) -> None:
        super().__init__()
        self.item = nn.Embedding(items, d, padding_idx=0)
        self.att_fc = nn.Linear(4 * d, hidden)
        self.att_dice = Dice(hidden)
        self.att_out = nn.Linear(hidden, 1)
        self.fc = nn.Linear(3 * d, hidden)
        self.dice = Dice(hidden)
        self.out = nn.Linear(hidden, 1)
        self.user = nn.Embedding(4, d)

    def forward(self, history: Tensor, candidate: Tensor, user: Tensor, click: Tensor) -> tuple:
        keys = self.item(history)                                       # (b, t, d)
        query = self.item(candidate)[:, None].expand_as(keys)
        b, t, d = keys.shape
        att_in = torch.cat([query, keys, query - keys, query * keys], -1).view(b * t, -1)
        score = self.att_out(self.att_dice(self.att_fc(att_in))).view(b, 1, t)
        mask = (history != 0)[:, None]
        paddings = torch.ones_like(score) * (-2 ** 32 + 1)
        score = F.softmax(torch.where(mask, score, paddings), dim=-1)
        interest = torch.matmul(score, keys).squeeze(1)
        h = self.dice(self.fc(torch.cat([interest, self.item(candidate), self.user(user)], -1)))
        logit = self.out(h).squeeze(1)
        return logit, F.binary_cross_entropy_with_logits(logit, click)


class TwoTowerLogQ(nn.Module):
    """A two-tower retrieval model (Yi et al. 2019, the TFRS / torchrec recipe): user and item towers,
    L2-normalised; in-batch softmax at a temperature with the logQ correction (log of each item's sampling
    probability subtracted from its column); accidental hits (the same item on another row) masked to finfo.min."""

    def __init__(self, users: int = 7, items: int = 11, d: int = 6, temperature: float = 0.2) -> None:
        super().__init__()
        self.user = nn.Embedding(users, d)
        self.item = nn.Embedding(items, d)
        self.user_tower = nn.Sequential(nn.Linear(d + 3, 9), nn.ReLU(), nn.Linear(9, d))
        self.item_tower = nn.Sequential(nn.Linear(d, 9), nn.ReLU(), nn.Linear(9, d))
        self.temperature = temperature

    def forward(self, user: Tensor, context: Tensor, item: Tensor, item_prob: Tensor) -> tuple:
        q = F.normalize(self.user_tower(torch.cat([self.user(user), context], -1)), dim=-1)
        c = F.normalize(self.item_tower(self.item(item)), dim=-1)
        logits = q @ c.t() / self.temperature - torch.log(item_prob)[None]
        same = (item[:, None] == item[None]) & ~torch.eye(len(item), dtype=torch.bool)
        logits = logits.masked_fill(same, torch.finfo(logits.dtype).min)
        labels = torch.arange(len(item))
        return logits, F.cross_entropy(logits, labels)


class BPRMatrixFactorization(nn.Module):
    """Matrix factorization with item biases trained by BPR (the pairwise -logsigmoid(x_ui - x_uj)) plus L2 on the
    rows the batch looked up, as the reference BPR-pytorch code writes it."""

    def __init__(self, users: int = 7, items: int = 13, d: int = 5, reg: float = 0.01) -> None:
        super().__init__()
        self.user = nn.Embedding(users, d)
        self.item = nn.Embedding(items, d)
        self.item_bias = nn.Embedding(items, 1)
        self.reg = reg

    def forward(self, user: Tensor, pos: Tensor, neg: Tensor) -> tuple:
        u, i, j = self.user(user), self.item(pos), self.item(neg)
        x_ui = (u * i).sum(1) + self.item_bias(pos).squeeze(1)
        x_uj = (u * j).sum(1) + self.item_bias(neg).squeeze(1)
        loss = -F.logsigmoid(x_ui - x_uj).mean()
        reg = self.reg * (u.norm(dim=1).pow(2).sum() + i.norm(dim=1).pow(2).sum() + j.norm(dim=1).pow(2).sum())
        return x_ui - x_uj, loss + reg / len(user)


class RankingLosses(nn.Module):
    """A scorer of query-document features trained by ListNet (softmax of the labels against log_softmax of the
    scores, padding at -inf / label 0), RankNet (pairwise BCE with logits on s_i - s_j where rel_i > rel_j) and
    LambdaRank (the pairwise logistic loss weighted by the detached |delta NDCG| of swapping i and j, ranks by
    argsort of argsort of the scores, gains 2^rel - 1, discounts 1 / log2(rank + 2), the ideal DCG from the labels
    sorted descending), over lists padded with a mask."""

    def __init__(self, d: int = 7) -> None:
        super().__init__()
        self.scorer = nn.Sequential(nn.Linear(d, 9), nn.ELU(), nn.Linear(9, 1))

    def forward(self, docs: Tensor, relevance: Tensor, valid: Tensor) -> tuple:
        scores = self.scorer(docs).squeeze(-1)                           # (queries, docs)
        rel = relevance.to(scores.dtype)
        masked = scores.masked_fill(~valid, float("-inf"))
        listnet = -(F.softmax(rel.masked_fill(~valid, float("-inf")), -1)
                    * F.log_softmax(masked, -1).masked_fill(~valid, 0.0)).sum(-1).mean()
        diff = scores[:, :, None] - scores[:, None, :]
        pair = (rel[:, :, None] > rel[:, None, :]) & valid[:, :, None] & valid[:, None, :]
        ranknet = F.binary_cross_entropy_with_logits(diff, torch.ones_like(diff), reduction="none")
        ranknet = (ranknet * pair).sum() / pair.sum()
        with torch.no_grad():
            ranks = masked.argsort(-1, descending=True).argsort(-1).to(scores.dtype)
            gains = torch.pow(2.0, rel) - 1
            discounts = 1.0 / torch.log2(ranks + 2.0)
            ideal, _ = torch.sort(rel * valid, -1, descending=True)
            ideal_dcg = ((torch.pow(2.0, ideal) - 1) / torch.log2(torch.arange(rel.shape[-1]) + 2.0)).sum(-1)
            delta = ((gains[:, :, None] - gains[:, None, :]) * (discounts[:, :, None] - discounts[:, None, :])).abs()
            delta = delta / ideal_dcg.clamp(min=1e-10)[:, None, None]
        lambdarank = (delta * F.softplus(-diff) * pair).sum() / pair.sum()
        return scores, listnet + ranknet + lambdarank


def cast_bf16(case: Case) -> Case:
    """The case with the model and its float inputs cast to bfloat16 whole: every op of the user's rounds to bf16."""
    def batch(g: torch.Generator) -> tuple:
        inputs, target = case.batch(g)
        return tuple(t.bfloat16() if t.is_floating_point() else t for t in inputs), target
    return Case(f"{case.name}_bf16_cast", lambda: case.build().bfloat16(), batch, case.step, case.zero_grad, bf16=True)


# --- the cases ---------------------------------------------------------------------------------------------

def _audio(g: torch.Generator, n: int = 3, length: int = 83) -> tuple:
    """Tones over a DC offset (a microphone's), with noise."""
    t = torch.arange(length) / 800.0
    tone = torch.sin(2 * math.pi * torch.tensor([[97.0], [211.0], [143.0]])[:n] * t) + 1.5
    return (tone + 0.1 * torch.randn(n, length, generator=g), torch.randint(0, 5, (n,), generator=g)), None


def seeded(model: nn.Module, inputs: tuple, target: Tensor | None) -> tuple:
    """own_loss with the global generator seeded first, as a training script seeds it: the random draws inside
    the model are then the same in eager and compiled runs."""
    torch.manual_seed(7)
    return model(*inputs)


def _wav2vec2_drawn(g: torch.Generator) -> tuple:
    return _wav2vec2(g)[0][:3], None


def _denoise(g: torch.Generator) -> tuple:
    clean = torch.sin(torch.arange(71) * 0.3)[None] * torch.rand(3, 1, generator=g) + 0.05
    return (clean + 0.2 * torch.randn(3, 71, generator=g), clean), None


def _hifigan(g: torch.Generator) -> tuple:
    return (torch.randn(2, 3, 19, generator=g), torch.randn(2, 38, generator=g).tanh()), None


def _wav2vec2(g: torch.Generator, b: int = 2, t: int = 7, negatives: int = 4) -> tuple:
    mask = torch.rand(b, t, generator=g) < 0.5
    mask[:, 0] = True
    u = torch.rand(b * t * 2, 5, generator=g) * 0.98 + 0.01
    index = torch.randint(0, b * t, (b, t, negatives), generator=g)
    index[0, 1, 0] = 0 * t + 1            # one distractor is the positive itself: masked to -inf
    return (torch.randn(b, t, 5, generator=g), mask, index, -torch.log(-torch.log(u))), None


def _speakers(g: torch.Generator) -> tuple:
    return (torch.randn(5, 5, 13, generator=g), torch.randint(0, 6, (5,), generator=g)), None


def _ctr(g: torch.Generator, n: int = 9) -> tuple:
    fields = torch.stack([torch.randint(0, k, (n,), generator=g) for k in (5, 3, 7, 4)], 1)
    return fields, (torch.rand(n, generator=g) < 0.4).float()


def _deepfm(g: torch.Generator) -> tuple:
    fields, click = _ctr(g)
    return (fields, torch.randn(9, 3, generator=g), click), None


def _dcn(g: torch.Generator) -> tuple:
    return (torch.randn(9, 9, generator=g), (torch.rand(9, generator=g) < 0.4).float()), None


def _din(g: torch.Generator, n: int = 7, t: int = 6) -> tuple:
    history = torch.randint(1, 13, (n, t), generator=g)
    lengths = torch.tensor([6, 3, 1, 5, 2, 6, 4])
    history = history.masked_fill(torch.arange(t)[None] >= lengths[:, None], 0)
    return (history, torch.randint(1, 13, (n,), generator=g), torch.randint(0, 4, (n,), generator=g),
            (torch.rand(n, generator=g) < 0.5).float()), None


def _two_tower(g: torch.Generator, n: int = 9) -> tuple:
    item = torch.randint(0, 11, (n,), generator=g)
    item[4] = item[1]                           # an accidental hit
    counts = torch.bincount(torch.randint(0, 11, (50,), generator=g), minlength=11).float() + 1
    return (torch.randint(0, 7, (n,), generator=g), torch.randn(n, 3, generator=g), item,
            (counts / counts.sum())[item]), None


def _bpr(g: torch.Generator, n: int = 11) -> tuple:
    return (torch.randint(0, 7, (n,), generator=g), torch.randint(0, 13, (n,), generator=g),
            torch.randint(0, 13, (n,), generator=g)), None


def _ranking(g: torch.Generator, queries: int = 3, docs: int = 7) -> tuple:
    valid = torch.arange(docs)[None] < torch.tensor([[7], [5], [4]])
    relevance = torch.randint(0, 4, (queries, docs), generator=g) * valid
    return (torch.randn(queries, docs, 7, generator=g), relevance, valid), None


def cases() -> list[Case]:
    whisper = Case("whisper_log_mel_cmvn", WhisperLogMel, _audio, own_loss)
    stft_loss = Case("multi_resolution_stft_loss", MultiResolutionSTFTLoss, _denoise, own_loss)
    hifigan = Case("hifigan_mpd_feature_matching", HiFiGANLosses, _hifigan, own_loss)
    wav2vec2 = Case("wav2vec2_gumbel_quantizer", Wav2Vec2Quantizer, _wav2vec2, own_loss)
    wav2vec2_drawn = Case("wav2vec2_gumbel_softmax_in_step", Wav2Vec2Quantizer, _wav2vec2_drawn, seeded)
    mfcc = Case("mfcc_specaugment_in_step", MFCCSpecAugment, _audio, seeded)
    # the attention's last bias adds a constant over time to each channel's logits: the softmax over time drops it
    ecapa = Case("ecapa_attentive_stats_aam", ECAPAAttentiveAAM, _speakers, own_loss,
                 zero_grad=(("attention.2.bias", slice(None)),))
    # the DNN's first bias is followed by a BatchNorm in training mode, which subtracts the batch mean
    deepfm = Case("deepfm", DeepFM, _deepfm, own_loss, zero_grad=(("dnn.0.bias", slice(None)),))
    dcn = Case("dcnv2_low_rank_mixture", DCNv2Mix, _dcn, own_loss)
    din = Case("din_dice_target_attention", DIN, _din, own_loss)
    two_tower = Case("two_tower_logq_in_batch", TwoTowerLogQ, _two_tower, own_loss)
    bpr = Case("bpr_matrix_factorization", BPRMatrixFactorization, _bpr, own_loss)
    # every loss reads score differences within a list (log_softmax, s_i - s_j): the last bias shifts them all
    ranking = Case("listnet_ranknet_lambdarank", RankingLosses, _ranking, own_loss,
                   zero_grad=(("scorer.2.bias", slice(None)),))
    return [whisper, mfcc, stft_loss, hifigan, wav2vec2, wav2vec2_drawn, ecapa, deepfm, dcn, din, two_tower, bpr,
            ranking,
            *(bf16(c) for c in (deepfm, two_tower)),
            *(fp64(c) for c in (whisper, mfcc, ecapa, ranking)),
            *(cast_bf16(c) for c in (mfcc, wav2vec2, ecapa, deepfm, din, two_tower, bpr, ranking, hifigan))]
