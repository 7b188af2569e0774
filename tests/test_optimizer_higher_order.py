"""Higher-order autograd, torch.func and training-loop idioms as researchers write them, compiled with the
tfsn backend against eager PyTorch (the values each idiom returns: losses, outputs, gradients, parameters
and buffers after steps; the tolerances of tests/test_optimizer_user_models.py). Beside
tests/test_optimizer_autograd_idioms.py (a WGAN-GP by vmap(grad), one MAML step, custom Functions, hooks):
Hessian-vector products forward-over-reverse (jvp of grad, a Hutchinson trace logged every step) and
reverse-over-reverse; DP-SGD's clipped per-sample gradients over batches of changing size; an R1 penalty
on a conv critic; Jacobian and input-Hessian penalties (vmap of jacrev and hessian); PGD inside the
compiled step and FGSM around a compiled model; MAML with two inner steps and Meta-SGD's learned inner
rates; an ensemble trained through vmap of functional_call; BYOL (an EMA target by _foreach_lerp_,
evaluated under no_grad) and SimSiam with the whole step compiled; a gradient cache for a contrastive
loss; non-reentrant activation checkpointing with a no_grad region; accumulation over micro-batches;
backward twice through one forward (retain_graph) and a GAN whose fake feeds two critic calls; layers
frozen mid-run with the whole step compiled; DANN's reversal weight, a hook's scale and a quantizer's bit
width changing every step; a straight-through one-hot; statistics taken under no_grad inside forward; an
EMA and AdamW over weights and gradients that are views of one flat buffer (Megatron's layout). Second
derivatives of single ops (pooling, resampling, normalization, losses, special functions) in fp64. The
loops also run with every graph replayed as the stand-in of a CUDA graph (optimizer/graphs.py), as on a
GPU. Each idiom must generate kernels and leave no graph to ATen.
(torch.func.jvp of grad through F.mse_loss fails in eager PyTorch 2.13, "ZeroTensors are immutable": the
HVPs write the squared error out.)"""
from __future__ import annotations

import copy
import importlib.util
import math
import os
from typing import Callable

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call, grad, hessian, jacrev, jvp, stack_module_state, vmap  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from optimizer import graphs  # noqa: E402
from tests.test_optimizer_autograd_idioms import Compile, GradReverse, gen, matches_eager  # noqa: E402
from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_training_loops import SeededRerun  # noqa: E402

STEPS = 5       # two calls before a graph is captured, then replays


def params_of(*modules: nn.Module) -> list:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def grads_of(*modules: nn.Module) -> list:
    return [p.grad for m in modules for p in m.parameters()]


def squared_error(net: nn.Module, params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (functional_call(net, params, (x,)) - y).square().mean()


def hvp_and_hutchinson(compile: Compile) -> list:
    """A Hessian-vector product by jvp of grad, and Hutchinson's trace estimate logged beside SGD steps."""
    net = nn.Sequential(nn.Linear(5, 9), nn.GELU(), nn.Linear(9, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    def hvp(params: dict, x: torch.Tensor, y: torch.Tensor, v: dict) -> tuple:
        hv = jvp(grad(lambda p: squared_error(net, p, x, y)), (params,), (v,))[1]
        return hv, sum((hv[k] * v[k]).sum() for k in v)
    hvp_c, forward = compile(hvp), compile(net)
    results = []
    for s in range(STEPS):
        x, y = torch.randn(11, 5, generator=gen(s)), torch.randn(11, 1, generator=gen(30 + s))
        params = {k: p.detach() for k, p in net.named_parameters()}
        v = {k: torch.randint(0, 2, p.shape, generator=gen(60 + s)).float() * 2 - 1 for k, p in params.items()}
        hv, trace = hvp_c(params, x, y, v)
        results += [trace] + list(hv.values())
        opt.zero_grad()
        (forward(x) - y).square().mean().backward()
        opt.step()
    return results + params_of(net)


def hvp_reverse_over_reverse(compile: Compile) -> list:
    """grad of <grad(loss), v>: second derivatives of cross-entropy, LayerNorm and SiLU."""
    net = nn.Sequential(nn.Linear(5, 9), nn.SiLU(), nn.LayerNorm(9), nn.Linear(9, 3))
    x, y = torch.randn(11, 5, generator=gen(1)), torch.randint(0, 3, (11,), generator=gen(2))
    params = {k: p.detach() for k, p in net.named_parameters()}
    v = {k: torch.randn(p.shape, generator=gen(3)) for k, p in params.items()}

    def directional(p: dict) -> torch.Tensor:
        g = grad(lambda q: F.cross_entropy(functional_call(net, q, (x,)), y))(p)
        return sum((g[k] * v[k]).sum() for k in g)
    return list(compile(grad(directional))(params).values())


def dp_sgd_ragged_batches(compile: Compile) -> list:
    """DP-SGD: per-sample gradients by vmap(grad), each clipped to norm 0.5, averaged and applied, over batches
    whose size changes (the last of an epoch smaller): one dynamic graph."""
    net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))

    def per_sample_loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(net, p, (xi[None],)), yi[None])

    def clipped_gradients(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        g = vmap(grad(per_sample_loss), in_dims=(None, 0, 0))(p, x, y)
        norms = torch.stack([gi.flatten(1).norm(dim=1) for gi in g.values()], 1).norm(dim=1)
        factor = 1.0 / (norms / 0.5).clamp(min=1.0)
        return {k: torch.einsum("n,n...->...", factor, g[k]) / x.shape[0] for k in g}, norms
    clipped = compile(clipped_gradients)
    results = []
    for s, n in enumerate((9, 9, 5, 5, 9)):
        x, y = torch.randn(n, 6, generator=gen(s)), torch.randint(0, 4, (n,), generator=gen(20 + s))
        g, norms = clipped({k: p.detach() for k, p in net.named_parameters()}, x, y)
        with torch.no_grad():
            for k, p in net.named_parameters():
                p.sub_(0.5 * g[k])
        results += [norms] + list(g.values())
    return results


def r1_penalty(compile: Compile) -> list:
    """StyleGAN's R1: the squared input gradient of a conv critic on real images (leaky ReLU, strided conv)."""
    D = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(5, 4, 3, stride=2),
                      nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(36, 1))
    real = torch.randn(4, 3, 7, 7, generator=gen(1))

    def critic_loss(real: torch.Tensor) -> torch.Tensor:
        g = grad(lambda r: D(r).sum())(real)
        return F.softplus(-D(real)).mean() + 5.0 * g.square().sum((1, 2, 3)).mean()
    loss = compile(critic_loss)(real)
    loss.backward()
    return [loss] + grads_of(D)


def jacobian_and_curvature_penalties(compile: Compile) -> list:
    """The Frobenius norm of each sample's input Jacobian (vmap of jacrev) and the squared trace of its input
    Hessian (vmap of hessian), added to the loss."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ELU(), nn.Linear(8, 3), nn.Softmax(-1))
    scalar = nn.Sequential(nn.Linear(3, 8), nn.Softplus(), nn.Linear(8, 1))
    x, z = torch.randn(6, 4, generator=gen(1)), torch.randn(5, 3, generator=gen(2))

    def loss(params: dict, x: torch.Tensor, scalar_params: dict, z: torch.Tensor) -> torch.Tensor:
        J = vmap(jacrev(lambda xi: functional_call(net, params, (xi,))))(x)
        u = lambda zi: functional_call(scalar, scalar_params, (zi,)).squeeze()   # noqa: E731
        H = vmap(hessian(u))(z)
        return functional_call(net, params, (x,)).log().mean() + 0.1 * J.square().sum((1, 2)).mean() + \
            0.1 * H.diagonal(dim1=1, dim2=2).sum(1).square().mean() + functional_call(scalar, scalar_params, (z,)).mean()
    value = compile(loss)(dict(net.named_parameters()), x, dict(scalar.named_parameters()), z)
    value.backward()
    return [value] + grads_of(net, scalar)


def pgd_inside_the_step(compile: Compile) -> list:
    """Adversarial training with three PGD steps (sign of the input gradient by torch.func, projected onto the
    eps-ball by clamp) inside the compiled step, then the clean and adversarial losses' backward."""
    net = nn.Sequential(nn.Linear(6, 12), nn.Hardswish(), nn.Linear(12, 3))
    x, y = torch.randn(7, 6, generator=gen(1)), torch.randint(0, 3, (7,), generator=gen(2))

    def loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def loss_at(xa: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(net, params, (xa,)), y)
        xa = x
        for _ in range(3):
            xa = (xa + 0.05 * grad(loss_at)(xa).sign()).clamp(x - 0.1, x + 0.1).detach()
        return loss_at(xa) + 0.5 * loss_at(x)
    value = compile(loss)(dict(net.named_parameters()), x, y)
    value.backward()
    return [value] + grads_of(net)


def fgsm_around_a_compiled_model(compile: Compile) -> list:
    """FGSM as usually written: the input requires grad, backward, x + eps * x.grad.sign(), then a step on the
    adversarial and clean batches (the model's graphs called with and without an input gradient)."""
    net = nn.Sequential(nn.Linear(6, 12), nn.GELU(approximate="tanh"), nn.Linear(12, 3))
    forward = compile(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    results = []
    for s in range(STEPS):
        x = torch.randn(7, 6, generator=gen(s)).requires_grad_()
        y = torch.randint(0, 3, (7,), generator=gen(10 + s))
        F.cross_entropy(forward(x), y).backward()
        adversarial = (x + 0.1 * x.grad.sign()).detach()
        opt.zero_grad()
        loss = F.cross_entropy(forward(adversarial), y) + 0.5 * F.cross_entropy(forward(x.detach()), y)
        loss.backward()
        opt.step()
        results += [loss.detach(), x.grad]
    return results + params_of(net)


def maml_two_inner_steps(compile: Compile) -> list:
    """MAML with two inner SGD steps by torch.func.grad, the outer loss differentiated through both."""
    net = nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 1))
    opt = torch.optim.Adam(net.parameters(), 1e-2)

    def outer(params: dict, xs: torch.Tensor, ys: torch.Tensor, xq: torch.Tensor, yq: torch.Tensor) -> torch.Tensor:
        fast = params
        for _ in range(2):
            g = grad(lambda p: squared_error(net, p, xs, ys))(fast)
            fast = {k: fast[k] - 0.1 * g[k] for k in fast}
        return squared_error(net, fast, xq, yq)
    outer_c = compile(outer)
    results = []
    for s in range(STEPS):
        xs, ys, xq, yq = (torch.randn(7, n, generator=gen(s * 4 + i)) for i, n in enumerate((4, 1, 4, 1)))
        opt.zero_grad()
        loss = outer_c(dict(net.named_parameters()), xs, ys, xq, yq)
        loss.backward()
        opt.step()
        results.append(loss.detach())
    return results + params_of(net)


def meta_sgd_ragged_support(compile: Compile) -> list:
    """Meta-SGD: a learned inner learning rate per parameter element, support sets of changing size."""
    net = nn.Sequential(nn.Linear(3, 9), nn.ReLU(), nn.Linear(9, 1))
    rates = {k: nn.Parameter(torch.full_like(p, 0.05)) for k, p in net.named_parameters()}
    opt = torch.optim.SGD(list(net.parameters()) + list(rates.values()), lr=0.05)

    def outer(params: dict, rates: dict, xs, ys, xq, yq) -> torch.Tensor:
        g = grad(lambda p: F.smooth_l1_loss(functional_call(net, p, (xs,)), ys))(params)
        return F.smooth_l1_loss(functional_call(net, {k: params[k] - rates[k] * g[k] for k in params}, (xq,)), yq)
    outer_c = compile(outer)
    results = []
    for s, n in enumerate((5, 5, 8, 3, 5)):
        xs, ys = torch.randn(n, 3, generator=gen(s)), torch.randn(n, 1, generator=gen(30 + s))
        xq, yq = torch.randn(4, 3, generator=gen(60 + s)), torch.randn(4, 1, generator=gen(90 + s))
        opt.zero_grad()
        loss = outer_c(dict(net.named_parameters()), rates, xs, ys, xq, yq)
        loss.backward()
        opt.step()
        results.append(loss.detach())
    return results + params_of(net) + [r.detach().clone() for r in rates.values()]


def vmapped_ensemble(compile: Compile) -> list:
    """Three MLPs trained as one: stack_module_state, vmap of functional_call over a meta-device copy."""
    models = [nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 2)) for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    opt = torch.optim.Adam(params.values(), lr=1e-2)

    def loss(params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        out = vmap(lambda p, b: functional_call(base, (p, b), (x,)))(params, buffers)
        return F.cross_entropy(out.flatten(0, 1), y.repeat(3)), out
    loss_c = compile(loss)
    results = []
    for s in range(STEPS):
        x, y = torch.randn(6, 5, generator=gen(s)), torch.randint(0, 2, (6,), generator=gen(9 + s))
        opt.zero_grad()
        value, out = loss_c(params, buffers, x, y)
        value.backward()
        opt.step()
        results += [value.detach(), out.detach()]
    return results + [p.detach().clone() for p in params.values()]


def byol(compile: Compile) -> list:
    """BYOL: online encoder (BatchNorm) and predictor; the target, an EMA of the encoder by _foreach_lerp_ in a
    compiled function (buffers copied), evaluated under no_grad; a symmetric cosine loss."""
    encoder = nn.Sequential(nn.Linear(6, 10), nn.BatchNorm1d(10), nn.ReLU(), nn.Linear(10, 5))
    predictor = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 5))
    target = copy.deepcopy(encoder).requires_grad_(False)
    opt = torch.optim.SGD(list(encoder.parameters()) + list(predictor.parameters()), lr=0.1, momentum=0.9)
    online, predict, targeted = compile(encoder), compile(predictor), compile(target)

    def follow(tau: torch.Tensor) -> None:
        with torch.no_grad():
            torch._foreach_lerp_(list(target.parameters()), list(encoder.parameters()), 1 - tau)
            torch._foreach_copy_(list(target.buffers()), list(encoder.buffers()))
    follow_c = compile(follow)
    results = []
    for s in range(STEPS):
        x = torch.randn(8, 6, generator=gen(s))
        a, b = x + 0.1 * torch.randn(8, 6, generator=gen(20 + s)), x * 0.9
        opt.zero_grad()
        p1, p2 = predict(online(a)), predict(online(b))
        with torch.no_grad():
            z1, z2 = targeted(a), targeted(b)
        loss = 4 - 2 * F.cosine_similarity(p1, z2, dim=-1).mean() - 2 * F.cosine_similarity(p2, z1, dim=-1).mean()
        loss.backward()
        opt.step()
        follow_c(torch.tensor(0.9))
        results += [loss.detach(), z1, z2]
    return results + params_of(encoder, predictor) + [t.clone() for t in target.state_dict().values()]


def simsiam_whole_step(compile: Compile) -> list:
    """SimSiam, stop-gradient on the other view's projection, with forward, backward, AdamW's step and
    zero_grad in one compiled function."""
    encoder = nn.Sequential(nn.Linear(6, 9), nn.LayerNorm(9), nn.GELU(), nn.Linear(9, 5))
    predictor = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 5))
    opt = torch.optim.AdamW(list(encoder.parameters()) + list(predictor.parameters()), lr=1e-2)

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z1, z2 = encoder(a), encoder(b)
        p1, p2 = predictor(z1), predictor(z2)
        loss = -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    step_c = compile(step)
    results = []
    for s in range(3):
        x = torch.randn(8, 6, generator=gen(s))
        results.append(step_c(x + 0.1, x.flip(0) * 0.5))
    return results + params_of(encoder, predictor)


def gradient_cache(compile: Compile) -> list:
    """A gradient cache (GradCache) for an InfoNCE loss over a batch too big for one backward: embeddings of
    every chunk under no_grad, the loss's gradient with respect to those detached embeddings, then each chunk
    forwarded again and backpropagated with its slice of that gradient."""
    encoder = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))
    embed = compile(encoder)
    opt = torch.optim.SGD(encoder.parameters(), lr=0.2)
    results = []
    for s in range(STEPS):
        x, y = torch.randn(8, 6, generator=gen(s)), torch.randn(8, 6, generator=gen(50 + s))
        chunks = [(x[:4], y[:4]), (x[4:], y[4:])]
        with torch.no_grad():
            queries = torch.cat([embed(a) for a, _ in chunks]).requires_grad_()
            keys = torch.cat([embed(b) for _, b in chunks]).requires_grad_()
        loss = F.cross_entropy(F.normalize(queries, dim=1) @ F.normalize(keys, dim=1).T / 0.1, torch.arange(8))
        loss.backward()
        opt.zero_grad()
        for i, (a, b) in enumerate(chunks):
            (embed(a) * queries.grad[4 * i:4 * i + 4]).sum().backward()
            (embed(b) * keys.grad[4 * i:4 * i + 4]).sum().backward()
        results += [loss.detach(), queries.grad, keys.grad] + grads_of(encoder)
        opt.step()
    return results + params_of(encoder)


def checkpointed_blocks(compile: Compile) -> list:
    """Non-reentrant activation checkpointing of a residual block twice inside the compiled function, a
    normaliser taken under no_grad between, and in-place ops after."""
    inner = nn.Sequential(nn.Linear(7, 11), nn.SiLU(), nn.Linear(11, 7))
    outer = nn.Sequential(nn.LayerNorm(7), nn.Linear(7, 7), nn.Softplus())
    head = nn.Linear(7, 2)

    def block(h: torch.Tensor) -> torch.Tensor:
        return h + outer(inner(h))

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(block, x, use_reentrant=False)
        with torch.no_grad():
            scale = h.abs().amax(1, keepdim=True) + 1
        h = checkpoint(block, h / scale, use_reentrant=False).clone()
        h.mul_(2).add_(1)
        return head(h)
    x = torch.randn(5, 7, generator=gen(1)).requires_grad_()
    out = compile(forward)(x)
    (out * torch.tensor([1.0, -2.0])).sum().backward()
    return [out, x.grad] + grads_of(inner, outer, head)


def micro_batches(compile: Compile) -> list:
    """Gradient accumulation: three micro-batches forwarded first, then each loss / 3 backpropagated, one
    Adam step per batch; the accumulated gradients compared."""
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    forward = compile(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    results = []
    for s in range(STEPS):
        x, y = torch.randn(9, 6, generator=gen(s)), torch.randint(0, 3, (9,), generator=gen(5 + s))
        losses = [F.cross_entropy(forward(x[i:i + 3]), y[i:i + 3]) / 3 for i in (0, 3, 6)]
        for loss in losses:
            loss.backward()
        results += [loss.detach() for loss in losses] + [g.clone() for g in grads_of(net)]
        opt.step()
        opt.zero_grad()
    return results + params_of(net)


def backward_twice(compile: Compile) -> list:
    """Two losses of one compiled forward backpropagated in turn (retain_graph), the first's gradients kept."""
    net = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 4), nn.Softmax(-1))
    forward = compile(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    results = []
    for s in range(STEPS):
        x = torch.randn(5, 6, generator=gen(s)).requires_grad_()
        out = forward(x)
        opt.zero_grad()
        out[:, 0].sum().backward(retain_graph=True)
        first = [g.clone() for g in grads_of(net)]
        (out * torch.arange(4.0)).sum().backward()
        opt.step()
        results += [out.detach(), x.grad] + first
    return results + params_of(net)


def gan_fake_reused(compile: Compile) -> list:
    """A non-saturating GAN step: the generator's output fed detached to the critic with the real batch (two
    critic calls before its backward), then again attached for the generator's loss."""
    G = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 5), nn.Tanh())
    D = nn.Sequential(nn.Linear(5, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    generate, critic = compile(G), compile(D)
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), 1e-2, betas=(0.5, 0.9)) for m in (G, D))
    results = []
    for s in range(STEPS):
        z, real = torch.randn(6, 3, generator=gen(s)), torch.randn(6, 5, generator=gen(10 + s))
        fake = generate(z)
        opt_d.zero_grad()
        loss_d = F.softplus(-critic(real)).mean() + F.softplus(critic(fake.detach())).mean()
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = F.softplus(-critic(fake)).mean()
        loss_g.backward()
        opt_g.step()
        results += [loss_d.detach(), loss_g.detach(), fake.detach()]
    return results + params_of(G, D)


def wgan_gp_n_critic(compile: Compile) -> list:
    """WGAN-GP over training steps: two critic steps per generator step, the penalty's input gradient of the
    interpolates by torch.func inside the compiled critic loss (its backward returns an expanded gradient)."""
    G = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 5))
    D = nn.Sequential(nn.Linear(5, 9), nn.SiLU(), nn.Linear(9, 1))
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), 1e-2, betas=(0.0, 0.9)) for m in (G, D))

    def critic_loss(real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        gx = grad(lambda x: D(x).sum())(eps * real + (1 - eps) * fake)
        return D(fake).mean() - D(real).mean() + 10 * ((gx.norm(dim=1) - 1) ** 2).mean()
    critic_loss_c, generate = compile(critic_loss), compile(G)
    results = []
    for s in range(STEPS):
        for k in range(2):
            seed = s * 7 + k
            z, real = torch.randn(6, 3, generator=gen(seed)), torch.randn(6, 5, generator=gen(100 + seed))
            opt_d.zero_grad()
            loss = critic_loss_c(real, generate(z).detach(), torch.rand(6, 1, generator=gen(200 + seed)))
            loss.backward()
            opt_d.step()
            results.append(loss.detach())
        opt_g.zero_grad()
        loss_g = -D(generate(torch.randn(6, 3, generator=gen(300 + s)))).mean()
        loss_g.backward()
        opt_g.step()
        results.append(loss_g.detach())
    return results + params_of(G, D)


def frozen_mid_run_whole_step(compile: Compile) -> list:
    """The whole step compiled (forward, backward, SGD with momentum, zero_grad to None); the first layer
    frozen by requires_grad_(False) at step 2 (Dynamo recompiles; the momentum buffers stay)."""
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    step_c = compile(step)
    results = []
    for s in range(4):
        if s == 2:
            net[0].requires_grad_(False)
        results.append(step_c(torch.randn(6, 5, generator=gen(s)), torch.randn(6, 2, generator=gen(9 + s))))
    return results + params_of(net)


class DANN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 8), nn.ReLU())
        self.classifier, self.domain = nn.Linear(8, 3), nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 1))

    def forward(self, x: torch.Tensor, lam: float) -> tuple:
        h = self.features(x)
        return self.classifier(h), self.domain(GradReverse.apply(h, lam))


def dann_reversal_schedule(compile: Compile) -> list:
    """DANN with the reversal weight 2 / (1 + exp(-10 p)) - 1, a new float every step (a graph input of the
    backward from its second value), source and target batches through the model in turn."""
    model = DANN()
    forward = compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    domains = torch.cat([torch.zeros(5, 1), torch.ones(5, 1)])
    results = []
    for s in range(STEPS):
        lam = 2 / (1 + math.exp(-10 * s / STEPS)) - 1
        xs, xt = torch.randn(5, 6, generator=gen(s)), torch.randn(5, 6, generator=gen(40 + s))
        ys = torch.randint(0, 3, (5,), generator=gen(20 + s))
        opt.zero_grad()
        cs, ds = forward(xs, lam)
        _, dt = forward(xt, lam)
        loss = F.cross_entropy(cs, ys) + F.binary_cross_entropy_with_logits(torch.cat([ds, dt]), domains)
        loss.backward()
        results += [loss.detach()] + [g.clone() for g in grads_of(model.features)]
        opt.step()
    return results + params_of(model)


def hook_scale_schedule(compile: Compile) -> list:
    """A hook registered inside the compiled forward scales an activation's gradient by a float argument that
    changes every call."""
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))

    def forward(x: torch.Tensor, scale: float) -> torch.Tensor:
        h = net[1](net[0](x))
        h.register_hook(lambda g: g * scale)
        return net[2](h)
    forward_c = compile(forward)
    results = []
    for s in range(STEPS):
        net.zero_grad()
        x = torch.randn(4, 5, generator=gen(s)).requires_grad_()
        out = forward_c(x, 0.5 + 0.25 * s)
        out.square().sum().backward()
        results += [out, x.grad] + [g.clone() for g in grads_of(net)]
    return results


class RoundSTE(torch.autograd.Function):
    """Uniform quantization to 2**bits - 1 levels of [0, 1], the gradient passed straight through inside it."""
    @staticmethod
    def forward(ctx, x: torch.Tensor, bits: int) -> torch.Tensor:
        levels = 2 ** bits - 1
        ctx.save_for_backward((x >= 0) & (x <= 1))
        return torch.round(x.clamp(0, 1) * levels) / levels

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:
        inside, = ctx.saved_tensors
        return g * inside, None


def bit_width_schedule(compile: Compile) -> list:
    """Quantization-aware training whose bit width drops during training (an int argument of the Function)."""
    net = nn.Sequential(nn.Linear(5, 8), nn.Sigmoid(), nn.Linear(8, 2))
    forward = compile(lambda x, bits: net[2](RoundSTE.apply(net[1](net[0](x)), bits)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    results = []
    for s, bits in enumerate((8, 8, 6, 4, 4, 3, 2)):
        opt.zero_grad()
        out = forward(torch.randn(6, 5, generator=gen(s)), bits)
        out.square().mean().backward()
        opt.step()
        results.append(out.detach())
    return results + params_of(net)


def straight_through_one_hot(compile: Compile) -> list:
    """hard + soft - soft.detach(): an argmax one-hot forward, the tempered softmax's gradient (temperature
    learned) backward."""
    lin = nn.Linear(5, 4)
    tau = nn.Parameter(torch.tensor(0.7))

    def forward(x: torch.Tensor) -> torch.Tensor:
        soft = (lin(x) / tau).softmax(-1)
        hard = F.one_hot(soft.argmax(-1), 4).to(soft.dtype)
        return hard + soft - soft.detach()
    out = compile(forward)(torch.randn(6, 5, generator=gen(1)))
    (out * torch.arange(4.0)).sum().backward()
    return [out, tau.grad] + grads_of(lin)


class NoGradStatistics(nn.Module):
    """A forward that takes statistics under no_grad (a count of positive units, a running peak and a count of
    samples in buffers) and scales its activation by them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.register_buffer("peak", torch.zeros(()))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            positive = (h > 0).sum(0)
            self.peak.copy_(torch.maximum(self.peak, h.abs().max()))
            self.seen += x.shape[0]
            w = positive.float() / x.shape[0] + self.seen.float() / 100
        return (h * w / self.peak).tanh()


def no_grad_statistics_in_forward(compile: Compile) -> list:
    model = NoGradStatistics()
    forward = compile(model)
    results = []
    for s in range(4):
        model.zero_grad()
        x = torch.randn(5 + s % 2, 5, generator=gen(s)).requires_grad_()
        out = forward(x)
        out.sum().backward()
        results += [out, x.grad, model.lin.weight.grad, model.peak.clone(), model.seen.clone()]
    return results


def views_of(tensors: list, flat: torch.Tensor) -> list:
    """Each tensor's values copied into consecutive slices of `flat`, returned as views of it."""
    views, start = [], 0
    for t in tensors:
        views.append(flat[start:start + t.numel()].view_as(t).copy_(t.detach()))
        start += t.numel()
    return views


def flat_buffers(compile: Compile) -> list:
    """Megatron's layout: parameters and their gradients are views of one flat buffer each, and so is an EMA
    of the weights. A compiled step clips the gradients' norm, runs AdamW and zeroes the gradients in place;
    a compiled _foreach_lerp_ moves the EMA."""
    net = nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.Linear(6, 3))
    params = list(net.parameters())
    size = sum(p.numel() for p in params)
    flat_params, flat_grads, flat_ema = torch.empty(size), torch.zeros(size), torch.empty(size)
    for p, view, g in zip(params, views_of(params, flat_params), views_of([torch.zeros_like(p) for p in params],
                                                                           flat_grads)):
        p.data, p.grad = view, g
    ema = views_of(params, flat_ema)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 0.3)
        opt.step()
        opt.zero_grad(set_to_none=False)

    def follow(decay: float) -> None:
        with torch.no_grad():
            torch._foreach_lerp_(ema, params, 1 - decay)
    forward, step_c, follow_c = compile(net), compile(step), compile(follow)
    results = []
    for s in range(STEPS):
        forward(torch.randn(4, 5, generator=gen(s))).square().mean().backward()
        results.append(flat_grads.clone())
        step_c()
        follow_c(0.8)
        results += [flat_params.clone(), flat_ema.clone()]
    assert all(p.grad.untyped_storage().data_ptr() == flat_grads.untyped_storage().data_ptr() for p in params)
    return results + [flat_grads.clone()]


X64 = dict(dtype=torch.float64)
# Single ops whose second derivatives (double backward) a gradient penalty takes: x (3, 4, 5, 6) or (7, 5), p a
# parameter of the given shape, both fp64.
SECOND_ORDER_OPS = {
    "max_pool2d": ((3, 4, 5, 6), (4,), lambda x, p: F.max_pool2d(x * p[:, None, None], 3, 2, padding=1)),
    "avg_pool2d": ((3, 4, 5, 6), (4,), lambda x, p: F.avg_pool2d(x * p[:, None, None], 3, 2, padding=1,
                                                                 count_include_pad=False).tanh()),
    "bilinear": ((3, 4, 5, 6), (4,), lambda x, p: F.interpolate((x * p[:, None, None]).tanh(), scale_factor=1.7,
                                                                mode="bilinear").square()),
    "grid_sample": ((3, 4, 5, 6), (4,), lambda x, p: F.grid_sample((x * p[:, None, None]).sin(),
                                                                   x[:, :2].permute(0, 2, 3, 1).tanh(),
                                                                   align_corners=False).square()),
    "conv_transpose2d": ((3, 4, 5, 6), (4, 3, 3, 3), lambda x, p: F.conv_transpose2d(x, p, stride=2, padding=1,
                                                                                    output_padding=1).sigmoid()),
    "batch_norm": ((3, 4, 5, 6), (4,), lambda x, p: F.batch_norm(x, None, None, p, -p, training=True).sin()),
    "group_norm": ((3, 4, 5, 6), (4,), lambda x, p: F.group_norm(x, 2, p, p.sin()).tanh()),
    "rms_norm": ((7, 5), (5,), lambda x, p: F.rms_norm(x, (5,), p).tanh()),
    "cross_entropy": ((7, 5), (5,), lambda x, p: F.cross_entropy(x * p, torch.arange(7) % 5, label_smoothing=0.1,
                                                                 reduction="none")),
    "kl_div": ((7, 5), (5,), lambda x, p: F.kl_div((x * p).log_softmax(1), x.softmax(1), reduction="batchmean")[None]),
    "cumprod": ((7, 5), (5,), lambda x, p: (x * p).cumprod(1)),
    "sort": ((7, 5), (5,), lambda x, p: (x * p).sort(1).values.square()),
    "special": ((7, 5), (5,), lambda x, p: torch.lgamma((x * p).abs() + 1) + torch.digamma((x * p).abs() + 1) +
                torch.erf(x * p) + torch.special.erfinv((x * p).tanh() * 0.9)),
    "pow_atan2": ((7, 5), (5,), lambda x, p: torch.atan2(x * p, x.roll(1, 1)) + (x * p).abs().pow(p.abs() + 0.5)),
}


def second_order_ops(compile: Compile) -> list:
    """For each op f: the gradient of |d<f(x, p), w>/dx|^2 + sum(sin(d<f, w>/dp)) + <f, w>, with respect to x
    and p, in fp64 (what a gradient penalty through f computes)."""
    results = []
    for i, (x_shape, p_shape, f) in enumerate(SECOND_ORDER_OPS.values()):
        x, p = torch.randn(x_shape, generator=gen(i), **X64), torch.randn(p_shape, generator=gen(50 + i), **X64)
        w = torch.randn(f(x, p).shape, generator=gen(100 + i), **X64)

        def first(x: torch.Tensor, p: torch.Tensor, f=f, w=w) -> torch.Tensor:
            return (f(x, p) * w).sum()

        def penalised(x: torch.Tensor, p: torch.Tensor, first=first) -> torch.Tensor:
            gx, gp = grad(first, argnums=(0, 1))(x, p)
            return gx.square().sum() + gp.sin().sum() + first(x, p)
        results += list(compile(grad(penalised, argnums=(0, 1)))(x, p))
    return results


IDIOMS = [hvp_and_hutchinson, hvp_reverse_over_reverse, dp_sgd_ragged_batches, r1_penalty,
          jacobian_and_curvature_penalties, pgd_inside_the_step, fgsm_around_a_compiled_model, maml_two_inner_steps,
          meta_sgd_ragged_support, vmapped_ensemble, byol, simsiam_whole_step, gradient_cache, checkpointed_blocks,
          micro_batches, backward_twice, gan_fake_reused, wgan_gp_n_critic, frozen_mid_run_whole_step,
          dann_reversal_schedule, hook_scale_schedule, bit_width_schedule, straight_through_one_hot,
          no_grad_statistics_in_forward, flat_buffers, second_order_ops]
# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = [hvp_reverse_over_reverse, r1_penalty, pgd_inside_the_step, byol, dann_reversal_schedule,
                  straight_through_one_hot, flat_buffers]
# loops of compiled calls that hold outputs across calls (two forwards before a backward, retain_graph, a fake
# fed to two critic calls, gradients that are views of a flat buffer)
REPLAYED = [hvp_and_hutchinson, fgsm_around_a_compiled_model, maml_two_inner_steps, byol, gradient_cache,
            micro_batches, backward_twice, gan_fake_reused, wgan_gp_n_critic, dann_reversal_schedule, flat_buffers]
TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
RUNS = [pytest.param(f, "c", id=f"{f.__name__}-c") for f in IDIOMS] + \
    [pytest.param(f, "triton", id=f"{f.__name__}-triton", marks=TRITON) for f in THROUGH_TRITON]


@pytest.mark.parametrize(("idiom", "codegen"), RUNS)
def test_higher_order_idiom_matches_eager(idiom: Callable[[Compile], list], codegen: str) -> None:
    matches_eager(idiom, codegen)


@pytest.mark.parametrize("idiom", REPLAYED, ids=lambda f: f.__name__)
def test_higher_order_loop_replayed_as_cuda_graphs_matches_eager(idiom: Callable[[Compile], list], monkeypatch) -> None:
    """As on a GPU: each graph replayed by the stand-in of a CUDA graph once captured (its outputs written
    over by the next replay), so an output still held when the graph runs again must have been noticed."""
    monkeypatch.setattr(graphs, "recorder_for", lambda device: SeededRerun())
    monkeypatch.setattr(graphs, "COUNTS", dict.fromkeys(graphs.COUNTS, 0))
    matches_eager(idiom, "c")
    assert graphs.COUNTS["replays"] > 0, f"nothing was replayed: {graphs.COUNTS}"
