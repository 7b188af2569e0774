"""A fourth set of models written the way users write them, for tests/test_optimizer_user_models_fourth.py.

tests/user_models.py, tests/user_models_more.py and tests/user_models_third.py cover transformers,
convnets, hand-written recurrent cells, many losses and view idioms. These cover what they do not:
a DCGAN generator (ConvTranspose2d, BatchNorm2d, Tanh) with bilinear upsampling at align_corners=True;
the library recurrent modules (nn.LSTM and nn.GRU: two layers, bidirectional, batch_first);
nn.TransformerDecoderLayer with cross-attention to a memory, a causal tgt_mask from
nn.Transformer.generate_square_subsequent_mask and boolean key padding masks, post- and pre-norm;
weight_norm and spectral_norm parametrizations (the power iteration writes buffers in forward);
metric losses (triplet margin, cosine embedding, a cdist contrastive loss, a focal loss by hand with
pos_weight, nll after log_softmax, CTC); one block applied three times (ALBERT's weight sharing)
through activation checkpointing; pointwise idioms (lerp with a tensor weight, addcmul, where with
scalars, clamp with tensor bounds, torch.norm over a dim, glu, hardswish and silu on channels_last);
rarer losses (margin ranking, multi-margin, soft margins, hinge, Poisson and Gaussian NLL, KL with
log_target), activations and maths (shrinks, softmin, erfinv, xlogy, atan2, hypot, nn.Bilinear),
integer idioms (one_hot, bucketize, take_along_dim, index_put with accumulate, diag_embed, kron, rot90,
an Embedding with max_norm, which renormalizes its weight in forward), Conv3d, antialiased
interpolation, pixel_unshuffle, local response norm and LP pooling; models cast to float16 and fp16
autocast. Sizes are odd and tiny. Each model comes as a `tests.user_models.Case`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

from tests.user_models import Case, classify
from tests.user_models_more import fp64, own_loss


class DCGANGenerator(nn.Module):
    """A latent (B, z) to a 3-channel image: ConvTranspose2d stem from 1x1, two stride-2 ConvTranspose2d
    with BatchNorm2d and ReLU, Tanh; a bilinear upsampling with align_corners=True; MSE to a target."""

    def __init__(self, z: int = 7, ch: int = 6) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(z, 2 * ch, 3, 1, 0, bias=False), nn.BatchNorm2d(2 * ch), nn.ReLU(True),   # 3x3
            nn.ConvTranspose2d(2 * ch, ch, 4, 2, 1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(True),      # 6x6
            nn.ConvTranspose2d(ch, 3, 4, 2, 1, bias=False), nn.Tanh())                                   # 12x12

    def forward(self, z: Tensor, target: Tensor) -> tuple:
        img = self.net(z[:, :, None, None])
        up = F.interpolate(img, size=(17, 17), mode="bilinear", align_corners=True)
        return up, F.mse_loss(up, target)


class Recurrent(nn.Module):
    """Embedding, a 2-layer bidirectional batch_first nn.LSTM, a 1-layer nn.GRU over its outputs
    from a learned initial state; the last step's output and the final hidden states to a head."""

    def __init__(self, vocab: int = 17, d: int = 6, h: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, h, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(2 * h, h, batch_first=True)
        self.h0 = nn.Parameter(torch.zeros(1, 1, h))
        self.head = nn.Linear(h + 4 * h, classes)

    def forward(self, idx: Tensor) -> Tensor:
        out, (hn, _) = self.lstm(self.emb(idx))                  # out (B, T, 2h), hn (4, B, h)
        y, _ = self.gru(out, self.h0.expand(-1, idx.shape[0], -1).contiguous())
        return self.head(torch.cat([y[:, -1], hn.transpose(0, 1).flatten(1)], -1))


class Seq2Seq(nn.Module):
    """An encoder layer over the source, then nn.TransformerDecoderLayer (cross-attention to its output):
    a causal tgt_mask from generate_square_subsequent_mask, boolean padding masks of target and memory;
    `norm_first` picks pre- or post-norm; forward returns (logits, loss with ignore_index)."""

    def __init__(self, norm_first: bool, vocab: int = 19, d: int = 12) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoderLayer(d, 3, 2 * d, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.dec = nn.TransformerDecoderLayer(d, 3, 2 * d, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.head = nn.Linear(d, vocab)

    def forward(self, src: Tensor, tgt: Tensor, src_pad: Tensor, tgt_pad: Tensor, labels: Tensor) -> tuple:
        mem = self.enc(self.emb(src), src_key_padding_mask=src_pad)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        y = self.dec(self.emb(tgt), mem, tgt_mask=causal, tgt_is_causal=True, tgt_key_padding_mask=tgt_pad,
                     memory_key_padding_mask=src_pad)
        logits = self.head(y)
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


class Parametrized(nn.Module):
    """weight_norm on a Linear and a Conv1d, spectral_norm on a Linear (its power iteration updates the
    u, v buffers in forward under training)."""

    def __init__(self, d: int = 7, classes: int = 3) -> None:
        super().__init__()
        self.conv = parametrizations.weight_norm(nn.Conv1d(3, 5, 3, padding=1))
        self.lin = parametrizations.weight_norm(nn.Linear(5 * d, 11))
        self.sn = parametrizations.spectral_norm(nn.Linear(11, 9))
        self.head = nn.Linear(9, classes)

    def forward(self, x: Tensor) -> Tensor:                     # x (B, 3, d)
        h = F.leaky_relu(self.conv(x), 0.2).flatten(1)
        return self.head(F.elu(self.sn(torch.tanh(self.lin(h)))))


class MetricLosses(nn.Module):
    """An embedding tower; triplet margin loss on (anchor, positive, negative), cosine embedding loss with
    +-1 labels, a contrastive loss on torch.cdist distances with a margin, a focal loss written by hand
    on BCE-with-logits (pos_weight), nll_loss after log_softmax; forward returns (embeddings, loss)."""

    def __init__(self, d: int = 9, e: int = 6, classes: int = 4) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(d, 13), nn.SiLU(), nn.Linear(13, e))
        self.cls = nn.Linear(e, classes)
        self.register_buffer("pos_weight", torch.tensor([2.0, 0.5, 1.0, 3.0]))

    def forward(self, a: Tensor, p: Tensor, n: Tensor, same: Tensor, multi: Tensor, label: Tensor) -> tuple:
        ea, ep, en = self.tower(a), self.tower(p), self.tower(n)
        triplet = F.triplet_margin_loss(ea, ep, en, margin=0.5)
        cosine = F.cosine_embedding_loss(ea, en, same, margin=0.1)
        dist = torch.cdist(ea, ep)                              # (B, B): the diagonal are the positive pairs
        eye = torch.eye(a.shape[0], dtype=torch.bool)
        contrastive = torch.where(eye, dist.pow(2), F.relu(1.0 - dist).pow(2)).mean()
        logits = self.cls(ea)
        bce = F.binary_cross_entropy_with_logits(logits, multi, pos_weight=self.pos_weight, reduction="none")
        pt = torch.exp(-bce)
        focal = ((1 - pt) ** 2 * bce).mean()
        nll = F.nll_loss(F.log_softmax(logits, dim=-1), label)
        return ea, triplet + cosine + contrastive + focal + nll


class CTCHead(nn.Module):
    """Conv1d features over time, log_softmax over the blank + 5 symbols, F.ctc_loss with target lengths
    and input lengths per sample; forward returns (log probs, loss)."""

    def __init__(self, c: int = 4, symbols: int = 6) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c, 8, 3, padding=1)
        self.out = nn.Linear(8, symbols)

    def forward(self, x: Tensor, targets: Tensor, in_len: Tensor, tgt_len: Tensor) -> tuple:   # x (B, c, T)
        logp = self.out(F.gelu(self.conv(x)).transpose(1, 2)).log_softmax(-1).transpose(0, 1)   # (T, B, S)
        return logp, F.ctc_loss(logp, targets, in_len, tgt_len, zero_infinity=True)


class SharedBlock(nn.Module):
    """Pre-norm MLP with a residual."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Albert(nn.Module):
    """ALBERT's factorized embedding (vocab -> 5 -> d) and one block applied three times, each application
    under torch.utils.checkpoint (use_reentrant=False); mean pooling, head."""

    def __init__(self, vocab: int = 23, d: int = 10, classes: int = 3) -> None:
        super().__init__()
        self.emb, self.proj = nn.Embedding(vocab, 5), nn.Linear(5, d)
        self.block = SharedBlock(d)
        self.head = nn.Linear(d, classes)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.proj(self.emb(idx))
        for _ in range(3):
            h = checkpoint(self.block, h, use_reentrant=False)
        return self.head(h.mean(1))


class PointwiseZoo(nn.Module):
    """On a channels_last conv output: hardswish, silu, glu over channels; lerp with a tensor weight,
    addcmul, where with scalar branches, clamp between tensor bounds, torch.norm(p=2) over a dim."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gate = nn.Parameter(torch.rand(4, 1, 1))
        self.lo, self.hi = nn.Parameter(-torch.rand(4, 1, 1) * 0.5), nn.Parameter(torch.rand(4, 1, 1) * 0.5)
        self.head = nn.Linear(4 + 7 + 4, classes)

    def forward(self, x: Tensor) -> Tensor:                     # x (B, 3, 7, 7) channels_last
        h = self.conv(x)
        a, b = F.hardswish(h), F.silu(h)
        g = F.glu(a + b, dim=1)                                 # (B, 4, 7, 7)
        m = torch.lerp(g, torch.tanh(h[:, :4]), torch.sigmoid(self.gate))
        m = torch.addcmul(m, g, h[:, 4:], value=0.5)
        m = torch.where(m > 0.1, m, 0.0) + torch.where(h[:, :4] < 0, -1.0, 1.0) * 0.05
        c = torch.clamp(m, min=self.lo, max=self.hi)
        n = torch.norm(c, p=2, dim=(2, 3))                      # (B, 4)
        rows = torch.norm(m.mean(1), p=2, dim=-1)               # (B, 7)
        return self.head(torch.cat([n, rows, c.amax((2, 3))], -1))


class MoreLosses(nn.Module):
    """Two heads over a shared trunk; margin ranking, multi-class margin, multi-label soft margin, soft
    margin, hinge embedding (on pairwise_distance), Poisson NLL (log input), Gaussian NLL with a predicted
    variance, KL divergence with log_target=True; forward returns (scores, loss)."""

    def __init__(self, d: int = 9, classes: int = 5) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, 11), nn.CELU(0.7), nn.Linear(11, 11), nn.SELU())
        self.cls, self.reg = nn.Linear(11, classes), nn.Linear(11, 2)

    def forward(self, x: Tensor, y: Tensor, label: Tensor, multi: Tensor, sign: Tensor, counts: Tensor) -> tuple:
        h, hy = self.trunk(x), self.trunk(y)
        sign = sign.detach()                                       # a label: the losses take no gradient in it
        s = self.cls(h)
        rank = F.margin_ranking_loss(s[:, 0], s[:, 1], sign, margin=0.2)
        mm = F.multi_margin_loss(s, label, p=1, margin=0.5)
        mls = F.multilabel_soft_margin_loss(s, multi)
        sm = F.soft_margin_loss(s[:, 2], sign)
        hinge = F.hinge_embedding_loss(F.pairwise_distance(h, hy), sign, margin=2.0)
        mean, logvar = self.reg(h).unbind(-1)
        pois = F.poisson_nll_loss(mean, counts, log_input=True)
        gauss = F.gaussian_nll_loss(mean, counts, logvar.exp(), full=True)
        kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(self.cls(hy), -1), reduction="batchmean", log_target=True)
        return s, rank + mm + mls + sm + hinge + pois + gauss + kl


class ActivationZoo(nn.Module):
    """Rarer activations and maths: softsign, tanhshrink, softshrink, hardshrink, logsigmoid, softmin,
    erfinv of a squashed value, xlogy, atan2, hypot, expm1, log1p, frac; nn.Bilinear; BatchNorm1d and a
    LayerNorm without affine parameters."""

    def __init__(self, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 2 * d)
        self.bil = nn.Bilinear(d, d, 6)
        self.bn = nn.BatchNorm1d(2 * d)
        self.ln = nn.LayerNorm(d, elementwise_affine=False)
        self.head = nn.Linear(2 * d + 6 + 7, classes)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.bn(self.lin(x)).chunk(2, -1)
        acts = [F.softsign(a), F.tanhshrink(b), F.softshrink(a, 0.3), F.hardshrink(b, 0.2), F.logsigmoid(a)]
        soft = F.softmin(b, -1)
        maths = [torch.erfinv(torch.tanh(a) * 0.9), torch.xlogy(soft, soft + 0.1), torch.atan2(a, b),
                 torch.hypot(a, b), torch.expm1(a.clamp(max=2)), torch.log1p(b.abs()), torch.frac(3 * a)]
        feats = torch.stack([t.mean(-1) for t in acts + maths], -1)    # (B, 12)
        bil = self.bil(self.ln(a), b)
        return self.head(torch.cat([a + b, soft * 3, bil, feats[:, :7] + feats[:, 5:]], -1))


class IndexingZoo(nn.Module):
    """Integer idioms: one_hot of labels matmul'd with a table, bucketize of values into learned-free
    boundaries, take_along_dim with argsort, index_put with accumulate=True, diag_embed, trace, kron,
    rot90, nn.Embedding(max_norm) (which renormalizes its weight in forward)."""

    def __init__(self, d: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, d) * 0.5)
        self.emb = nn.Embedding(9, d, max_norm=1.0)
        self.lin = nn.Linear(d, d)
        self.small = nn.Parameter(torch.randn(2, 2) * 0.5)
        self.register_buffer("bounds", torch.tensor([-1.0, -0.2, 0.3, 1.1]))
        self.head = nn.Linear(4 * d + 3, classes)

    def forward(self, x: Tensor, label: Tensor, ids: Tensor) -> Tensor:     # x (B, d)
        B, D = x.shape
        h = torch.tanh(self.lin(x))
        oh = F.one_hot(label, 5).to(h.dtype) @ self.table              # (B, d)
        buckets = torch.bucketize(h.detach(), self.bounds)             # (B, d) in 0..4
        bucketed = torch.take_along_dim(self.table, buckets.clamp(max=4)[:, :1].expand(-1, D), 0)   # (B, d)
        order = h.argsort(-1)
        sorted_h = torch.take_along_dim(h, order, -1)
        acc = torch.zeros(5, D, dtype=h.dtype).index_put((label,), h, accumulate=True)   # (5, d)
        de = torch.diag_embed(h)                                       # (B, d, d)
        tr = torch.stack([torch.trace(m) for m in (de @ de).unbind(0)])   # (B,)
        k = torch.kron(self.small, h[:, :3].mean(0)[:, None]).flatten()[:2]   # (2,)
        r = torch.rot90(de, 1, (1, 2))[:, 0, :3]                       # (B, 3)
        e = self.emb(ids).mean(1)                                      # (B, d)
        return self.head(torch.cat([oh + bucketed, sorted_h, acc[label], e, r + tr[:, None] + k.sum()], -1))


class PoolingZoo(nn.Module):
    """Conv3d over a short clip, antialiased bilinear downsampling, pixel_unshuffle, local response
    norm, LP pooling, avg_pool1d and max_pool1d over a flattened row."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.c3 = nn.Conv3d(2, 4, (2, 3, 3), padding=(0, 1, 1))
        self.c2 = nn.Conv2d(16, 6, 1)
        self.head = nn.Linear(6 + 4 + 5, classes)

    def forward(self, clip: Tensor) -> Tensor:                     # clip (B, 2, 3, 10, 10)
        h = F.relu(self.c3(clip)).mean(2)                          # (B, 4, 10, 10)
        small = F.interpolate(h, size=(6, 6), mode="bilinear", antialias=True, align_corners=False)
        lrn = F.local_response_norm(small, 3)
        un = F.pixel_unshuffle(lrn, 2)                             # (B, 16, 3, 3)
        y = self.c2(un)
        lp = F.lp_pool2d(y.abs() + 0.1, 2, 3).flatten(1)          # (B, 6)
        row = h.flatten(2).mean(1, keepdim=True)                   # (B, 1, 100)
        p1 = F.avg_pool1d(row, 5, 5) + F.max_pool1d(row, 5, 5)   # (B, 1, 20)
        return self.head(torch.cat([lp, small.amax((2, 3)), p1.view(-1, 5, 4).mean(-1)], -1))


# --- the cases --------------------------------------------------------------------------------------------

def _latent(g: torch.Generator) -> tuple:
    return (torch.randn(3, 7, generator=g), torch.rand(3, 3, 17, 17, generator=g) * 2 - 1), None


def _tokens(g: torch.Generator) -> tuple:
    return (torch.randint(0, 17, (3, 4), generator=g),), torch.randint(0, 3, (3,), generator=g)


def _seq2seq(g: torch.Generator) -> tuple:
    src, tgt = torch.randint(1, 19, (2, 7), generator=g), torch.randint(1, 19, (2, 5), generator=g)
    src_pad, tgt_pad = torch.zeros(2, 7, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool)
    src_pad[1, 5:] = True
    tgt_pad[0, 4:] = True
    labels = torch.randint(0, 19, (2, 5), generator=g).masked_fill(tgt_pad, -100)
    return (src, tgt, src_pad, tgt_pad, labels), None


def _signals(g: torch.Generator) -> tuple:
    return (torch.randn(4, 3, 7, generator=g),), torch.randint(0, 3, (4,), generator=g)


def _metric(g: torch.Generator) -> tuple:
    n = 5
    a, p, neg = (torch.randn(n, 9, generator=g) for _ in range(3))
    same = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0])
    multi = (torch.rand(n, 4, generator=g) > 0.5).float()
    return (a, p, neg, same, multi, torch.randint(0, 4, (n,), generator=g)), None


def _ctc(g: torch.Generator) -> tuple:
    targets = torch.randint(1, 6, (3, 4), generator=g)
    return (torch.randn(3, 4, 11, generator=g), targets, torch.tensor([11, 9, 7]), torch.tensor([4, 2, 3])), None


def _albert(g: torch.Generator) -> tuple:
    return (torch.randint(0, 23, (3, 7), generator=g),), torch.randint(0, 3, (3,), generator=g)


def _channels_last(g: torch.Generator) -> tuple:
    x = torch.randn(3, 3, 7, 7, generator=g).to(memory_format=torch.channels_last)
    return (x,), torch.randint(0, 3, (3,), generator=g)


def _loss_batch(g: torch.Generator) -> tuple:
    n = 6
    sign = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    return ((torch.randn(n, 9, generator=g), torch.randn(n, 9, generator=g), torch.randint(0, 5, (n,), generator=g),
             (torch.rand(n, 5, generator=g) > 0.5).float(), sign, torch.randint(0, 4, (n,), generator=g).float()), None)


def _features(g: torch.Generator) -> tuple:
    return (torch.randn(5, 8, generator=g),), torch.randint(0, 3, (5,), generator=g)


def _indexing(g: torch.Generator) -> tuple:
    label = torch.tensor([0, 3, 3, 1])
    return ((torch.randn(4, 6, generator=g), label, torch.randint(0, 9, (4, 3), generator=g)),
            torch.randint(0, 3, (4,), generator=g))


def _clip(g: torch.Generator) -> tuple:
    return (torch.randn(2, 2, 3, 10, 10, generator=g),), torch.randint(0, 3, (2,), generator=g)


def classify_rnn(model: nn.Module, inputs: tuple, target: Tensor) -> tuple:
    """classify with Dynamo's allow_rnn: by default Dynamo breaks the graph at nn.LSTM/nn.GRU and runs them
    outside it, as eager ATen calls (its config flag, read when the first call traces the model)."""
    with torch._dynamo.config.patch(allow_rnn=True):
        return classify(model, inputs, target)


def half(case: Case) -> Case:
    """The case with the model and its float inputs in float16; a classifier's loss of the fp16 logits in fp32."""
    def batch(g: torch.Generator) -> tuple:
        inputs, target = case.batch(g)
        return tuple(t.half() if t.is_floating_point() else t for t in inputs), target

    def step(model: nn.Module, inputs: tuple, target: Tensor | None) -> tuple:
        if case.step is own_loss:
            return model(*inputs)
        out = case.step(model, inputs, target)[0]
        return out, F.cross_entropy(out.float(), target)
    return Case(f"{case.name}_fp16", lambda: case.build().half(), batch, step, case.zero_grad, fp16=True)


def fp16_autocast(case: Case) -> Case:
    """The case under fp16 autocast (the CPU's autocast takes float16 as well as bfloat16)."""
    def step(model: nn.Module, inputs: tuple, target: Tensor | None) -> tuple:
        with torch.autocast("cpu", dtype=torch.float16):
            return case.step(model, inputs, target)
    return Case(f"{case.name}_fp16_autocast", case.build, case.batch, step, case.zero_grad, fp16=True)


# Elements whose gradient is exactly zero in exact arithmetic (both runs hold rounding noise there).
_BATCHNORM_ZERO = (("lin.bias", slice(None)),)            # the Linear's bias before BatchNorm1d


def cases() -> list[Case]:
    dcgan = Case("dcgan_generator", DCGANGenerator, _latent, own_loss)
    recurrent = Case("lstm_gru", Recurrent, _tokens, classify_rnn)
    prenorm = Case("seq2seq_prenorm", lambda: Seq2Seq(True), _seq2seq, own_loss)
    parametrized = Case("parametrized", Parametrized, _signals, classify)
    metric = Case("metric_losses", MetricLosses, _metric, own_loss)
    albert = Case("albert_checkpoint", Albert, _albert, classify)
    return [
        dcgan, recurrent, Case("seq2seq_postnorm", lambda: Seq2Seq(False), _seq2seq, own_loss), prenorm,
        parametrized, metric, Case("ctc", CTCHead, _ctc, own_loss), albert,
        Case("pointwise_channels_last", PointwiseZoo, _channels_last, classify),
        Case("more_losses", MoreLosses, _loss_batch, own_loss),
        Case("activation_zoo", ActivationZoo, _features, classify, _BATCHNORM_ZERO),
        Case("indexing_zoo", IndexingZoo, _indexing, classify),
        Case("pooling_zoo", PoolingZoo, _clip, classify),
        # fp64: fp32's tolerance in units of fp64's epsilon, so a value computed in fp32 anywhere fails
        *(fp64(c) for c in (recurrent, metric)),
        # fp16 models (weight_norm's backward wanted fp32 norms) and fp16 autocast
        *(half(c) for c in (dcgan, prenorm, parametrized, albert)),
        *(fp16_autocast(c) for c in (dcgan, prenorm, albert)),
    ]
