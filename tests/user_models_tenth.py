"""A tenth set of models written the way users write them, for tests/test_optimizer_user_models_tenth.py.

The earlier sets hold one small GCN/GAT layer (tests/user_models.GraphNet), segment pooling
(tests/user_models_eighth.SegmentPool), F.ctc_loss and WaveNet. These are the graph, speech and
structured-prediction models as their reference implementations write them, by hand: a GCN with self-loops
and symmetric degree normalisation (scatter_add_ of ones, pow(-0.5), index_add_ into zeros); a two-layer
multi-head GAT whose edge softmax takes the per-node max by scatter_reduce("amax", include_self=False)
(detached in one layer, as PyG does, not in the other), exp, and the sum by index_add_; GIN with a trained
eps and a graph readout of mean by scatter_reduce("mean", include_self=False) and max by scatter_reduce onto
-inf with an empty graph put back to zero by torch.where; DGCNN's EdgeConv with k nearest neighbours by
cdist + topk on the points and again on the features. Speech: a Conformer block (macaron half-step FFNs,
attention with a learned relative-position bias and a key padding mask, a conv module of pointwise Conv1d,
GLU, depthwise Conv1d, BatchNorm1d, SiLU); a log-mel front end (reflect padding, frames by unfold, a Hann
window, the DFT and the mel filterbank as matmuls of |X|^2, log) with SpecAugment time and frequency masks
from arange comparisons; an RNN-T with a stateless predictor, the joint as a broadcast add to a 4-D
log_softmax and the transducer loss as a Python loop over the (t, u) lattice with logaddexp; an x-vector
TDNN (dilated Conv1d) with masked statistics pooling (mean and std over the valid frames). Structured
prediction: a linear-chain CRF's loss (the forward algorithm by logsumexp in a Python loop, the gold path
score by gather and transition indexing); a pointer network (a GRUCell decoder, already-chosen inputs
masked_fill'ed to -inf before log_softmax); a biaffine dependency parser (einsum 'bxi,oij,byj->boxy',
padded heads masked). Sequence details: lengths to a mask by arange < lengths[:, None], positions by cumsum
of the mask, torch.where with scalar branches, a bidirectional RNN whose backward pass flips time, a token
shift by roll, cumprod decay weights, and a packed batch unpacked to padded by repeat_interleave of the
lengths. Sizes are odd and tiny; every input comes from a seeded generator. Each model is a
`tests.user_models.Case`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case, classify
from tests.user_models_more import bf16, fp64, own_loss


# --- graphs: node features x (N, D), an edge list (2, E) of (source, destination) -------------------------

class GCN(nn.Module):
    """Kipf & Welling's GCN as written without PyG: self-loops appended to the edges, the degree by
    scatter_add_ of ones onto the destinations, norm = d^-1/2[src] * d^-1/2[dst], messages aggregated by
    index_add_ into zeros, a bias after the aggregation; two layers, per-node logits."""

    def __init__(self, d: int = 5, hidden: int = 7, classes: int = 3) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, classes, bias=False)
        self.bias1, self.bias2 = nn.Parameter(torch.zeros(hidden) + 0.1), nn.Parameter(torch.zeros(classes))

    @staticmethod
    def propagate(h: Tensor, src: Tensor, dst: Tensor, norm: Tensor) -> Tensor:
        out = torch.zeros_like(h)
        out.index_add_(0, dst, h[src] * norm[:, None])
        return out

    def forward(self, x: Tensor, edges: Tensor) -> Tensor:
        n = x.shape[0]
        loops = torch.arange(n, device=x.device)
        src, dst = torch.cat([edges[0], loops]), torch.cat([edges[1], loops])
        deg = torch.zeros(n, dtype=x.dtype, device=x.device)
        deg.scatter_add_(0, dst, torch.ones_like(dst, dtype=x.dtype))
        inv_sqrt = deg.pow(-0.5)
        norm = inv_sqrt[src] * inv_sqrt[dst]
        h = F.relu(self.propagate(self.lin1(x), src, dst, norm) + self.bias1)
        return self.propagate(self.lin2(h), src, dst, norm) + self.bias2


class GATLayer(nn.Module):
    """A multi-head GAT layer: e_ij = leaky_relu(a_src . h_j + a_dst . h_i), softmax over each node's incoming
    edges (max by scatter_reduce amax with include_self=False, exp, sum by index_add_, + 1e-16), messages
    h_j * alpha summed by index_add_; heads concatenated or averaged."""

    def __init__(self, d_in: int, d_out: int, heads: int, concat: bool, detach_max: bool) -> None:
        super().__init__()
        self.heads, self.d_out, self.concat, self.detach_max = heads, d_out, concat, detach_max
        self.lin = nn.Linear(d_in, heads * d_out, bias=False)
        self.att_src = nn.Parameter(torch.randn(1, heads, d_out) * 0.5)
        self.att_dst = nn.Parameter(torch.randn(1, heads, d_out) * 0.5)
        self.bias = nn.Parameter(torch.zeros(heads * d_out if concat else d_out))

    def forward(self, x: Tensor, src: Tensor, dst: Tensor) -> Tensor:
        n = x.shape[0]
        h = self.lin(x).view(n, self.heads, self.d_out)
        score = F.leaky_relu((h * self.att_src).sum(-1)[src] + (h * self.att_dst).sum(-1)[dst], 0.2)   # (E, H)
        index = dst[:, None].expand_as(score)
        peak = score.new_zeros(n, self.heads).scatter_reduce(0, index, score, "amax", include_self=False)
        if self.detach_max:
            peak = peak.detach()
        w = (score - peak[dst]).exp()
        total = score.new_zeros(n, self.heads).index_add_(0, dst, w)
        alpha = w / (total[dst] + 1e-16)
        messages = h[src] * alpha[..., None]
        out = messages.new_zeros(n, self.heads, self.d_out)
        out.index_add_(0, dst, messages)
        return (out.flatten(1) if self.concat else out.mean(1)) + self.bias


class GAT(nn.Module):
    """Two GAT layers with ELU between them; node 0 of the test graph has no incoming edge (and no self-loop
    is added), so its softmax is empty and it keeps only the bias."""

    def __init__(self, d: int = 5, hidden: int = 3, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.layer1 = GATLayer(d, hidden, heads, concat=True, detach_max=True)
        self.layer2 = GATLayer(hidden * heads, classes, heads, concat=False, detach_max=False)

    def forward(self, x: Tensor, edges: Tensor) -> Tensor:
        src, dst = edges
        return self.layer2(F.elu(self.layer1(x, src, dst)), src, dst)


class GIN(nn.Module):
    """GIN (Xu et al.): h' = MLP((1 + eps) h + sum of the neighbours) with a trained eps per layer; the graph
    readout of every layer (jumping knowledge) by mean (scatter_reduce "mean", include_self=False) and max
    (scatter_reduce "amax" onto -inf; a graph without nodes stays -inf and is set to 0 by torch.where)."""

    def __init__(self, d: int = 4, hidden: int = 6, graphs: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.graphs = graphs
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, hidden)),
                                   nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))])
        self.eps = nn.Parameter(torch.tensor([0.1, -0.2]))
        self.head = nn.Linear(4 * hidden, classes)

    def readout(self, h: Tensor, batch: Tensor) -> Tensor:
        index = batch[:, None].expand_as(h)
        mean = h.new_zeros(self.graphs, h.shape[1]).scatter_reduce(0, index, h, "mean", include_self=False)
        peak = h.new_full((self.graphs, h.shape[1]), float("-inf")).scatter_reduce(0, index, h, "amax")
        return torch.cat([mean, torch.where(peak == float("-inf"), 0.0, peak)], -1)

    def forward(self, x: Tensor, edges: Tensor, batch: Tensor) -> Tensor:
        src, dst = edges
        h, pooled = x, []
        for eps, mlp in zip(self.eps, self.mlps):
            neighbours = torch.zeros_like(h).index_add(0, dst, h[src])
            h = F.relu(mlp((1 + eps) * h + neighbours))
            pooled.append(self.readout(h, batch))
        return self.head(torch.cat(pooled, -1))


def knn(points: Tensor, k: int) -> Tensor:
    """(B, N, D) -> the indices (B, N, k) of each point's k nearest points (itself first) by cdist + topk."""
    return torch.cdist(points, points).topk(k, dim=-1, largest=False).indices


class EdgeConv(nn.Module):
    """DGCNN's EdgeConv: for each point the k nearest (gathered from the expanded features), edge features
    [x_i, x_j - x_i] through a shared MLP, max over the neighbours."""

    def __init__(self, d_in: int, d_out: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.mlp = nn.Sequential(nn.Linear(2 * d_in, d_out), nn.LeakyReLU(0.2))

    def forward(self, x: Tensor, neighbours: Tensor) -> Tensor:
        B, N, D = x.shape
        index = neighbours[..., None].expand(B, N, self.k, D)
        gathered = torch.gather(x[:, None].expand(B, N, N, D), 2, index)
        center = x[:, :, None].expand_as(gathered)
        return self.mlp(torch.cat([center, gathered - center], -1)).amax(2)


class DGCNN(nn.Module):
    """Two EdgeConvs, the first over neighbours in point space, the second over neighbours recomputed in its
    features (the dynamic graph); the two concatenated, max-pooled over points, a classifier."""

    def __init__(self, d: int = 3, hidden: int = 5, k: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.k = k
        self.conv1, self.conv2 = EdgeConv(d, hidden, k), EdgeConv(hidden, hidden, k)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, points: Tensor) -> Tensor:
        h1 = self.conv1(points, knn(points, self.k))
        h2 = self.conv2(h1, knn(h1, self.k))
        return self.head(torch.cat([h1, h2], -1).amax(1))


# --- speech ----------------------------------------------------------------------------------------------

def length_mask(lengths: Tensor, steps: int) -> Tensor:
    """(B,) lengths -> (B, steps) bool, True at the valid steps (what pack_padded_sequence would keep)."""
    return torch.arange(steps, device=lengths.device)[None, :] < lengths[:, None]


class FeedForward(nn.Sequential):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__(nn.LayerNorm(d), nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d))


class ConformerBlock(nn.Module):
    """A Conformer block: x + FFN/2, relative-position self-attention (a learned bias per head and clipped
    distance, padded keys masked to -inf), the conv module (LayerNorm, pointwise Conv1d to 2d, GLU over
    channels, padded frames zeroed, depthwise Conv1d, BatchNorm1d, SiLU, pointwise Conv1d), x + FFN/2,
    LayerNorm."""

    def __init__(self, d: int = 6, heads: int = 2, kernel: int = 3, max_distance: int = 3) -> None:
        super().__init__()
        self.heads, self.max_distance = heads, max_distance
        self.ff1, self.ff2 = FeedForward(d, 2 * d), FeedForward(d, 2 * d)
        self.att_norm = nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.rel_bias = nn.Parameter(torch.randn(2 * max_distance + 1, heads) * 0.3)
        self.conv_norm = nn.LayerNorm(d)
        self.pointwise1 = nn.Conv1d(d, 2 * d, 1)
        self.depthwise = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d, bias=False)
        self.batch_norm = nn.BatchNorm1d(d)
        self.pointwise2 = nn.Conv1d(d, d, 1)
        self.out_norm = nn.LayerNorm(d)

    def attention(self, x: Tensor, mask: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.att_norm(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(T, device=x.device)
        distance = (pos[None, :] - pos[:, None]).clamp(-self.max_distance, self.max_distance) + self.max_distance
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // self.heads) + self.rel_bias[distance].permute(2, 0, 1)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))

    def conv_module(self, x: Tensor, mask: Tensor) -> Tensor:
        h = F.glu(self.pointwise1(self.conv_norm(x).transpose(1, 2)), dim=1)
        h = h.masked_fill(~mask[:, None, :], 0.0)
        h = F.silu(self.batch_norm(self.depthwise(h)))
        return self.pointwise2(h).transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + 0.5 * self.ff1(x)
        x = x + self.attention(x, mask)
        x = x + self.conv_module(x, mask)
        x = x + 0.5 * self.ff2(x)
        return self.out_norm(x)


class ConformerClassifier(nn.Module):
    """Features (B, T, F) with lengths: an input Linear, two Conformer blocks, the mean over valid frames."""

    def __init__(self, feats: int = 5, d: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(feats, d)
        self.blocks = nn.ModuleList([ConformerBlock(d), ConformerBlock(d, kernel=5)])
        self.head = nn.Linear(d, classes)

    def forward(self, feats: Tensor, lengths: Tensor) -> Tensor:
        mask = length_mask(lengths, feats.shape[1])
        h = self.inp(feats)
        for block in self.blocks:
            h = block(h, mask)
        m = mask[..., None].to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def mel_filterbank(n_freqs: int, n_mels: int, sample_rate: float) -> Tensor:
    """(n_freqs, n_mels) triangular filters evenly spaced on the HTK mel scale, as torchaudio builds them."""
    def to_mel(f: Tensor) -> Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)
    freqs = torch.linspace(0, sample_rate / 2, n_freqs)
    mel_points = torch.linspace(0.0, to_mel(torch.tensor(sample_rate / 2)).item(), n_mels + 2)
    hz = 700.0 * (10 ** (mel_points / 2595.0) - 1.0)
    slopes = hz[None, :] - freqs[:, None]                                       # (n_freqs, n_mels + 2)
    widths = hz[1:] - hz[:-1]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return torch.clamp(torch.minimum(down, up), min=0.0)


class LogMelSpecAugment(nn.Module):
    """A waveform (B, S) to log-mel features by hand: reflect padding by n_fft // 2, frames by unfold, a Hann
    window, the real DFT as matmuls with cos / sin tables, |X|^2, the mel filterbank as a matmul, log(+1e-6);
    SpecAugment masks a band of frames and of mel bins per utterance (their starts are inputs), built from
    arange comparisons, combined by + (of bools: a logical or) and applied as a product with 1 - mask;
    per-utterance mean / std normalisation; a Conv1d over time and a classifier."""

    def __init__(self, n_fft: int = 8, hop: int = 3, n_mels: int = 4, time_width: int = 2, freq_width: int = 1,
                 classes: int = 3) -> None:
        super().__init__()
        self.n_fft, self.hop, self.time_width, self.freq_width = n_fft, hop, time_width, freq_width
        n_freqs = n_fft // 2 + 1
        angle = 2 * math.pi * torch.outer(torch.arange(n_fft).float(), torch.arange(n_freqs).float()) / n_fft
        self.register_buffer("cos", torch.cos(angle))
        self.register_buffer("sin", -torch.sin(angle))
        self.register_buffer("window", torch.hann_window(n_fft))
        self.register_buffer("fbank", mel_filterbank(n_freqs, n_mels, 16000.0))
        self.conv = nn.Conv1d(n_mels, 5, 3, padding=1)
        self.head = nn.Linear(5, classes)

    def forward(self, wave: Tensor, time_start: Tensor, freq_start: Tensor) -> Tensor:
        padded = F.pad(wave[:, None], (self.n_fft // 2, self.n_fft // 2), mode="reflect")[:, 0]
        frames = padded.unfold(-1, self.n_fft, self.hop) * self.window               # (B, T, n_fft)
        power = (frames @ self.cos) ** 2 + (frames @ self.sin) ** 2
        log_mel = torch.log(power @ self.fbank + 1e-6)                                # (B, T, n_mels)
        t = torch.arange(log_mel.shape[1], device=wave.device)[None, :]
        f = torch.arange(log_mel.shape[2], device=wave.device)[None, :]
        time_mask = (t >= time_start[:, None]) & (t < time_start[:, None] + self.time_width)
        freq_mask = (f >= freq_start[:, None]) & (f < freq_start[:, None] + self.freq_width)
        masked = time_mask[:, :, None] + freq_mask[:, None, :]                      # bools: either mask
        log_mel = log_mel * (1.0 - masked.to(log_mel.dtype))
        normed = (log_mel - log_mel.mean((1, 2), keepdim=True)) / (log_mel.std((1, 2), keepdim=True) + 1e-5)
        return self.head(F.relu(self.conv(normed.transpose(1, 2))).mean(-1))


class RNNT(nn.Module):
    """An RNN transducer: a Linear + tanh encoder over (B, T, F), a stateless predictor (the embeddings of the
    previous two labels, blank = 0 before the start, concatenated, Linear + tanh), the joint as a broadcast add
    (B, T, 1, H) + (B, 1, U + 1, H), tanh, Linear, log_softmax over a 4-D tensor; the loss -log P(y | x) by
    the forward variables alpha over the (t, u) lattice in Python loops with logaddexp."""

    def __init__(self, feats: int = 4, hidden: int = 5, vocab: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Linear(feats, hidden)
        self.embed = nn.Embedding(vocab + 1, 3)
        self.predictor = nn.Linear(6, hidden)
        self.joint = nn.Linear(hidden, vocab + 1)

    def forward(self, feats: Tensor, labels: Tensor) -> tuple:
        B, T, _ = feats.shape
        U = labels.shape[1]
        context = F.pad(labels, (2, 0))                                                # blanks before the start
        pred = torch.tanh(self.predictor(torch.cat([self.embed(context[:, 1:]), self.embed(context[:, :-1])], -1)))
        enc = torch.tanh(self.encoder(feats))
        log_probs = self.joint(torch.tanh(enc[:, :, None] + pred[:, None])).log_softmax(-1)   # (B, T, U + 1, V + 1)
        blank = log_probs[..., 0]
        emit = log_probs[:, :, :-1].gather(-1, labels[:, None, :, None].expand(B, T, U, 1)).squeeze(-1)
        alpha = [[None] * (U + 1) for _ in range(T)]
        alpha[0][0] = blank.new_zeros(B)
        for t in range(T):
            for u in range(U + 1):
                if t == 0 and u == 0:
                    continue
                from_blank = alpha[t - 1][u] + blank[:, t - 1, u] if t > 0 else None
                from_emit = alpha[t][u - 1] + emit[:, t, u - 1] if u > 0 else None
                alpha[t][u] = from_emit if from_blank is None else \
                    from_blank if from_emit is None else torch.logaddexp(from_blank, from_emit)
        return log_probs.exp(), -(alpha[T - 1][U] + blank[:, T - 1, U]).mean()


class XVector(nn.Module):
    """An x-vector TDNN: frame layers of dilated Conv1d (dilations 1, 2, 3; 'same' padding), ReLU, BatchNorm1d;
    statistics pooling over the valid frames only (a lengths mask): the mean and the std (clamped variance);
    a segment Linear and a classifier."""

    def __init__(self, feats: int = 4, channels: int = 5, embed: int = 4, classes: int = 3) -> None:
        super().__init__()
        layers = []
        for c_in, kernel, dilation in ((feats, 3, 1), (channels, 3, 2), (channels, 3, 3), (channels, 1, 1)):
            layers += [nn.Conv1d(c_in, channels, kernel, dilation=dilation, padding=dilation * (kernel // 2)),
                       nn.ReLU(), nn.BatchNorm1d(channels)]
        self.frames = nn.Sequential(*layers)
        self.segment = nn.Linear(2 * channels, embed)
        self.head = nn.Linear(embed, classes)

    def forward(self, feats: Tensor, lengths: Tensor) -> Tensor:                      # feats (B, F, T)
        h = self.frames(feats)
        mask = length_mask(lengths, h.shape[-1])[:, None, :].to(h.dtype)
        count = mask.sum(-1)
        mean = (h * mask).sum(-1) / count
        var = (((h - mean[..., None]) ** 2) * mask).sum(-1) / count
        stats = torch.cat([mean, var.clamp(min=1e-5).sqrt()], -1)
        return self.head(F.relu(self.segment(stats)))


# --- structured prediction ---------------------------------------------------------------------------------

class CRFTagger(nn.Module):
    """A linear-chain CRF tagger's training loss: emissions from embeddings, the gold path's score (start,
    emissions by gather, transitions indexed by consecutive tags, masked past each length, end of the last
    valid tag), the log partition by the forward algorithm (logsumexp over the previous tag in a Python loop,
    padded steps keeping alpha by torch.where); NLL = log Z - score, averaged."""

    def __init__(self, vocab: int = 9, d: int = 5, tags: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.emit = nn.Linear(d, tags)
        self.transitions = nn.Parameter(torch.randn(tags, tags) * 0.5)
        self.start, self.end = nn.Parameter(torch.randn(tags) * 0.5), nn.Parameter(torch.randn(tags) * 0.5)

    def forward(self, tokens: Tensor, tags: Tensor, lengths: Tensor) -> tuple:
        T = tokens.shape[1]
        mask = length_mask(lengths, T)
        emissions = self.emit(torch.tanh(self.embed(tokens)))                         # (B, T, tags)
        gold = emissions.gather(-1, tags[..., None]).squeeze(-1)                       # (B, T)
        score = self.start[tags[:, 0]] + gold[:, 0]
        for t in range(1, T):
            step = self.transitions[tags[:, t - 1], tags[:, t]] + gold[:, t]
            score = score + step * mask[:, t]
        score = score + self.end[tags.gather(1, (lengths - 1)[:, None]).squeeze(1)]
        alpha = self.start + emissions[:, 0]
        for t in range(1, T):
            nxt = torch.logsumexp(alpha[:, :, None] + self.transitions + emissions[:, t, None, :], dim=1)
            alpha = torch.where(mask[:, t, None], nxt, alpha)
        log_partition = torch.logsumexp(alpha + self.end, dim=1)
        return emissions, (log_partition - score).mean()


class PointerNet(nn.Module):
    """A pointer network trained with teacher forcing on a permutation of its inputs: an encoder MLP, a GRUCell
    decoder fed the encoding of the previously chosen input (gathered; a learned start vector first),
    additive attention scores v . tanh(W1 e + W2 d), inputs already chosen masked_fill'ed to -inf,
    log_softmax, the NLL of the target index; returns the probabilities and the loss."""

    def __init__(self, d: int = 2, hidden: int = 5) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, hidden), nn.Tanh())
        self.start = nn.Parameter(torch.randn(hidden) * 0.5)
        self.cell = nn.GRUCell(hidden, hidden)
        self.w_enc, self.w_dec = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, 1, bias=False)

    def forward(self, points: Tensor, order: Tensor) -> tuple:
        B, N, _ = points.shape
        enc = self.encoder(points)
        keys = self.w_enc(enc)
        state = enc.mean(1)
        step_input = self.start.expand(B, -1)
        chosen = torch.zeros(B, N, dtype=torch.bool, device=points.device)
        probs, nll = [], 0
        for t in range(N):
            state = self.cell(step_input, state)
            scores = self.v(torch.tanh(keys + self.w_dec(state)[:, None])).squeeze(-1)
            log_p = F.log_softmax(scores.masked_fill(chosen, float("-inf")), dim=-1)
            target = order[:, t:t + 1]
            nll = nll - log_p.gather(1, target).mean()
            probs.append(log_p.exp())
            chosen = chosen | (torch.arange(N, device=points.device)[None, :] == target)
            step_input = enc.gather(1, target[..., None].expand(-1, -1, enc.shape[-1])).squeeze(1)
        return torch.stack(probs, 1), nll / N


class BiaffineParser(nn.Module):
    """Dozat & Manning's biaffine scorer: word + tag embeddings, a Linear encoder, MLPs for arc-dependent,
    arc-head, label-dependent and label-head; arc scores einsum('bxi,oij,byj->boxy') with a ones column on the
    dependent (a head bias), label scores with ones on both; padded heads masked to -inf; the loss is the
    NLL of each valid dependent's gold head (root excluded) plus the NLL of its gold label at the gold head."""

    def __init__(self, vocab: int = 9, d: int = 6, arc: int = 4, rel: int = 3, labels: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.Linear(d, d)
        self.arc_dep, self.arc_head = nn.Linear(d, arc), nn.Linear(d, arc)
        self.rel_dep, self.rel_head = nn.Linear(d, rel), nn.Linear(d, rel)
        self.arc_weight = nn.Parameter(torch.randn(1, arc + 1, arc) * 0.3)
        self.rel_weight = nn.Parameter(torch.randn(labels, rel + 1, rel + 1) * 0.3)

    def forward(self, words: Tensor, heads: Tensor, rels: Tensor, lengths: Tensor) -> tuple:
        B, T = words.shape
        mask = length_mask(lengths, T)
        h = F.relu(self.encoder(self.embed(words)))
        ones = h.new_ones(B, T, 1)
        arc_dep = torch.cat([F.elu(self.arc_dep(h)), ones], -1)
        arc_head = F.elu(self.arc_head(h))
        rel_dep = torch.cat([F.elu(self.rel_dep(h)), ones], -1)
        rel_head = torch.cat([F.elu(self.rel_head(h)), ones], -1)
        arc_scores = torch.einsum("bxi,oij,byj->boxy", arc_dep, self.arc_weight, arc_head).squeeze(1)   # (B, T, T)
        rel_scores = torch.einsum("bxi,oij,byj->boxy", rel_dep, self.rel_weight, rel_head)             # (B, L, T, T)
        arc_scores = arc_scores.masked_fill(~mask[:, None, :], float("-inf"))
        arc_log_p = arc_scores.log_softmax(-1)
        dependents = mask.clone()
        dependents[:, 0] = False                                                       # the root has no head
        weight = dependents.to(h.dtype)
        arc_nll = -(arc_log_p.gather(-1, heads[..., None]).squeeze(-1) * weight).sum() / weight.sum()
        at_gold_head = rel_scores.permute(0, 2, 3, 1).gather(2, heads[:, :, None, None].expand(-1, -1, 1, rel_scores.shape[1]))
        rel_log_p = at_gold_head.squeeze(2).log_softmax(-1)                            # (B, T, labels)
        rel_nll = -(rel_log_p.gather(-1, rels[..., None]).squeeze(-1) * weight).sum() / weight.sum()
        return arc_log_p.exp(), arc_nll + rel_nll


# --- sequence-level details --------------------------------------------------------------------------------

class MaskedBiRNN(nn.Module):
    """A right-padded batch with lengths: the mask by arange < lengths, positions by cumsum of the mask (0 on
    the padding by torch.where with a scalar), a token shift by roll (the wrapped first step zeroed), a
    hand-written tanh RNN run forward and, on the time-flipped batch with the flipped mask, backward (padded
    steps keep the state by torch.where, so the flipped padding in front is skipped), flipped back; pooling
    weighted by a cumprod of sigmoid gates, masked."""

    def __init__(self, d: int = 4, hidden: int = 5, max_len: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.hidden = hidden
        self.pos = nn.Embedding(max_len, d)
        self.shift_mix = nn.Parameter(torch.full((d,), 0.3))
        self.inp = nn.Linear(d, 2 * hidden)
        self.rec_fwd, self.rec_bwd = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(2 * hidden, 1)
        self.head = nn.Linear(2 * hidden, classes)

    def run(self, x: Tensor, mask: Tensor, recurrent: nn.Linear) -> Tensor:
        state = x.new_zeros(x.shape[0], self.hidden)
        outputs = []
        for t in range(x.shape[1]):
            new = torch.tanh(x[:, t] + recurrent(state))
            state = torch.where(mask[:, t, None], new, state)
            outputs.append(torch.where(mask[:, t, None], new, 0.0))
        return torch.stack(outputs, 1)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        B, T, _ = x.shape
        mask = length_mask(lengths, T)
        positions = torch.where(mask, mask.long().cumsum(1) - 1, 0)
        x = x + self.pos(positions)
        shifted = torch.roll(x, 1, dims=1).masked_fill((torch.arange(T, device=x.device) == 0)[None, :, None], 0.0)
        x = x + self.shift_mix * (shifted - x)
        fwd_in, bwd_in = self.inp(x).chunk(2, -1)
        fwd = self.run(fwd_in, mask, self.rec_fwd)
        bwd = self.run(bwd_in.flip(1), mask.flip(1), self.rec_bwd).flip(1)
        h = torch.cat([fwd, bwd], -1)
        decay = torch.cumprod(torch.sigmoid(self.gate(h)).squeeze(-1), dim=1) * mask
        return self.head((h * decay[..., None]).sum(1) / (decay.sum(1, keepdim=True) + 1e-6))


class PackedAttention(nn.Module):
    """A packed batch (all tokens of all sequences concatenated, (N, D)) with lengths: the sequence of every
    token by repeat_interleave of the lengths, its offset by an exclusive cumsum, its position as the
    difference; scattered to a padded (B, T, D) batch by index_put, single-head attention with a key padding
    mask, gathered back to the packed tokens; per-token logits."""

    def __init__(self, d: int = 5, max_len: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.max_len = max_len
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, classes)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        B, N = lengths.shape[0], tokens.shape[0]
        sequence = torch.repeat_interleave(torch.arange(B, device=tokens.device), lengths, output_size=N)
        offsets = torch.cumsum(lengths, 0) - lengths
        position = torch.arange(N, device=tokens.device) - offsets[sequence]
        padded = tokens.new_zeros(B, self.max_len, tokens.shape[1])
        padded = padded.index_put((sequence, position), tokens)
        q, k, v = self.qkv(padded).chunk(3, -1)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~length_mask(lengths, self.max_len)[:, None, :], float("-inf"))
        attended = scores.softmax(-1) @ v
        return self.out(attended[sequence, position] + tokens)


# --- the cases ---------------------------------------------------------------------------------------------

def _edges() -> Tensor:
    """A directed graph on 7 nodes: node 0 has no incoming edge, node 3 a single one, duplicates absent."""
    src = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 2, 5, 6, 1])
    dst = torch.tensor([1, 2, 1, 4, 5, 4, 5, 6, 3, 6, 2, 5])
    return torch.stack([src, dst])


def _node_classes(d: int):
    def batch(g: torch.Generator) -> tuple:
        return (torch.randn(7, d, generator=g), _edges()), torch.randint(0, 3, (7,), generator=g)
    return batch


def _graph_batch(g: torch.Generator) -> tuple:
    batch = torch.tensor([0, 0, 2, 2, 2, 0, 2])                                    # graph 1 has no nodes
    return (torch.randn(7, 4, generator=g), _edges(), batch), torch.randint(0, 3, (3,), generator=g)


def _points(g: torch.Generator) -> tuple:
    return (torch.randn(2, 7, 3, generator=g),), torch.randint(0, 3, (2,), generator=g)


def _padded_features(g: torch.Generator) -> tuple:
    return (torch.randn(3, 7, 5, generator=g), torch.tensor([7, 4, 5])), torch.randint(0, 3, (3,), generator=g)


def _waves(g: torch.Generator) -> tuple:
    wave = torch.randn(2, 23, generator=g)                                         # 8 frames of 8, hop 3
    return (wave, torch.tensor([1, 5]), torch.tensor([2, 0])), torch.randint(0, 3, (2,), generator=g)


def _transducer(g: torch.Generator) -> tuple:
    return (torch.randn(2, 3, 4, generator=g), torch.randint(1, 5, (2, 3), generator=g)), None


def _tdnn(g: torch.Generator) -> tuple:
    return (torch.randn(3, 4, 9, generator=g), torch.tensor([9, 6, 7])), torch.randint(0, 3, (3,), generator=g)


def _tagged(g: torch.Generator) -> tuple:
    lengths = torch.tensor([6, 3, 5])
    return (torch.randint(0, 9, (3, 6), generator=g), torch.randint(0, 4, (3, 6), generator=g), lengths), None


def _permutations(g: torch.Generator) -> tuple:
    order = torch.stack([torch.randperm(4, generator=g) for _ in range(2)])
    return (torch.rand(2, 4, 2, generator=g), order), None


def _trees(g: torch.Generator) -> tuple:
    lengths = torch.tensor([6, 4, 5])
    heads = torch.stack([torch.randint(0, int(n), (6,), generator=g) for n in lengths])  # heads within length
    rels = torch.randint(0, 3, (3, 6), generator=g)
    return (torch.randint(0, 9, (3, 6), generator=g), heads, rels, lengths), None


def _right_padded(g: torch.Generator) -> tuple:
    return (torch.randn(3, 5, 4, generator=g), torch.tensor([5, 2, 4])), torch.randint(0, 3, (3,), generator=g)


def _packed(g: torch.Generator) -> tuple:
    lengths = torch.tensor([3, 5, 1])
    return (torch.randn(9, 5, generator=g), lengths), torch.randint(0, 3, (9,), generator=g)


def cases() -> list[Case]:
    gcn = Case("gcn_symmetric_norm", GCN, _node_classes(5), classify)
    gat = Case("gat_edge_softmax", GAT, _node_classes(5), classify)
    log_mel = Case("log_mel_specaugment", LogMelSpecAugment, _waves, classify)
    xvector = Case("xvector_tdnn_stats", XVector, _tdnn, classify)
    crf = Case("linear_chain_crf", CRFTagger, _tagged, own_loss)
    biaffine = Case("biaffine_parser", BiaffineParser, _trees, own_loss)
    birnn = Case("masked_birnn_flip", MaskedBiRNN, _right_padded, classify)
    return [gcn, gat,
            Case("gin_readout", GIN, _graph_batch, classify),
            Case("dgcnn_edgeconv", DGCNN, _points, classify),
            Case("conformer_rel_bias", ConformerClassifier, _padded_features, classify),
            log_mel,
            Case("rnnt_joint_lattice", RNNT, _transducer, own_loss),
            xvector,
            crf,
            Case("pointer_net", PointerNet, _permutations, own_loss),
            biaffine, birnn,
            Case("packed_attention", PackedAttention, _packed, classify),
            bf16(xvector), bf16(biaffine), bf16(gat),
            *(fp64(c) for c in (crf, log_mel, gcn, birnn))]
