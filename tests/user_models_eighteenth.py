"""An eighteenth set of models written the way users write them, for tests/test_optimizer_user_models_eighteenth.py.

The earlier sets cover a linear-chain CRF's forward algorithm, an RNN-T lattice by logaddexp and F.ctc_loss
(tests/user_models_tenth.py), DINOv2's Sinkhorn-Knopp by in-place normalisation (tests/user_models_thirteenth.py),
RealNVP and Glow couplings (tests/user_models_sixth.py), Mamba, RWKV and RetNet recurrences
(tests/user_models_eighth.py), sparsemax by sort (tests/user_models_ninth.py), a no_grad teacher
(tests/user_models_more.py). These are numerically delicate layers and dynamic programs unrolled in Python, as their
reference implementations write them:
- Kolmogorov-Arnold networks: efficient-kan's KANLinear (B-spline bases by the Cox-de Boor recursion over a grid
  buffer from (x >= grid[:, :-1]) & (x < grid[:, 1:]), a SiLU base branch, spline weights times a standalone
  scaler, the L1 and entropy regulariser) and its update_grid in the step (sort, quantile knots by an int64
  linspace, the grid buffer copy_'d, the spline weights refit by torch.linalg.lstsq through .data); pykan's
  recursive B_batch (a product of two boolean comparisons, nan_to_num, einsum with the coefficients, a frozen
  grid and mask held as Parameters); FastKAN's Gaussian radial bases after a LayerNorm.
- xLSTM: sLSTM (exponential input and forget gates, the stabilizer m_t = max(i, log f + m), a normalizer state,
  block-diagonal recurrent weights by einsum) and mLSTM (the recurrent step with a matrix memory and q, k, v
  squeezed in place, and the parallel stabilized form: cumsum'ed log-sigmoid forget gates, a decay matrix masked
  by torch.where(tril, .., -inf), the row max subtracted, the normalizer max(|sum|, exp(-max))).
- aMLP: g-mlp-pytorch's causal spatial gating unit (a masked (seq, seq) weight by einsum, bias initialised to
  ones) with tiny attention.
- nflows' rational-quadratic spline (softmax widths and heights with minimum bins, cumsum, F.pad, ends written in
  place, softplus derivatives, nflows' searchsorted as a sum of >= after += eps on the last location, gathers,
  forward and inverse by the quadratic's root, the log-determinant, linear tails) in a coupling layer.
- Dynamic programs: soft-DTW cell by cell into an inf-filled R in place (max-shifted three-way softmin), by
  anti-diagonals (R[:, i, j] = ... with index tensors, logsumexp of stacked neighbours), and through a
  torch.autograd.Function with pytorch-softdtw-cuda's hand-written E recursion as its backward; an HMM's forward
  algorithm (variable lengths by torch.where); CTC's alpha recursion by hand (blanks interleaved by slicing
  assignment, the skip mask, shifts by F.pad, finfo.min for unreachable states, the end read by gather); pytorch-
  crf's Viterbi (max with indices, the path traced back by gathers) in a structured perceptron; Glow-TTS's
  monotonic alignment search under no_grad (a value matrix accumulated in place, the path traced back by
  index_put with a per-sequence index) and its MLE loss; SuperGlue's log-domain Sinkhorn with a learned dustbin.
- NeuralSort's relaxed permutation (|s_i - s_j| row sums, the (n + 1 - 2i) scaling, softmax at a temperature,
  hard by index_put of ones at the argmaxes with a straight-through estimator) and knowledge distillation (the
  teacher under no_grad, the tutorial's and Hinton's KL at a temperature scaled by T^2).

Left out, as PyTorch's or eager's own limits: nflows writes its tails by boolean-mask indexing (outputs[inside] =
...) behind torch.any(inside); Dynamo runs that eagerly between graphs, so the tails here are torch.where over all
elements (the masked form, checked by hand, matches eager too). xLSTM's sLSTM branches on torch.all(n == 0) at each
step; with that graph break inside the loop Dynamo compiled no graph of the forward at all, so the first step is the Python loop's
first iteration. Hand-written CTC with -inf for unreachable states has NaN gradients in eager (a logsumexp of only
-infs), hence finfo.min as vadimkantorov's ctc.py uses. In float16 or bfloat16, nflows' += 1e-6 on the last bin
location is lost, an input at the tail bound falls in a bin past the last and eager's gather fails, so the spline
runs in fp32 and fp64 only. Exact ties are not compared: with every token the same, Glow-TTS's alignment and
NeuralSort's hard permutation break their ties by eager's rounding, whose GEMM gives identical rows values a bit
apart (12 of 28 log-likelihoods off their row's first), where tfsn's kernels give them equal. Sizes are odd and tiny; every input comes from a seeded generator. Each model is a
`tests.user_models.Case`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tests.user_models import Case
from tests.user_models_more import bf16, fp64, own_loss


# --- Kolmogorov-Arnold networks -----------------------------------------------------------------------------

class KANLinear(nn.Module):
    """efficient-kan's KANLinear: y = W_base silu(x) + (W_spline * scaler) . B(x), B the order-k B-spline bases on
    a uniform grid extended by k knots each side, held as a buffer of shape (in, grid + 2k + 1)."""

    def __init__(self, d_in: int, d_out: int, grid_size: int = 5, spline_order: int = 3,
                 grid_range: tuple = (-1.0, 1.0), grid_eps: float = 0.02) -> None:
        super().__init__()
        self.d_in, self.d_out, self.spline_order = d_in, d_out, spline_order
        self.grid_size, self.grid_eps = grid_size, grid_eps
        h = (grid_range[1] - grid_range[0]) / grid_size
        grid = (torch.arange(-spline_order, grid_size + spline_order + 1) * h + grid_range[0])
        self.register_buffer("grid", grid.expand(d_in, -1).contiguous())
        self.base_weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.spline_weight = nn.Parameter(torch.randn(d_out, d_in, grid_size + spline_order) * 0.1)
        self.spline_scaler = nn.Parameter(torch.ones(d_out, d_in) + 0.1 * torch.randn(d_out, d_in))

    def b_splines(self, x: Tensor) -> Tensor:
        grid = self.grid
        x = x.unsqueeze(-1)
        bases = ((x >= grid[:, :-1]) & (x < grid[:, 1:])).to(x.dtype)
        for k in range(1, self.spline_order + 1):
            bases = ((x - grid[:, :-(k + 1)]) / (grid[:, k:-1] - grid[:, :-(k + 1)]) * bases[:, :, :-1]) + (
                (grid[:, k + 1:] - x) / (grid[:, k + 1:] - grid[:, 1:(-k)]) * bases[:, :, 1:])
        return bases.contiguous()

    @property
    def scaled_spline_weight(self) -> Tensor:
        return self.spline_weight * self.spline_scaler.unsqueeze(-1)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, self.d_in)
        base = F.linear(F.silu(x), self.base_weight)
        spline = F.linear(self.b_splines(x).view(x.size(0), -1), self.scaled_spline_weight.view(self.d_out, -1))
        return (base + spline).reshape(*shape[:-1], self.d_out)

    def curve2coeff(self, x: Tensor, y: Tensor) -> Tensor:
        """The spline weights whose curves best fit y at x: a batched least squares per input feature."""
        solution = torch.linalg.lstsq(self.b_splines(x).transpose(0, 1), y.transpose(0, 1)).solution
        return solution.permute(2, 0, 1).contiguous()

    @torch.no_grad()
    def update_grid(self, x: Tensor, margin: float = 0.01) -> None:
        """efficient-kan's grid update: knots at the sorted batch's quantiles (indices by an int64 linspace) mixed
        with a uniform grid, extended, copied into the buffer; the spline weights refit by least squares to the
        curves the old grid gave, written through .data."""
        batch = x.size(0)
        splines = self.b_splines(x).permute(1, 0, 2)
        unreduced = torch.bmm(splines, self.scaled_spline_weight.permute(1, 2, 0)).permute(1, 0, 2)
        x_sorted = torch.sort(x, dim=0)[0]
        grid_adaptive = x_sorted[torch.linspace(0, batch - 1, self.grid_size + 1, dtype=torch.int64, device=x.device)]
        uniform_step = (x_sorted[-1] - x_sorted[0] + 2 * margin) / self.grid_size
        grid_uniform = (torch.arange(self.grid_size + 1, dtype=x.dtype, device=x.device).unsqueeze(1) * uniform_step
                        + x_sorted[0] - margin)
        grid = self.grid_eps * grid_uniform + (1 - self.grid_eps) * grid_adaptive
        steps = torch.arange(1, self.spline_order + 1, device=x.device).unsqueeze(1)
        grid = torch.concatenate([grid[:1] - uniform_step * steps.flip(0), grid, grid[-1:] + uniform_step * steps], dim=0)
        self.grid.copy_(grid.T)
        self.spline_weight.data.copy_(self.curve2coeff(x, unreduced))

    def regularization_loss(self, activation: float = 1.0, entropy: float = 1.0) -> Tensor:
        l1 = self.spline_weight.abs().mean(-1)
        total = l1.sum()
        p = l1 / total
        return activation * total + entropy * -torch.sum(p * p.log())


class EfficientKAN(nn.Module):
    """Two KANLinear layers regressing a smooth function, inputs inside and outside the grid range (the bases
    vanish outside the extended grid), the regulariser added to the loss as efficient-kan's examples do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([KANLinear(3, 5), KANLinear(5, 2, grid_size=4, spline_order=2)])

    def forward(self, x: Tensor, y: Tensor) -> tuple:
        out = x
        for layer in self.layers:
            out = layer(out)
        reg = sum(layer.regularization_loss() for layer in self.layers)
        return out, F.mse_loss(out, y) + 1e-3 * reg


def b_batch(x: Tensor, grid: Tensor, k: int = 0) -> Tensor:
    """pykan's B_batch: the order-k bases of x (batch, in) on grid (in, knots) by recursion on k, the order-0
    bases a product of two boolean comparisons, NaNs of zero-width intervals put to 0 by nan_to_num."""
    x = x.unsqueeze(dim=2)
    grid = grid.unsqueeze(dim=0)
    if k == 0:
        value = (x >= grid[:, :, :-1]) * (x < grid[:, :, 1:])
    else:
        b_km1 = b_batch(x[:, :, 0], grid=grid[0], k=k - 1)
        value = (x - grid[:, :, :-(k + 1)]) / (grid[:, :, k:-1] - grid[:, :, :-(k + 1)]) * b_km1[:, :, :-1] + (
            grid[:, :, k + 1:] - x) / (grid[:, :, k + 1:] - grid[:, :, 1:(-k)]) * b_km1[:, :, 1:]
    return torch.nan_to_num(value)


class PyKANLayer(nn.Module):
    """pykan's KANLayer forward: the grid extended by k knots each side (a frozen Parameter), the curve
    einsum('ijk,jlk->ijl', B, coef), scale_base * silu(x) + scale_sp * spline per edge, a mask Parameter, summed
    over the inputs; the post-activations kept by clone().permute as pykan does for its plots."""

    def __init__(self, d_in: int, d_out: int, num: int = 4, k: int = 3) -> None:
        super().__init__()
        h = 2.0 / num
        grid = torch.linspace(-1, 1, num + 1)[None].expand(d_in, num + 1)
        grid = torch.cat([grid[:, :1] - h * torch.arange(k, 0, -1), grid, grid[:, -1:] + h * torch.arange(1, k + 1)], 1)
        self.grid = nn.Parameter(grid.contiguous(), requires_grad=False)
        self.coef = nn.Parameter(torch.randn(d_in, d_out, num + k) * 0.1)
        self.scale_base = nn.Parameter(1 / math.sqrt(d_in) + 0.1 * torch.randn(d_in, d_out))
        self.scale_sp = nn.Parameter(torch.ones(d_in, d_out) / math.sqrt(d_in))
        self.mask = nn.Parameter(torch.ones(d_in, d_out), requires_grad=False)
        self.k = k

    def forward(self, x: Tensor) -> tuple:
        base = F.silu(x)
        y = torch.einsum("ijk,jlk->ijl", b_batch(x, grid=self.grid, k=self.k), self.coef)
        y = self.scale_base[None, :, :] * base[:, :, None] + self.scale_sp[None, :, :] * y
        y = self.mask[None, :, :] * y
        postacts = y.clone().permute(0, 2, 1)
        return torch.sum(y, dim=1), postacts


class PyKAN(nn.Module):
    """Two pykan layers; the loss adds pykan's L1 of the mean absolute post-activations and their entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([PyKANLayer(3, 4), PyKANLayer(4, 2, num=3, k=2)])

    def forward(self, x: Tensor, y: Tensor) -> tuple:
        reg = x.new_zeros(())
        for layer in self.layers:
            x, postacts = layer(x)
            l1 = postacts.abs().mean(0)
            p = l1 / l1.sum()
            reg = reg + l1.sum() - (p * torch.log2(p + 1e-4)).sum()
        return x, F.mse_loss(x, y) + 1e-3 * reg


class EfficientKANGridUpdate(EfficientKAN):
    """efficient-kan's KAN.forward(x, update_grid=True): each layer refits its grid to its input before applying
    it (the step writes the grid buffers and the spline weights)."""

    def forward(self, x: Tensor, y: Tensor) -> tuple:
        out = x
        for layer in self.layers:
            layer.update_grid(out)
            out = layer(out)
        return out, F.mse_loss(out, y)


class FastKAN(nn.Module):
    """FastKAN (Li's reference): a LayerNorm, Gaussian radial bases exp(-((x - grid) / h)^2) on a linspace grid
    held as a Parameter with requires_grad=False, a spline Linear over the flattened bases plus a SiLU base Linear."""

    def __init__(self, dims: tuple = (4, 7, 3), num_grids: int = 6) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for d in dims[:-1])
        grid = torch.linspace(-2.0, 2.0, num_grids)
        self.grid = nn.Parameter(grid, requires_grad=False)
        self.denominator = 4.0 / (num_grids - 1)
        self.splines = nn.ModuleList(nn.Linear(a * num_grids, b, bias=False) for a, b in zip(dims, dims[1:]))
        self.bases = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: Tensor, target: Tensor) -> tuple:
        for norm, spline, base in zip(self.norms, self.splines, self.bases):
            rbf = torch.exp(-((norm(x)[..., None] - self.grid) / self.denominator) ** 2)
            x = spline(rbf.view(*rbf.shape[:-2], -1)) + base(F.silu(x))
        return x, F.cross_entropy(x, target)


# --- xLSTM --------------------------------------------------------------------------------------------------

class SLSTM(nn.Module):
    """xLSTM's sLSTM as its vanilla pointwise code writes it: raw = Wx + Ry + b split into i, f, z, o; log f +
    m by logsigmoid; m_new = max(i, log f + m); the gates exp(i - m_new), exp(log f + m - m_new); c, n updated, y =
    o c / n. Recurrent weights block-diagonal per head (einsum), unrolled over the time steps in Python."""

    def __init__(self, d_in: int = 5, hidden: int = 6, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.hidden, self.heads = hidden, heads
        self.w = nn.Linear(d_in, 4 * hidden)
        self.r = nn.Parameter(torch.randn(heads, hidden // heads, 4 * hidden // heads) * 0.3)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor, target: Tensor) -> tuple:
        batch, steps, _ = x.shape
        wx = self.w(x)
        y = c = n = m = x.new_zeros(batch, self.hidden)
        for t in range(steps):
            ry = torch.einsum("bhd,hdg->bhg", y.view(batch, self.heads, -1), self.r).reshape(batch, 4, -1)
            raw = wx[:, t].view(batch, 4, -1) + ry
            i_raw, f_raw, z_raw, o_raw = torch.unbind(raw, dim=1)
            log_f_plus_m = m + F.logsigmoid(f_raw)
            m_new = i_raw if t == 0 else torch.max(i_raw, log_f_plus_m)
            i_gate, f_gate = torch.exp(i_raw - m_new), torch.exp(log_f_plus_m - m_new)
            c = f_gate * c + i_gate * torch.tanh(z_raw)
            n = f_gate * n + i_gate
            y = torch.sigmoid(o_raw) * c / n
            m = m_new
        logits = self.head(y)
        return logits, F.cross_entropy(logits, target)


class MLSTM(nn.Module):
    """xLSTM's mLSTM cell twice: the recurrent step (matrix memory C += i k v^T, normalizer n, stabilizer m,
    h = q^T C / max(|q^T n|, exp(-m)) + eps, q, k, v squeezed in place) unrolled over time, and the parallel
    stabilized form (parallel_stabilized_simple); the loss on both and on their difference."""

    def __init__(self, d: int = 7, heads: int = 2, dh: int = 3) -> None:
        super().__init__()
        self.heads, self.dh = heads, dh
        self.qkv = nn.Linear(d, 3 * heads * dh)
        self.gates = nn.Linear(d, 2 * heads)
        self.out = nn.Linear(heads * dh, d)

    @staticmethod
    def parallel(q: Tensor, k: Tensor, v: Tensor, i_pre: Tensor, f_pre: Tensor, eps: float = 1e-6) -> Tensor:
        b, nh, s, dh = q.shape
        log_f = F.logsigmoid(f_pre)
        ltr = torch.tril(torch.ones((s, s), dtype=torch.bool, device=q.device))
        log_f_cumsum = torch.cat([torch.zeros((b, nh, 1, 1), dtype=q.dtype, device=q.device),
                                  torch.cumsum(log_f, dim=-2)], dim=-2)
        rep = log_f_cumsum.repeat(1, 1, 1, s + 1)
        log_fg = torch.where(ltr, (rep - rep.transpose(-2, -1))[:, :, 1:, 1:], -float("inf"))
        log_d = log_fg + i_pre.transpose(-2, -1)
        max_log_d, _ = torch.max(log_d, dim=-1, keepdim=True)
        d_matrix = torch.exp(log_d - max_log_d)
        c_matrix = (q @ (k / math.sqrt(dh)).transpose(-2, -1)) * d_matrix
        normalizer = torch.maximum(c_matrix.sum(dim=-1, keepdim=True).abs(), torch.exp(-max_log_d))
        return (c_matrix / (normalizer + eps)) @ v

    @staticmethod
    def step(c: Tensor, n: Tensor, m: Tensor, q: Tensor, k: Tensor, v: Tensor, i_pre: Tensor, f_pre: Tensor,
             eps: float = 1e-6) -> tuple:
        dh = q.shape[-1]
        q, k, v = q.squeeze_(2).unsqueeze(-1), k.squeeze_(2).unsqueeze(-1), v.squeeze_(2).unsqueeze(-1)
        log_f = F.logsigmoid(f_pre)
        m_new = torch.max(log_f + m, i_pre)
        f_act, i_act = torch.exp(log_f + m - m_new), torch.exp(i_pre - m_new)
        k_scaled = k / math.sqrt(dh)
        c_new = f_act * c + i_act * (k_scaled @ v.transpose(-1, -2))
        n_new = f_act * n + i_act * k_scaled
        h_num = q.transpose(-1, -2) @ c_new
        h_denom = torch.maximum((q.transpose(-1, -2) @ n_new).abs(), torch.exp(-m_new)) + eps
        return h_num / h_denom, (c_new, n_new, m_new)

    def forward(self, x: Tensor, y: Tensor) -> tuple:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4).unbind(0)
        i_pre, f_pre = self.gates(x).view(b, s, 2, self.heads).permute(2, 0, 3, 1).unsqueeze(-1).unbind(0)
        h_parallel = self.parallel(q, k, v, i_pre, f_pre)
        c = x.new_zeros(b, self.heads, self.dh, self.dh)
        n = x.new_zeros(b, self.heads, self.dh, 1)
        m = x.new_zeros(b, self.heads, 1, 1)
        steps = []
        for t in range(s):
            h, (c, n, m) = self.step(c, n, m, q[:, :, t:t + 1].clone(), k[:, :, t:t + 1].clone(),
                                     v[:, :, t:t + 1].clone(), i_pre[:, :, t:t + 1], f_pre[:, :, t:t + 1])
            steps.append(h)
        h_recurrent = torch.cat(steps, dim=-2)
        out = self.out(h_parallel.transpose(1, 2).reshape(b, s, -1))
        loss = F.mse_loss(out, y) + F.mse_loss(self.out(h_recurrent.transpose(1, 2).reshape(b, s, -1)), y)
        return out, loss + (h_parallel - h_recurrent).pow(2).sum()


# --- gMLP / aMLP --------------------------------------------------------------------------------------------

class SpatialGatingUnit(nn.Module):
    """g-mlp-pytorch's causal SGU: split the channels, LayerNorm the gate half, mix it over positions by a
    (seq, seq) weight (initialised uniform in +-eps / seq, causal by masked_fill of its upper triangle) through
    einsum with a bias initialised to ones, add the tiny attention's output, gate the other half."""

    def __init__(self, d_ffn: int, seq: int, eps: float = 1e-3) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_ffn // 2)
        self.weight = nn.Parameter(torch.empty(seq, seq).uniform_(-eps / seq, eps / seq))
        self.bias = nn.Parameter(torch.ones(seq, 1))

    def forward(self, x: Tensor, gate_res: Tensor | None = None) -> Tensor:
        n = x.shape[1]
        res, gate = x.chunk(2, dim=-1)
        gate = self.norm(gate)
        mask = torch.ones(n, n, device=x.device, dtype=torch.bool).triu_(1)
        weight = self.weight[:n, :n].masked_fill(mask, 0.0)
        gate = torch.einsum("b n d, m n -> b m d", gate, weight) + self.bias[:n]
        if gate_res is not None:
            gate = gate + gate_res
        return gate * res


class TinyAttention(nn.Module):
    """aMLP's single-head attention of width d_attn on the block's input, causal by a triu mask."""

    def __init__(self, d_in: int, d_out: int, d_attn: int = 5) -> None:
        super().__init__()
        self.scale = d_attn ** -0.5
        self.to_qkv = nn.Linear(d_in, d_attn * 3, bias=False)
        self.to_out = nn.Linear(d_attn, d_out)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        mask = torch.ones(sim.shape[-2:], device=x.device).triu(1).bool()
        sim = sim.masked_fill(mask[None], -torch.finfo(q.dtype).max)
        return self.to_out(torch.einsum("b i j, b j d -> b i d", sim.softmax(dim=-1), v))


class AMLP(nn.Module):
    """A causal aMLP language model: embedding, pre-norm gMLP blocks (proj_in, GELU, SGU with tiny attention,
    proj_out, residual), a LayerNorm and head, the next-token cross-entropy."""

    def __init__(self, vocab: int = 13, d: int = 6, d_ffn: int = 10, seq: int = 7, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "norm": nn.LayerNorm(d), "proj_in": nn.Linear(d, d_ffn), "attn": TinyAttention(d, d_ffn // 2),
            "sgu": SpatialGatingUnit(d_ffn, seq), "proj_out": nn.Linear(d_ffn // 2, d)}) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab))

    def forward(self, tokens: Tensor, targets: Tensor) -> tuple:
        x = self.embed(tokens)
        for block in self.blocks:
            h = block["norm"](x)
            gate_res = block["attn"](h)
            x = x + block["proj_out"](block["sgu"](F.gelu(block["proj_in"](h)), gate_res))
        logits = self.head(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- neural spline flow -------------------------------------------------------------------------------------

MIN_BIN_WIDTH = MIN_BIN_HEIGHT = MIN_DERIVATIVE = 1e-3


def searchsorted(bin_locations: Tensor, inputs: Tensor, eps: float = 1e-6) -> Tensor:
    """nflows' bin search: the last location nudged up in place, the count of locations <= the input, minus 1."""
    bin_locations[..., -1] += eps
    return torch.sum(inputs[..., None] >= bin_locations, dim=-1) - 1


def rational_quadratic_spline(inputs: Tensor, unnormalized_widths: Tensor, unnormalized_heights: Tensor,
                              unnormalized_derivatives: Tensor, inverse: bool = False, left: float = 0.0,
                              right: float = 1.0, bottom: float = 0.0, top: float = 1.0) -> tuple:
    """nflows' rational_quadratic_spline (Durkan et al.), without its data-dependent domain check."""
    num_bins = unnormalized_widths.shape[-1]
    widths = F.softmax(unnormalized_widths, dim=-1)
    widths = MIN_BIN_WIDTH + (1 - MIN_BIN_WIDTH * num_bins) * widths
    cumwidths = torch.cumsum(widths, dim=-1)
    cumwidths = F.pad(cumwidths, pad=(1, 0), mode="constant", value=0.0)
    cumwidths = (right - left) * cumwidths + left
    cumwidths[..., 0] = left
    cumwidths[..., -1] = right
    widths = cumwidths[..., 1:] - cumwidths[..., :-1]

    derivatives = MIN_DERIVATIVE + F.softplus(unnormalized_derivatives)

    heights = F.softmax(unnormalized_heights, dim=-1)
    heights = MIN_BIN_HEIGHT + (1 - MIN_BIN_HEIGHT * num_bins) * heights
    cumheights = torch.cumsum(heights, dim=-1)
    cumheights = F.pad(cumheights, pad=(1, 0), mode="constant", value=0.0)
    cumheights = (top - bottom) * cumheights + bottom
    cumheights[..., 0] = bottom
    cumheights[..., -1] = top
    heights = cumheights[..., 1:] - cumheights[..., :-1]

    bin_idx = searchsorted(cumheights if inverse else cumwidths, inputs)[..., None]

    input_cumwidths = cumwidths.gather(-1, bin_idx)[..., 0]
    input_bin_widths = widths.gather(-1, bin_idx)[..., 0]
    input_cumheights = cumheights.gather(-1, bin_idx)[..., 0]
    delta = heights / widths
    input_delta = delta.gather(-1, bin_idx)[..., 0]
    input_derivatives = derivatives.gather(-1, bin_idx)[..., 0]
    input_derivatives_plus_one = derivatives[..., 1:].gather(-1, bin_idx)[..., 0]
    input_heights = heights.gather(-1, bin_idx)[..., 0]

    slopes = input_derivatives + input_derivatives_plus_one - 2 * input_delta
    if inverse:
        a = (inputs - input_cumheights) * slopes + input_heights * (input_delta - input_derivatives)
        b = input_heights * input_derivatives - (inputs - input_cumheights) * slopes
        c = -input_delta * (inputs - input_cumheights)
        discriminant = b.pow(2) - 4 * a * c
        root = (2 * c) / (-b - torch.sqrt(discriminant))
        outputs = root * input_bin_widths + input_cumwidths
        theta = root
    else:
        theta = (inputs - input_cumwidths) / input_bin_widths
    theta_one_minus_theta = theta * (1 - theta)
    denominator = input_delta + slopes * theta_one_minus_theta
    if not inverse:
        numerator = input_heights * (input_delta * theta.pow(2) + input_derivatives * theta_one_minus_theta)
        outputs = input_cumheights + numerator / denominator
    derivative_numerator = input_delta.pow(2) * (input_derivatives_plus_one * theta.pow(2)
                                                 + 2 * input_delta * theta_one_minus_theta
                                                 + input_derivatives * (1 - theta).pow(2))
    logabsdet = torch.log(derivative_numerator) - 2 * torch.log(denominator)
    return outputs, -logabsdet if inverse else logabsdet


def unconstrained_rational_quadratic_spline(inputs: Tensor, widths: Tensor, heights: Tensor, derivatives: Tensor,
                                            inverse: bool = False, tail_bound: float = 2.0) -> tuple:
    """Linear tails outside [-B, B]: the boundary derivatives padded in and written in place to the constant
    whose softplus is 1 - min_derivative; identity and a zero log-det outside, by torch.where."""
    inside = (inputs >= -tail_bound) & (inputs <= tail_bound)
    derivatives = F.pad(derivatives, pad=(1, 1))
    constant = math.log(math.exp(1 - MIN_DERIVATIVE) - 1)
    derivatives[..., 0] = constant
    derivatives[..., -1] = constant
    spline_out, spline_lad = rational_quadratic_spline(
        inputs.clamp(-tail_bound, tail_bound), widths, heights, derivatives, inverse=inverse,
        left=-tail_bound, right=tail_bound, bottom=-tail_bound, top=tail_bound)
    return torch.where(inside, spline_out, inputs), torch.where(inside, spline_lad, torch.zeros_like(spline_lad))


class SplineCoupling(nn.Module):
    """A piecewise rational-quadratic coupling layer (nflows' PiecewiseRationalQuadraticCouplingTransform): the
    identity half conditions an MLP giving widths, heights (divided by sqrt(hidden)) and inner derivatives for
    each bin of the other half; the NLL under a standard normal, and the inverse of the latent reconstructing x."""

    def __init__(self, d: int = 5, bins: int = 4, hidden: int = 9) -> None:
        super().__init__()
        self.split, self.bins, self.hidden = d // 2, bins, hidden
        self.net = nn.Sequential(nn.Linear(self.split, hidden), nn.Tanh(),
                                 nn.Linear(hidden, (d - self.split) * (3 * bins - 1)))

    def params(self, identity: Tensor) -> tuple:
        p = self.net(identity).view(identity.shape[0], -1, 3 * self.bins - 1)
        widths, heights, derivatives = p.split([self.bins, self.bins, self.bins - 1], dim=-1)
        return widths / math.sqrt(self.hidden), heights / math.sqrt(self.hidden), derivatives

    def forward(self, x: Tensor) -> tuple:
        identity, transformed = x[:, :self.split], x[:, self.split:]
        z2, logdet = unconstrained_rational_quadratic_spline(transformed, *self.params(identity))
        z = torch.cat([identity, z2], dim=1)
        log_prob = (-0.5 * z.pow(2) - 0.5 * math.log(2 * math.pi)).sum(1) + logdet.sum(1)
        back, inverse_logdet = unconstrained_rational_quadratic_spline(z2, *self.params(identity), inverse=True)
        loss = -log_prob.mean() + (back - transformed).pow(2).mean() + (logdet + inverse_logdet).pow(2).mean()
        return z, loss


# --- dynamic programs in log space --------------------------------------------------------------------------

def soft_dtw(distances: Tensor, gamma: float) -> Tensor:
    """The soft-DTW recursion as the plain PyTorch ports write it: R (B, N+2, M+2) of inf with R[:, 0, 0] = 0,
    each cell the distance plus -gamma log sum exp(-R_neighbour / gamma), shifted by the neighbours' max."""
    b, n, m = distances.shape
    r = torch.ones((b, n + 2, m + 2), dtype=distances.dtype, device=distances.device) * math.inf
    r[:, 0, 0] = 0
    return soft_dtw_matrix(distances, gamma, r)[:, n, m]


class SoftDTWFunction(torch.autograd.Function):
    """pytorch-softdtw-cuda's CPU _SoftDTW in torch: the forward keeps R, the backward runs the E recursion
    backwards over the cells (R's last row and column set to -inf in place, an infinite R cell set to -inf, E
    accumulated from its three successors weighted by exp((R' - R - D') / gamma))."""

    @staticmethod
    def forward(ctx, distances: Tensor, gamma: float) -> Tensor:
        r = torch.ones((distances.shape[0], distances.shape[1] + 2, distances.shape[2] + 2),
                       dtype=distances.dtype, device=distances.device) * math.inf
        r[:, 0, 0] = 0
        cells = soft_dtw_matrix(distances.detach(), gamma, r)
        ctx.save_for_backward(distances, cells)
        ctx.gamma = gamma
        return cells[:, -2, -2]

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple:
        d_, r = ctx.saved_tensors
        r = r.clone()
        gamma = ctx.gamma
        b, n, m = d_.shape
        d = d_.new_zeros(b, n + 2, m + 2)
        e = d_.new_zeros(b, n + 2, m + 2)
        d[:, 1:n + 1, 1:m + 1] = d_
        e[:, -1, -1] = 1
        r[:, :, -1] = -math.inf
        r[:, -1, :] = -math.inf
        r[:, -1, -1] = r[:, -2, -2]
        for j in range(m, 0, -1):
            for i in range(n, 0, -1):
                r[:, i, j] = torch.where(torch.isinf(r[:, i, j]), -math.inf, r[:, i, j])
                a = torch.exp((r[:, i + 1, j] - r[:, i, j] - d[:, i + 1, j]) / gamma)
                bb = torch.exp((r[:, i, j + 1] - r[:, i, j] - d[:, i, j + 1]) / gamma)
                c = torch.exp((r[:, i + 1, j + 1] - r[:, i, j] - d[:, i + 1, j + 1]) / gamma)
                e[:, i, j] = e[:, i + 1, j] * a + e[:, i, j + 1] * bb + e[:, i + 1, j + 1] * c
        return grad_output.view(-1, 1, 1).expand(b, n, m) * e[:, 1:n + 1, 1:m + 1], None


def soft_dtw_matrix(distances: Tensor, gamma: float, r: Tensor) -> Tensor:
    """The whole R matrix of the soft-DTW recursion, filled in place into r (inf, with r[:, 0, 0] = 0)."""
    n, m = distances.shape[1:]
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            r0 = -r[:, i - 1, j - 1] / gamma
            r1 = -r[:, i - 1, j] / gamma
            r2 = -r[:, i, j - 1] / gamma
            rmax = torch.max(torch.max(r0, r1), r2)
            rsum = torch.exp(r0 - rmax) + torch.exp(r1 - rmax) + torch.exp(r2 - rmax)
            r[:, i, j] = distances[:, i - 1, j - 1] - gamma * (torch.log(rsum) + rmax)
    return r


class SoftDTW(nn.Module):
    """An encoder trained to align sequences under the soft-DTW loss (squared Euclidean costs by broadcasting),
    its recursion cell by cell."""

    def __init__(self, d: int = 3, hidden: int = 5, gamma: float = 0.5) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, d))
        self.gamma = gamma

    @staticmethod
    def alignment(distances: Tensor, gamma: float) -> Tensor:
        return soft_dtw(distances, gamma)

    def forward(self, x: Tensor, y: Tensor) -> tuple:
        pred = self.encoder(x)
        return pred, self.alignment((pred.unsqueeze(2) - y.unsqueeze(1)).pow(2).sum(-1), self.gamma).mean()


class SoftDTWCustomBackward(SoftDTW):
    """The soft-DTW loss of SoftDTW through SoftDTWFunction (a hand-written backward)."""

    @staticmethod
    def alignment(distances: Tensor, gamma: float) -> Tensor:
        return SoftDTWFunction.apply(distances, gamma)


def soft_dtw_wavefront(distances: Tensor, gamma: float) -> Tensor:
    """Soft-DTW as the GPU ports order it: one anti-diagonal i + j = p at a time, its cells read and written by
    advanced indexing with index tensors (R[:, i, j] = ...), the softmin by torch.logsumexp of the stacked
    neighbours."""
    b, n, m = distances.shape
    r = torch.full((b, n + 1, m + 1), math.inf, dtype=distances.dtype, device=distances.device)
    r[:, 0, 0] = 0
    for p in range(2, n + m + 1):
        i = torch.arange(max(1, p - m), min(n, p - 1) + 1, device=distances.device)
        j = p - i
        neighbours = torch.stack([r[:, i - 1, j - 1], r[:, i - 1, j], r[:, i, j - 1]], dim=-1)
        r[:, i, j] = distances[:, i - 1, j - 1] - gamma * torch.logsumexp(-neighbours / gamma, dim=-1)
    return r[:, n, m]


class SoftDTWWavefront(SoftDTW):
    """The soft-DTW alignment loss of SoftDTW, its recursion by anti-diagonals."""

    @staticmethod
    def alignment(distances: Tensor, gamma: float) -> Tensor:
        return soft_dtw_wavefront(distances, gamma)


class HMMForward(nn.Module):
    """A Gaussian-emission HMM trained by its marginal likelihood: log_softmax initial and transition logits,
    emission log-densities of learned means and log-scales, alpha_t = logsumexp(alpha_{t-1}[:, :, None] + log A,
    1) + log b_t, frozen past each sequence's length by torch.where; the posterior of the last state returned."""

    def __init__(self, states: int = 4, d: int = 3) -> None:
        super().__init__()
        self.initial = nn.Parameter(torch.randn(states) * 0.5)
        self.transition = nn.Parameter(torch.randn(states, states) * 0.5)
        self.means = nn.Parameter(torch.randn(states, d))
        self.log_scales = nn.Parameter(torch.randn(states, d) * 0.1)

    def forward(self, obs: Tensor, lengths: Tensor) -> tuple:
        diff = (obs[:, :, None] - self.means) / self.log_scales.exp()
        log_b = (-0.5 * diff.pow(2) - self.log_scales - 0.5 * math.log(2 * math.pi)).sum(-1)
        log_a = F.log_softmax(self.transition, dim=-1)
        alpha = F.log_softmax(self.initial, dim=0) + log_b[:, 0]
        for t in range(1, obs.shape[1]):
            stepped = torch.logsumexp(alpha[:, :, None] + log_a, dim=1) + log_b[:, t]
            alpha = torch.where((t < lengths)[:, None], stepped, alpha)
        log_likelihood = torch.logsumexp(alpha, dim=-1)
        return (alpha - log_likelihood[:, None]).exp(), -(log_likelihood / lengths).mean()


def ctc_forward(log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
                blank: int = 0) -> Tensor:
    """CTC's negative log-likelihood by the alpha recursion over the blank-extended labels (T, B, C log-probs),
    as vadimkantorov's ctc.py writes it: unreachable states hold finfo.min, not -inf (a logsumexp of only -inf
    has a NaN gradient in eager); per sequence, divided by the target length like F.ctc_loss's 'mean'."""
    steps, batch, _ = log_probs.shape
    ext = torch.full((batch, 2 * targets.shape[1] + 1), blank, dtype=torch.long, device=targets.device)
    ext[:, 1::2] = targets
    skip = torch.cat([torch.zeros(batch, 2, dtype=torch.bool, device=ext.device),
                      (ext[:, 2:] != ext[:, :-2]) & (ext[:, 2:] != blank)], dim=1)
    neg_inf = torch.finfo(log_probs.dtype).min
    emit = log_probs.gather(2, ext[None].expand(steps, -1, -1))
    alpha = torch.full_like(emit[0], neg_inf)
    alpha[:, :2] = emit[0, :, :2]
    for t in range(1, steps):
        one = F.pad(alpha[:, :-1], (1, 0), value=neg_inf)
        two = torch.where(skip, F.pad(alpha[:, :-2], (2, 0), value=neg_inf), neg_inf)
        stepped = torch.logsumexp(torch.stack([alpha, one, two]), dim=0) + emit[t]
        alpha = torch.where((t < input_lengths)[:, None], stepped, alpha)
    ends = torch.stack([2 * target_lengths, 2 * target_lengths - 1], dim=1)
    return -torch.logsumexp(alpha.gather(1, ends), dim=1) / target_lengths


class HandCTC(nn.Module):
    """A GRU acoustic model over padded frames trained by the hand-written CTC forward (repeated labels, so the
    skip mask matters; shorter inputs and targets in the batch)."""

    def __init__(self, d: int = 4, hidden: int = 7, classes: int = 5) -> None:
        super().__init__()
        self.rnn = nn.GRU(d, hidden, batch_first=True)
        self.out = nn.Linear(hidden, classes)

    def forward(self, frames: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor) -> tuple:
        log_probs = self.out(self.rnn(frames)[0]).log_softmax(-1).transpose(0, 1)
        return log_probs, ctc_forward(log_probs, targets, input_lengths, target_lengths).mean()


class ViterbiPerceptron(nn.Module):
    """A structured perceptron over a linear-chain model, decoded as pytorch-crf's _viterbi_decode scores it
    (score + transitions + emission, max over the previous tag with its indices, frozen past the mask by
    torch.where, end transitions) and the best path traced back in torch by gathers through the history in
    reverse; the loss the best score minus the gold path's score (a sum of gathered emissions and transitions)."""

    def __init__(self, d: int = 5, tags: int = 4) -> None:
        super().__init__()
        self.emit = nn.Linear(d, tags)
        self.start = nn.Parameter(torch.randn(tags) * 0.1)
        self.end = nn.Parameter(torch.randn(tags) * 0.1)
        self.transitions = nn.Parameter(torch.randn(tags, tags) * 0.1)

    def forward(self, x: Tensor, gold: Tensor, mask: Tensor) -> tuple:
        emissions = self.emit(x).transpose(0, 1)                  # (steps, batch, tags)
        score = self.start + emissions[0]
        history = []
        for i in range(1, emissions.shape[0]):
            next_score, indices = (score.unsqueeze(2) + self.transitions + emissions[i].unsqueeze(1)).max(dim=1)
            score = torch.where(mask[:, i].unsqueeze(1), next_score, score)
            history.append(torch.where(mask[:, i].unsqueeze(1), indices, torch.arange(indices.shape[1])))
        score = score + self.end
        best_score, best = score.max(dim=1)
        path = [best]
        for indices in reversed(history):
            best = indices.gather(1, best[:, None]).squeeze(1)
            path.append(best)
        path = torch.stack(path[::-1], dim=1)
        gold_emit = emissions.transpose(0, 1).gather(2, gold[..., None]).squeeze(-1)
        lengths = mask.sum(1)
        gold_trans = self.transitions[gold[:, :-1], gold[:, 1:]] * mask[:, 1:]
        last = gold.gather(1, (lengths - 1)[:, None]).squeeze(1)
        gold_score = self.start[gold[:, 0]] + (gold_emit * mask).sum(1) + gold_trans.sum(1) + self.end[last]
        return path.to(x.dtype), (best_score - gold_score).mean()


@torch.no_grad()
def maximum_path(value: Tensor, max_neg_val: float = -1e9) -> Tensor:
    """Glow-TTS's monotonic alignment search (its Cython loop, batched in torch): value[:, x, y] accumulates the
    larger of staying on text token x or advancing from x - 1, in place; the path traced back from the last
    token with an index per sequence, written by index_put and decremented where the previous token scored more."""
    b, t_x, t_y = value.shape
    value = value.clone()
    neg = value.new_full((b,), max_neg_val)
    for y in range(t_y):
        for x in range(max(0, t_x + y - t_y), min(t_x, y + 1)):
            v_cur = neg if x == y else value[:, x, y - 1]
            v_prev = (value.new_zeros(b) if y == 0 else neg) if x == 0 else value[:, x - 1, y - 1]
            value[:, x, y] += torch.maximum(v_prev, v_cur)
    path = torch.zeros_like(value)
    rows = torch.arange(b)
    index = torch.full((b,), t_x - 1, dtype=torch.long)
    for y in range(t_y - 1, -1, -1):
        path[rows, index, y] = 1
        if y > 0:
            earlier = value[rows, (index - 1).clamp_min(0), y - 1]
            move = (index != 0) & ((index == y) | (value[rows, index, y - 1] < earlier))
            index = index - move.long()
    return path


class GlowTTSAlignment(nn.Module):
    """Glow-TTS's MLE alignment: a text encoder's per-token means and log-scales, the log-likelihood of every
    frame under every token by the four matmuls of its reference (logp1..logp4), the monotonic path found under
    no_grad, the means expanded to frames by path @ m, the Gaussian NLL of the frames plus a duration loss on
    log(path.sum(frames))."""

    def __init__(self, vocab: int = 9, d: int = 3, hidden: int = 7) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, 2 * d)
        self.duration = nn.Linear(hidden, 1)

    def forward(self, tokens: Tensor, frames: Tensor) -> tuple:
        h = torch.tanh(self.embed(tokens))
        m, logs = self.proj(h).chunk(2, dim=-1)                       # (b, t_x, d)
        z = frames.transpose(1, 2)                                    # (b, d, t_y)
        x_s_sq_r = torch.exp(-2 * logs)
        logp1 = torch.sum(-0.5 * math.log(2 * math.pi) - logs, -1, keepdim=True)
        logp2 = torch.matmul(x_s_sq_r, -0.5 * (z ** 2))
        logp3 = torch.matmul(m * x_s_sq_r, z)
        logp4 = torch.sum(-0.5 * (m ** 2) * x_s_sq_r, -1, keepdim=True)
        path = maximum_path(logp1 + logp2 + logp3 + logp4).detach()
        m_frames = torch.matmul(path.transpose(1, 2), m)              # (b, t_y, d)
        logs_frames = torch.matmul(path.transpose(1, 2), logs)
        nll = (logs_frames + 0.5 * torch.exp(-2 * logs_frames) * (frames - m_frames) ** 2).mean()
        log_durations = torch.log(path.sum(-1) + 1e-6)
        duration_loss = (self.duration(h).squeeze(-1) - log_durations).pow(2).mean()
        return torch.cat([m_frames.flatten(1), path.flatten(1)], 1), nll + duration_loss


class NeuralSort(nn.Module):
    """NeuralSort (Grover et al.'s reference): the relaxed permutation softmax(((n + 1 - 2 i) s - |s_i - s_j| 1) /
    tau) of scores from an MLP, made hard by an index_put of ones at the row argmaxes with a straight-through
    estimator; the values sorted by P @ v regressed on the true descending sort."""

    def __init__(self, d: int = 3, tau: float = 0.7) -> None:
        super().__init__()
        self.score = nn.Sequential(nn.Linear(d, 6), nn.Tanh(), nn.Linear(6, 1))
        self.tau = tau

    def sort(self, scores: Tensor, hard: bool) -> Tensor:
        scores = scores.unsqueeze(-1)
        bsize, dim = scores.size()[0], scores.size()[1]
        one = torch.ones(dim, 1, dtype=scores.dtype)
        a_scores = torch.abs(scores - scores.permute(0, 2, 1))
        b = torch.matmul(a_scores, torch.matmul(one, torch.transpose(one, 0, 1)))
        scaling = (dim + 1 - 2 * (torch.arange(dim) + 1)).type(scores.dtype)
        c = torch.matmul(scores, scaling.unsqueeze(0))
        p_hat = torch.nn.Softmax(-1)(((c - b).permute(0, 2, 1)) / self.tau)
        if hard:
            p = torch.zeros_like(p_hat)
            b_idx = torch.arange(bsize).repeat([1, dim]).view(dim, bsize).transpose(dim0=1, dim1=0).flatten()
            r_idx = torch.arange(dim).repeat([bsize, 1]).flatten()
            c_idx = torch.argmax(p_hat, dim=-1).flatten()
            brc_idx = torch.stack((b_idx, r_idx, c_idx))
            p[brc_idx[0], brc_idx[1], brc_idx[2]] = 1
            p_hat = (p - p_hat).detach() + p_hat
        return p_hat

    def forward(self, items: Tensor, values: Tensor) -> tuple:
        scores = self.score(items).squeeze(-1)
        soft, hard = self.sort(scores, hard=False), self.sort(scores, hard=True)
        target = values.sort(dim=1, descending=True).values
        sorted_soft = (soft @ values[..., None]).squeeze(-1)
        sorted_hard = (hard @ values[..., None]).squeeze(-1)
        return sorted_hard, F.mse_loss(sorted_soft, target) + F.mse_loss(sorted_hard, target)


def log_sinkhorn_iterations(z: Tensor, log_mu: Tensor, log_nu: Tensor, iters: int) -> Tensor:
    u, v = torch.zeros_like(log_mu), torch.zeros_like(log_nu)
    for _ in range(iters):
        u = log_mu - torch.logsumexp(z + v.unsqueeze(1), dim=2)
        v = log_nu - torch.logsumexp(z + u.unsqueeze(2), dim=1)
    return z + u.unsqueeze(2) + v.unsqueeze(1)


def log_optimal_transport(scores: Tensor, alpha: Tensor, iters: int) -> Tensor:
    """SuperGlue's differentiable optimal transport in log space, with a dustbin row and column of score alpha."""
    b, m, n = scores.shape
    one = scores.new_tensor(1)
    ms, ns = (m * one).to(scores), (n * one).to(scores)
    bins0, bins1 = alpha.expand(b, m, 1), alpha.expand(b, 1, n)
    alpha = alpha.expand(b, 1, 1)
    couplings = torch.cat([torch.cat([scores, bins0], -1), torch.cat([bins1, alpha], -1)], 1)
    norm = -(ms + ns).log()
    log_mu = torch.cat([norm.expand(m), ns.log()[None] + norm])
    log_nu = torch.cat([norm.expand(n), ms.log()[None] + norm])
    log_mu, log_nu = log_mu[None].expand(b, -1), log_nu[None].expand(b, -1)
    return log_sinkhorn_iterations(couplings, log_mu, log_nu, iters) - norm


class SuperGlueMatcher(nn.Module):
    """Descriptors projected and matched by SuperGlue's scores (einsum / sqrt(d)) through log-domain Sinkhorn with
    a learned bin_score; the loss the negative log of the assignment at the given matches and dustbins."""

    def __init__(self, d: int = 5, iters: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.bin_score = nn.Parameter(torch.tensor(1.0))
        self.iters = iters

    def forward(self, desc0: Tensor, desc1: Tensor, match_rows: Tensor, match_cols: Tensor) -> tuple:
        m0, m1 = self.proj(desc0), self.proj(desc1)
        scores = torch.einsum("bdn,bdm->bnm", m0.transpose(1, 2), m1.transpose(1, 2)) / m0.shape[-1] ** 0.5
        z = log_optimal_transport(scores, self.bin_score, self.iters)
        batch = torch.arange(z.shape[0])[:, None]
        return z, -z[batch, match_rows, match_cols].mean()


class KnowledgeDistillation(nn.Module):
    """Distilling a frozen teacher MLP into a smaller student: the teacher's logits under no_grad, the soft targets
    softmax(t / T), the student's log_softmax(s / T), the tutorial's sum(p (log p - log q)) / batch * T^2 and
    Hinton's KLDivLoss(reduction='batchmean') * T^2, mixed with the hard-label cross-entropy."""

    def __init__(self, d: int = 7, classes: int = 5, temperature: float = 2.5) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(d, 13), nn.ReLU(), nn.Linear(13, classes))
        self.student = nn.Sequential(nn.Linear(d, 6), nn.ReLU(), nn.Linear(6, classes))
        self.temperature = temperature

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        t = self.temperature
        with torch.no_grad():
            teacher_logits = self.teacher(x)
        student_logits = self.student(x)
        soft_targets = F.softmax(teacher_logits / t, dim=-1)
        soft_prob = F.log_softmax(student_logits / t, dim=-1)
        tutorial = torch.sum(soft_targets * (soft_targets.log() - soft_prob)) / soft_prob.size()[0] * (t ** 2)
        hinton = nn.KLDivLoss(reduction="batchmean")(soft_prob, soft_targets) * t * t
        hard = F.cross_entropy(student_logits, labels)
        return student_logits, 0.25 * tutorial + 0.25 * hinton + 0.5 * hard


# --- batches ------------------------------------------------------------------------------------------------

def _kan(g: torch.Generator) -> tuple:
    x = torch.randn(7, 3, generator=g) * 0.8          # some outside [-1, 1] and beyond the extended grid
    x[0, 0], x[1, 1] = 1.9, -1.95
    return (x, torch.randn(7, 2, generator=g)), None


def _kan_grid(g: torch.Generator) -> tuple:
    return (torch.randn(13, 3, generator=g), torch.randn(13, 2, generator=g)), None


def _pykan(g: torch.Generator) -> tuple:
    x = torch.rand(7, 3, generator=g) * 2.6 - 1.3      # some outside [-1, 1], inside the extended grid
    return (x, torch.randn(7, 2, generator=g)), None


def _fastkan(g: torch.Generator) -> tuple:
    return (torch.randn(9, 4, generator=g), torch.randint(0, 3, (9,), generator=g)), None


def _slstm(g: torch.Generator) -> tuple:
    return (torch.randn(3, 4, 5, generator=g), torch.randint(0, 3, (3,), generator=g)), None


def _mlstm(g: torch.Generator) -> tuple:
    return (torch.randn(2, 4, 7, generator=g), torch.randn(2, 4, 7, generator=g)), None


def _amlp(g: torch.Generator) -> tuple:
    return (torch.randint(0, 13, (3, 7), generator=g), torch.randint(0, 13, (3, 7), generator=g)), None


def _spline(g: torch.Generator) -> tuple:
    x = torch.randn(7, 5, generator=g) * 1.2          # some beyond the tail bound of 2
    x[0, 3], x[1, 4] = 2.7, -3.1
    return (x,), None


def _soft_dtw(g: torch.Generator) -> tuple:
    return (torch.randn(2, 3, 3, generator=g), torch.randn(2, 2, 3, generator=g)), None


def _hmm(g: torch.Generator) -> tuple:
    return (torch.randn(3, 6, 3, generator=g), torch.tensor([6, 4, 1])), None


def _ctc(g: torch.Generator) -> tuple:
    frames = torch.randn(3, 7, 4, generator=g)
    targets = torch.tensor([[1, 1, 2], [3, 4, 0], [2, 0, 0]])     # a repeat (no skip), padding after the lengths
    return (frames, targets, torch.tensor([7, 5, 4]), torch.tensor([3, 2, 1])), None


def _viterbi(g: torch.Generator) -> tuple:
    mask = torch.arange(6)[None] < torch.tensor([6, 4, 1])[:, None]
    return (torch.randn(3, 6, 5, generator=g), torch.randint(0, 4, (3, 6), generator=g), mask), None


def _glow_tts(g: torch.Generator) -> tuple:
    return (torch.randint(0, 9, (2, 4), generator=g), torch.randn(2, 7, 3, generator=g)), None


def _neuralsort(g: torch.Generator) -> tuple:
    items = torch.randn(3, 7, 3, generator=g)
    return (items, items[..., 0] + 0.1 * torch.randn(3, 7, generator=g)), None


def _superglue(g: torch.Generator) -> tuple:
    desc0, desc1 = torch.randn(2, 4, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    rows = torch.tensor([[0, 1, 2, 3, 4], [0, 2, 3, 1, 4]])       # row 4 / col 3 are the dustbins
    cols = torch.tensor([[1, 0, 3, 2, 0], [2, 0, 3, 1, 1]])
    return (desc0, desc1, rows, cols), None


def _distill(g: torch.Generator) -> tuple:
    return (torch.randn(11, 7, generator=g), torch.randint(0, 5, (11,), generator=g)), None


def cases() -> list[Case]:
    kan = Case("efficient_kan_cox_de_boor", EfficientKAN, _kan, own_loss)
    kan_grid = Case("efficient_kan_update_grid", EfficientKANGridUpdate, _kan_grid, own_loss)
    pykan = Case("pykan_b_batch_recursive", PyKAN, _pykan, own_loss)
    dtw_function = Case("soft_dtw_custom_backward", SoftDTWCustomBackward, _soft_dtw, own_loss)
    fastkan = Case("fastkan_rbf_frozen_grid", FastKAN, _fastkan, own_loss)
    slstm = Case("xlstm_slstm_stabilized", SLSTM, _slstm, own_loss)
    mlstm = Case("xlstm_mlstm_parallel_and_recurrent", MLSTM, _mlstm, own_loss)
    amlp = Case("amlp_spatial_gating", AMLP, _amlp, own_loss)
    spline = Case("rq_spline_coupling", SplineCoupling, _spline, own_loss)
    dtw = Case("soft_dtw_cellwise", SoftDTW, _soft_dtw, own_loss)
    wavefront = Case("soft_dtw_wavefront", SoftDTWWavefront, _soft_dtw, own_loss)
    hmm = Case("hmm_forward_algorithm", HMMForward, _hmm, own_loss)
    ctc = Case("ctc_forward_by_hand", HandCTC, _ctc, own_loss)
    viterbi = Case("viterbi_structured_perceptron", ViterbiPerceptron, _viterbi, own_loss)
    # a constant added to every score shifts each row of P_max by a constant (the scaling sums to 0): softmax ignores it
    neuralsort = Case("neuralsort_straight_through", NeuralSort, _neuralsort, own_loss,
                      zero_grad=(("score.2.bias", slice(None)),))
    glow_tts = Case("glow_tts_monotonic_alignment", GlowTTSAlignment, _glow_tts, own_loss)
    superglue = Case("superglue_log_sinkhorn", SuperGlueMatcher, _superglue, own_loss)
    distill = Case("knowledge_distillation", KnowledgeDistillation, _distill, own_loss)
    return [kan, kan_grid, pykan, dtw_function, fastkan, slstm, mlstm, amlp, spline, dtw, wavefront, hmm, ctc, viterbi, glow_tts, neuralsort, superglue, distill,
            *(bf16(c) for c in (kan, distill)),
            *(fp64(c) for c in (spline, hmm, superglue))]
