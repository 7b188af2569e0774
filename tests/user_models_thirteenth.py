"""A thirteenth set of models written the way users write them, for tests/test_optimizer_user_models_thirteenth.py.

The earlier sets cover SimCLR's NT-Xent, BYOL and SimSiam, CLIP with an unclamped temperature, the library triplet
and cosine-embedding losses, and a MoCo-style queue written by index_copy_. These are the metric-learning and
self-supervised objectives as their reference implementations write them: margin softmax heads (ArcFace with and
without easy_margin, CosFace, SphereFace's (-1)^k cos(m theta) - 2k) on acos of clamped cosines with the margin
placed by scatter_ and one_hot, and insightface's margin put in by arccos_/cos_ in place under no_grad; CLIP with
its logit scale clamped at 100 and SigLIP's sigmoid loss with a learned bias and a +/-1 label matrix from eye;
batch-hard triplet mining (cdist, masks from label equality, masked max and min) with a soft-margin variant;
supervised contrastive (SupCon: two views, a self mask by scatter, row maxima subtracted, means over the positives
by mask sums); MoCo v2 (a momentum encoder updated in place under no_grad, a queue buffer written by slicing);
Barlow Twins (standardised over the batch, a cross-correlation, its off-diagonal by flatten()[:-1].view(n-1,
n+1)[:, 1:]); VICReg (variance hinge on a std with eps, covariance off-diagonal); DINO (a teacher centred by a
running centre buffer, sharpened, cross-entropy over multi-crop pairs) and DINOv2's Sinkhorn-Knopp targets
(in-place normalisation in a loop) and KoLeo (a diagonal filled through view(-1)[::n+1]); the center loss
(index_select of the centres, an index_add_ update of a centre buffer); the circle loss over masked pair
similarities; and proxy-anchor. Sizes are odd and tiny; every input comes from a seeded generator. Each model is a
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


def embedder(d_in: int, d: int, hidden: int = 9) -> nn.Module:
    """The small trunk every model here embeds its inputs with."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d))


# --- margin softmax heads ----------------------------------------------------------------------------------

class MarginHeads(nn.Module):
    """Face-recognition heads on one embedding, as insightface and the arcface-pytorch repository write them:
    ArcFace cos(theta + m) by cos/sin addition with the non-monotonic fix (phi where cos > th, else cos - mm),
    ArcFace with easy_margin (phi where cos > 0), CosFace (cos - m at the target, placed by one_hot), and
    SphereFace's psi = (-1)^k cos(m theta) - 2k with k = floor(m theta / pi) on acos of the clamped cosine; each
    scaled by s into cross-entropy."""

    def __init__(self, d_in: int = 6, d: int = 5, classes: int = 7, s: float = 8.0, m: float = 0.5) -> None:
        super().__init__()
        self.embed = embedder(d_in, d)
        self.arc = nn.Parameter(torch.randn(classes, d))
        self.easy = nn.Parameter(torch.randn(classes, d))
        self.cos = nn.Parameter(torch.randn(classes, d))
        self.sphere = nn.Parameter(torch.randn(classes, d))
        self.s, self.m = s, m
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def arcface(self, cosine: Tensor, label: Tensor, easy_margin: bool) -> Tensor:
        sine = torch.sqrt((1.0 - torch.pow(cosine, 2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > 0, phi, cosine) if easy_margin else \
            torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = torch.zeros(cosine.size(), device=cosine.device)
        one_hot.scatter_(1, label.view(-1, 1).long(), 1)
        return self.s * ((one_hot * phi) + ((1.0 - one_hot) * cosine))

    def forward(self, x: Tensor, label: Tensor) -> tuple:
        e = F.normalize(self.embed(x))
        arc = self.arcface(F.linear(e, F.normalize(self.arc)), label, easy_margin=False)
        easy = self.arcface(F.linear(e, F.normalize(self.easy)), label, easy_margin=True)
        cos = F.linear(e, F.normalize(self.cos))
        cosface = self.s * (cos - self.m * F.one_hot(label, cos.shape[1]))
        cos_theta = F.linear(e, F.normalize(self.sphere)).clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(cos_theta)
        k = torch.floor(4 * theta / math.pi)
        psi = (-1.0) ** k * torch.cos(4 * theta) - 2 * k
        target = torch.gather(psi, 1, label[:, None])
        sphere = self.s * cos_theta.scatter(1, label[:, None], target)
        loss = sum(F.cross_entropy(logits, label) for logits in (arc, easy, cosface, sphere))
        return arc, loss


class CombinedMargin(nn.Module):
    """insightface's arcface_torch CombinedMarginLoss (m1=1, m2=0.5, m3=0): the target logits picked by advanced
    indexing, then under no_grad arccos_ of them and of all logits in place, the margin added, the targets put
    back by index assignment and cos_ in place; the gradient flows past the margin as if it were not there."""

    def __init__(self, d_in: int = 6, d: int = 5, classes: int = 7, s: float = 16.0, m2: float = 0.5) -> None:
        super().__init__()
        self.embed = embedder(d_in, d)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (classes, d)))
        self.s, self.m2 = s, m2

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        logits = F.linear(F.normalize(self.embed(x)), F.normalize(self.weight)).clamp(-1, 1)
        index = torch.arange(len(labels), device=x.device)
        target_logit = logits[index, labels[index].view(-1)]
        with torch.no_grad():
            target_logit.arccos_()
            logits.arccos_()
            final_target_logit = target_logit + self.m2
            logits[index, labels[index].view(-1)] = final_target_logit
            logits.cos_()
        logits = logits * self.s
        return logits, F.cross_entropy(logits, labels)


# --- contrastive image-text ----------------------------------------------------------------------------------

class ClipSigLip(nn.Module):
    """CLIP's symmetric cross-entropy with open_clip's logit_scale.exp().clamp(max=100) (its initial value past
    the clamp, as after a run's first epochs) and SigLIP's pairwise sigmoid loss with a learned temperature and
    bias over the label matrix 2 eye - 1, summed over pairs and divided by the batch."""

    def __init__(self, d_img: int = 7, d_txt: int = 6, d: int = 5) -> None:
        super().__init__()
        self.img, self.txt = embedder(d_img, d), embedder(d_txt, d)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(120.0)))
        self.t_prime = nn.Parameter(torch.tensor(math.log(10.0)))
        self.bias = nn.Parameter(torch.tensor(-10.0))

    def forward(self, images: Tensor, texts: Tensor) -> tuple:
        a = F.normalize(self.img(images), dim=-1)
        b = F.normalize(self.txt(texts), dim=-1)
        logits = self.logit_scale.exp().clamp(max=100) * a @ b.T
        labels = torch.arange(len(images), device=images.device)
        clip = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        sig_logits = a @ b.T * self.t_prime.exp() + self.bias
        pm1 = 2 * torch.eye(len(images), device=images.device) - 1
        siglip = -F.logsigmoid(pm1 * sig_logits).sum() / len(images)
        return logits, clip + siglip


# --- triplet mining ---------------------------------------------------------------------------------------

class BatchHardTriplet(nn.Module):
    """Hermans et al.'s batch-hard triplet loss: pairwise distances by cdist, positive and negative masks from
    label equality (the diagonal removed), the hardest positive by a masked max, the hardest negative by a min
    after adding the row maximum to the non-negatives; the margin loss by margin_ranking_loss and the soft-margin
    variant by softplus."""

    def __init__(self, d_in: int = 6, d: int = 5, margin: float = 0.3) -> None:
        super().__init__()
        self.embed = embedder(d_in, d)
        self.margin = margin

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        e = self.embed(x)
        dist = torch.cdist(e, e)
        same = labels[:, None] == labels[None, :]
        eye = torch.eye(len(labels), dtype=torch.bool, device=x.device)
        positive, negative = (same & ~eye).float(), (~same).float()
        hardest_positive = (dist * positive).max(1)[0]
        max_dist = dist.max(1, keepdim=True)[0]
        hardest_negative = (dist + max_dist * (1.0 - negative)).min(1)[0]
        y = torch.ones_like(hardest_negative)
        hard = F.margin_ranking_loss(hardest_negative, hardest_positive, y, margin=self.margin)
        soft = F.softplus(hardest_positive - hardest_negative).mean()
        return dist, hard + soft


# --- supervised contrastive ------------------------------------------------------------------------------------

class SupCon(nn.Module):
    """Khosla et al.'s SupConLoss as its repository writes it: two views concatenated (contrast_mode 'all'), the
    label mask repeated over views, a self mask by scatter of zeros on the diagonal, the row maximum subtracted
    (detached), log-probabilities over the non-self entries, the mean over each anchor's positives by a mask sum,
    scaled by temperature / base_temperature."""

    def __init__(self, d_in: int = 6, d: int = 5, temperature: float = 0.1) -> None:
        super().__init__()
        self.embed = embedder(d_in, d)
        self.temperature, self.base_temperature = temperature, 0.07

    def forward(self, view1: Tensor, view2: Tensor, labels: Tensor) -> tuple:
        features = torch.stack([F.normalize(self.embed(view1), dim=1), F.normalize(self.embed(view2), dim=1)], 1)
        batch_size, contrast_count = features.shape[0], features.shape[1]
        mask = torch.eq(labels.view(-1, 1), labels.view(-1, 1).T).float()
        contrast_feature = torch.cat(torch.unbind(features, dim=1), dim=0)
        anchor_dot_contrast = torch.div(torch.matmul(contrast_feature, contrast_feature.T), self.temperature)
        logits_max, _ = torch.max(anchor_dot_contrast, dim=1, keepdim=True)
        logits = anchor_dot_contrast - logits_max.detach()
        mask = mask.repeat(contrast_count, contrast_count)
        logits_mask = torch.scatter(torch.ones_like(mask), 1,
                                    torch.arange(batch_size * contrast_count).view(-1, 1), 0)
        mask = mask * logits_mask
        exp_logits = torch.exp(logits) * logits_mask
        log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
        mask_pos_pairs = mask.sum(1)
        mask_pos_pairs = torch.where(mask_pos_pairs < 1e-6, 1, mask_pos_pairs)
        mean_log_prob_pos = (mask * log_prob).sum(1) / mask_pos_pairs
        loss = -(self.temperature / self.base_temperature) * mean_log_prob_pos
        return logits, loss.view(contrast_count, batch_size).mean()


# --- MoCo v2 ------------------------------------------------------------------------------------------------

class MoCo(nn.Module):
    """MoCo v2 as its repository writes it: a query encoder and a key encoder of the same shape whose parameters
    follow the query's by a momentum update in place under no_grad; normalised keys; positive logits by einsum
    'nc,nc->n', negatives against a queue buffer by 'nc,ck->nk' on a detached clone; cross-entropy with label 0
    at temperature 0.2; then the keys enqueued by a slice assignment at a pointer kept in an int buffer."""

    def __init__(self, d_in: int = 6, d: int = 5, queue: int = 15, m: float = 0.99) -> None:
        super().__init__()
        self.encoder_q, self.encoder_k = embedder(d_in, d), embedder(d_in, d)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        self.m, self.T = m, 0.2
        self.register_buffer("queue", F.normalize(torch.randn(d, queue), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self) -> None:
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: Tensor) -> None:
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        self.queue[:, ptr:ptr + batch_size] = keys.T
        self.queue_ptr[0] = (ptr + batch_size) % self.queue.shape[1]

    def forward(self, im_q: Tensor, im_k: Tensor) -> tuple:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        self._dequeue_and_enqueue(k)
        return logits, F.cross_entropy(logits, labels)


# --- redundancy reduction -----------------------------------------------------------------------------------

def off_diagonal(x: Tensor) -> Tensor:
    """A flattened view of the off-diagonal elements of a square matrix (Barlow Twins' and VICReg's helper)."""
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class BarlowTwins(nn.Module):
    """Barlow Twins: a projector, BatchNorm1d without affine standardising each view over the batch, the
    cross-correlation divided by the batch size, (diag - 1)^2 summed plus lambda times the off-diagonal squares;
    a second correlation standardised by hand ((z - mean) / std over the batch) as many reimplementations do."""

    def __init__(self, d_in: int = 6, d: int = 5, lambd: float = 0.05) -> None:
        super().__init__()
        self.projector = embedder(d_in, d)
        self.bn = nn.BatchNorm1d(d, affine=False)
        self.lambd = lambd

    def forward(self, y1: Tensor, y2: Tensor) -> tuple:
        z1, z2 = self.projector(y1), self.projector(y2)
        c = self.bn(z1).T @ self.bn(z2) / z1.shape[0]
        on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
        off_diag = off_diagonal(c).pow_(2).sum()
        z1n = (z1 - z1.mean(0)) / z1.std(0)
        z2n = (z2 - z2.mean(0)) / z2.std(0)
        c2 = torch.mm(z1n.T, z2n) / z1.shape[0]
        by_hand = (torch.diagonal(c2) - 1).pow(2).sum() + self.lambd * off_diagonal(c2).pow(2).sum()
        return c, on_diag + self.lambd * off_diag + by_hand


class VICReg(nn.Module):
    """VICReg as its repository writes it: the invariance MSE, each view centred, a variance hinge on
    sqrt(var + 1e-4) averaged and halved per view, the covariance (x^T x / (n - 1)) off-diagonal squares summed
    over the feature count; weighted 25, 25, 1."""

    def __init__(self, d_in: int = 6, d: int = 5) -> None:
        super().__init__()
        self.projector = embedder(d_in, d)

    def forward(self, x_in: Tensor, y_in: Tensor) -> tuple:
        x, y = self.projector(x_in), self.projector(y_in)
        repr_loss = F.mse_loss(x, y)
        x = x - x.mean(dim=0)
        y = y - y.mean(dim=0)
        std_x = torch.sqrt(x.var(dim=0) + 0.0001)
        std_y = torch.sqrt(y.var(dim=0) + 0.0001)
        std_loss = torch.mean(F.relu(1 - std_x)) / 2 + torch.mean(F.relu(1 - std_y)) / 2
        batch_size, num_features = x.shape
        cov_x = (x.T @ x) / (batch_size - 1)
        cov_y = (y.T @ y) / (batch_size - 1)
        cov_loss = off_diagonal(cov_x).pow_(2).sum().div(num_features) + \
            off_diagonal(cov_y).pow_(2).sum().div(num_features)
        return x, 25.0 * repr_loss + 25.0 * std_loss + 1.0 * cov_loss


# --- DINO ---------------------------------------------------------------------------------------------------

class DINO(nn.Module):
    """DINO's loss over multi-crop views: the student's logits over all crops divided by its temperature and
    chunked per crop; the teacher's (an EMA copy, run under no_grad on the two global crops) centred by a running
    centre buffer and sharpened by softmax at a lower temperature; cross-entropy -q log_softmax(s) summed over
    every (teacher crop, student crop) pair but the same crop, averaged; then the centre updated by an EMA of the
    teacher's batch mean."""

    def __init__(self, d_in: int = 6, out_dim: int = 7, crops: int = 4) -> None:
        super().__init__()
        self.student, self.teacher = embedder(d_in, out_dim), embedder(d_in, out_dim)
        self.teacher.load_state_dict(self.student.state_dict())
        for p in self.teacher.parameters():
            p.requires_grad = False
        self.crops, self.student_temp, self.teacher_temp, self.center_momentum = crops, 0.1, 0.04, 0.9
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, global_crops: Tensor, local_crops: Tensor) -> tuple:
        student_output = self.student(torch.cat([global_crops, local_crops]))
        with torch.no_grad():
            teacher_output = self.teacher(global_crops)
        student_out = (student_output / self.student_temp).chunk(self.crops)
        teacher_out = F.softmax((teacher_output - self.center) / self.teacher_temp, dim=-1).detach().chunk(2)
        total_loss, n_loss_terms = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        with torch.no_grad():
            batch_center = torch.sum(teacher_output, dim=0, keepdim=True) / len(teacher_output)
            self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)
        return student_output, total_loss / n_loss_terms


class DINOv2Losses(nn.Module):
    """DINOv2's additions to DINO as its repository writes them: the teacher's targets by Sinkhorn-Knopp under
    no_grad (exp of the scaled logits, transposed, three rounds of in-place row and column normalisation), and
    the KoLeo regulariser on the student's normalised features (the Gram matrix's diagonal filled with -1 through
    a flat strided view, view(-1)[::n + 1].fill_, each nearest neighbour by max, -log of PairwiseDistance)."""

    def __init__(self, d_in: int = 6, out_dim: int = 7, d: int = 5) -> None:
        super().__init__()
        self.backbone, self.head = embedder(d_in, d), nn.Linear(d, out_dim)
        self.teacher = nn.Sequential(embedder(d_in, d), nn.Linear(d, out_dim))
        self.teacher.load_state_dict({**{f"0.{k}": v for k, v in self.backbone.state_dict().items()},
                                      **{f"1.{k}": v for k, v in self.head.state_dict().items()}})
        self.teacher.requires_grad_(False)
        self.pdist = nn.PairwiseDistance(2, eps=1e-8)

    @torch.no_grad()
    def sinkhorn_knopp_teacher(self, teacher_output: Tensor, teacher_temp: float, n_iterations: int = 3) -> Tensor:
        Q = torch.exp(teacher_output.float() / teacher_temp).t()
        B, K = Q.shape[1], Q.shape[0]
        Q /= torch.sum(Q)
        for _ in range(n_iterations):
            Q /= torch.sum(Q, dim=1, keepdim=True)
            Q /= K
            Q /= torch.sum(Q, dim=0, keepdim=True)
            Q /= B
        Q *= B
        return Q.t()

    def koleo(self, x: Tensor, eps: float = 1e-8) -> Tensor:
        x = F.normalize(x, eps=eps, p=2, dim=-1)
        dots = torch.mm(x, x.t())
        n = x.shape[0]
        dots.view(-1)[:: (n + 1)].fill_(-1)
        _, nearest = torch.max(dots, dim=1)
        return -torch.log(self.pdist(x, x[nearest]) + eps).mean()

    def forward(self, view1: Tensor, view2: Tensor) -> tuple:
        features = self.backbone(torch.cat([view1, view2]))
        student = self.head(features)
        targets = self.sinkhorn_knopp_teacher(self.teacher(torch.cat([view2, view1])), 0.07)
        dino = torch.sum(-targets * F.log_softmax(student / 0.1, dim=-1), dim=-1).mean()
        return student, dino + 0.1 * self.koleo(features)


# --- proxies and centres ------------------------------------------------------------------------------------

class CenterLoss(nn.Module):
    """Softmax plus Wen et al.'s center loss: learned centres picked per sample by index_select, half the squared
    distance averaged; and the paper's own update of a centre buffer instead of a gradient (under no_grad: the
    per-class sum of (centre - feature) by index_add_, divided by 1 + the class count, also by index_add_)."""

    def __init__(self, d_in: int = 6, d: int = 5, classes: int = 4, alpha: float = 0.5) -> None:
        super().__init__()
        self.embed = embedder(d_in, d)
        self.fc = nn.Linear(d, classes)
        self.centers = nn.Parameter(torch.randn(classes, d))
        self.register_buffer("running_centers", torch.randn(classes, d))
        self.alpha = alpha

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        feat = self.embed(x)
        logits = self.fc(feat)
        centers_batch = self.centers.index_select(0, labels)
        center_loss = (feat - centers_batch).pow(2).sum() / 2.0 / feat.shape[0]
        running = self.running_centers.index_select(0, labels)
        buffer_loss = (feat - running).pow(2).sum(1).mean()
        with torch.no_grad():
            diff = torch.zeros_like(self.running_centers).index_add_(0, labels, running - feat)
            counts = torch.zeros(len(self.running_centers), dtype=feat.dtype, device=x.device).index_add_(
                0, labels, torch.ones_like(labels, dtype=feat.dtype))
            self.running_centers -= self.alpha * diff / (1.0 + counts[:, None])
        return logits, F.cross_entropy(logits, labels) + 0.1 * center_loss + 0.01 * buffer_loss


class CircleLoss(nn.Module):
    """Sun et al.'s circle loss over the pairs of a batch: cosine similarities, positive and negative pair masks
    from label equality on the upper triangle, self-paced weights clamp_min(1 + m - s_p) and clamp_min(s_n + m)
    on detached similarities, logits filled with -inf off their pairs, softplus of the two logsumexps."""

    def __init__(self, d_in: int = 6, d: int = 5, m: float = 0.25, gamma: float = 16.0) -> None:
        super().__init__()
        self.embed = embedder(d_in, d)
        self.m, self.gamma = m, gamma

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        e = F.normalize(self.embed(x))
        sim = e @ e.T
        label_matrix = labels.unsqueeze(1) == labels.unsqueeze(0)
        upper = torch.ones_like(label_matrix).triu(diagonal=1)
        positive, negative = label_matrix & upper, ~label_matrix & upper
        ap = torch.clamp_min(-sim.detach() + 1 + self.m, min=0.)
        an = torch.clamp_min(sim.detach() + self.m, min=0.)
        delta_p, delta_n = 1 - self.m, self.m
        logit_p = (-ap * (sim - delta_p) * self.gamma).masked_fill(~positive, float("-inf"))
        logit_n = (an * (sim - delta_n) * self.gamma).masked_fill(~negative, float("-inf"))
        loss = F.softplus(torch.logsumexp(logit_n.flatten(), 0) + torch.logsumexp(logit_p.flatten(), 0))
        return sim, loss


class ProxyAnchor(nn.Module):
    """Kim et al.'s proxy-anchor loss as its repository writes it: cosine to L2-normalised proxies (kaiming-
    initialised), one_hot positives, exp(-alpha (cos - mrg)) and exp(alpha (cos + mrg)) summed per proxy by
    torch.where on the one-hot, log(1 + sum) averaged over the proxies with positives and over all."""

    def __init__(self, d_in: int = 6, d: int = 5, classes: int = 5, mrg: float = 0.1, alpha: float = 32.0) -> None:
        super().__init__()
        self.embed = embedder(d_in, d)
        self.proxies = nn.Parameter(torch.randn(classes, d))
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")
        self.classes, self.mrg, self.alpha = classes, mrg, alpha

    def forward(self, x: Tensor, labels: Tensor) -> tuple:
        cos = F.linear(F.normalize(self.embed(x)), F.normalize(self.proxies))
        p_one_hot = F.one_hot(labels, self.classes).float()
        n_one_hot = 1 - p_one_hot
        pos_exp = torch.exp(-self.alpha * (cos - self.mrg))
        neg_exp = torch.exp(self.alpha * (cos + self.mrg))
        num_valid_proxies = (p_one_hot.sum(dim=0) != 0).sum()
        p_sim_sum = torch.where(p_one_hot == 1, pos_exp, torch.zeros_like(pos_exp)).sum(dim=0)
        n_sim_sum = torch.where(n_one_hot == 1, neg_exp, torch.zeros_like(neg_exp)).sum(dim=0)
        pos_term = torch.log(1 + p_sim_sum).sum() / num_valid_proxies
        neg_term = torch.log(1 + n_sim_sum).sum() / self.classes
        return cos, pos_term + neg_term


# --- batches ------------------------------------------------------------------------------------------------

def _labelled(n: int, d: int, classes: int):
    """n samples of d features with labels in [0, classes), every class present at least twice where n allows."""
    def batch(g: torch.Generator) -> tuple:
        labels = torch.arange(n) % classes
        labels = labels[torch.randperm(n, generator=g)]
        return (torch.randn(n, d, generator=g), labels), None
    return batch


def _pairs(n: int, d1: int, d2: int):
    def batch(g: torch.Generator) -> tuple:
        x = torch.randn(n, d1, generator=g)
        y = x[:, :d2] + 0.3 * torch.randn(n, d2, generator=g) if d1 >= d2 else torch.randn(n, d2, generator=g)
        return (x, y), None
    return batch


def _two_views(g: torch.Generator) -> tuple:
    x = torch.randn(7, 6, generator=g)
    labels = torch.randint(0, 3, (7,), generator=g)
    return (x + 0.2 * torch.randn(7, 6, generator=g), x + 0.2 * torch.randn(7, 6, generator=g), labels), None


def _crops(g: torch.Generator) -> tuple:
    return (torch.randn(2 * 3, 6, generator=g), torch.randn(2 * 3, 6, generator=g)), None


def cases() -> list[Case]:
    margins = Case("margin_heads_arcface_sphereface", MarginHeads, _labelled(9, 6, 7), own_loss)
    combined = Case("insightface_combined_margin", CombinedMargin, _labelled(9, 6, 7), own_loss)
    clip = Case("clip_siglip_clamped_scale", ClipSigLip, _pairs(7, 7, 6), own_loss)
    # distances, standardised and centred features do not move with the last layer's bias: its gradient is 0
    triplet = Case("batch_hard_triplet", BatchHardTriplet, _labelled(9, 6, 3), own_loss, (("embed.2.bias", ...),))
    supcon = Case("supcon_two_views", SupCon, _two_views, own_loss)
    moco = Case("moco_v2_queue", MoCo, _pairs(5, 6, 6), own_loss)
    barlow = Case("barlow_twins", BarlowTwins, _pairs(7, 6, 6), own_loss, (("projector.2.bias", ...),))
    vicreg = Case("vicreg", VICReg, _pairs(7, 6, 6), own_loss, (("projector.2.bias", ...),))
    dino = Case("dino_multicrop_center", DINO, _crops, own_loss)
    dinov2 = Case("dinov2_sinkhorn_koleo", DINOv2Losses, _pairs(5, 6, 6), own_loss)
    center = Case("center_loss_index_add", CenterLoss, _labelled(9, 6, 4), own_loss)
    circle = Case("circle_loss", CircleLoss, _labelled(9, 6, 3), own_loss)
    proxy = Case("proxy_anchor", ProxyAnchor, _labelled(9, 6, 4), own_loss)
    return [margins, combined, clip, triplet, supcon, moco, barlow, vicreg, dino, dinov2, center, circle, proxy,
            *(bf16(c) for c in (margins, combined, supcon)),
            *(fp64(c) for c in (margins, clip, supcon, dino, center, circle, proxy))]
