"""tfsn.jax.optimize computes what jax.jit computes: losses, gradients and training steps, on models
written in plain jax.numpy, with the generated kernels running as XLA FFI custom calls.

Tolerances (fp32), as for torch graphs: generated kernels sum in another order than XLA, so values
match to rtol=1e-4 and atol=1e-5 times the largest magnitude of the expected array.
"""
from __future__ import annotations

import math
import re

import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed: pip install 'tfsn[jax]'")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import tfsn  # noqa: E402
from optimizer.frontends.jax import from_jaxpr, view_strides  # noqa: E402
from optimizer.ir import Kind  # noqa: E402
from optimizer.schedule import Schedule  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path_factory.getbasetemp() / "tfsn-cache"))


def assert_tree_close(actual, expected, what: str) -> None:
    flat_a, tree_a = jax.tree_util.tree_flatten(actual)
    flat_e, tree_e = jax.tree_util.tree_flatten(expected)
    assert tree_a == tree_e, f"{what}: result structure {tree_a} != {tree_e}"
    for i, (a, e) in enumerate(zip(flat_a, flat_e)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}[{i}]: {a.shape} {a.dtype} != {e.shape} {e.dtype}"
        scale = float(np.max(np.abs(e))) if e.size else 1.0
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL * max(scale, 1e-3), err_msg=f"{what}[{i}]")


def generated(step) -> dict:
    """What tfsn compiled for the step's one signature (failing the test where it fell back to jax.jit)."""
    (stats,) = step.stats.values()
    assert "fallback" not in stats, f"tfsn fell back to jax.jit: {stats['fallback']}"
    return stats


def normal(key, shape, scale=1.0):
    return scale * jax.random.normal(key, shape, jnp.float32)


# ---- models, in plain jax.numpy ----

def mlp_params(key, sizes=(13, 29, 5)):
    keys = jax.random.split(key, 2 * len(sizes))
    return [{"w": normal(keys[2 * i], (a, b), 1 / math.sqrt(a)), "b": normal(keys[2 * i + 1], (b,), 0.1)}
            for i, (a, b) in enumerate(zip(sizes, sizes[1:]))]


def mlp_loss(params, x, labels):
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.gelu(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def layer_norm(x, g, b, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * g + b


def block_params(key, d=24, hidden=40):
    k = jax.random.split(key, 6)
    return {"ln1": (jnp.ones(d), jnp.zeros(d)), "ln2": (jnp.ones(d), jnp.zeros(d)),
            "qkv": normal(k[0], (d, 3 * d), d ** -0.5), "proj": normal(k[1], (d, d), d ** -0.5),
            "up": normal(k[2], (d, hidden), d ** -0.5), "up_b": normal(k[3], (hidden,), 0.1),
            "down": normal(k[4], (hidden, d), hidden ** -0.5)}


def block(p, x, heads=3):
    """A pre-norm transformer block: causal multi-head self-attention, then a GELU MLP."""
    B, T, D = x.shape
    h = layer_norm(x, *p["ln1"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    split = lambda t: t.reshape(B, T, heads, D // heads).transpose(0, 2, 1, 3)   # noqa: E731
    q, k, v = split(q), split(k), split(v)
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(D // heads)
    causal = jnp.tril(jnp.ones((T, T), bool))
    att = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    y = jnp.einsum("bhts,bhsd->bhtd", att, v).transpose(0, 2, 1, 3).reshape(B, T, D)
    x = x + y @ p["proj"]
    h = layer_norm(x, *p["ln2"])
    return x + jax.nn.gelu(h @ p["up"] + p["up_b"]) @ p["down"]


def block_loss(p, x, target):
    return jnp.mean(jnp.square(block(p, x) - target))


def conv_params(key, channels=(3, 5, 7), classes=6):
    keys = jax.random.split(key, 2 * len(channels))
    convs = [{"w": normal(keys[2 * i], (3, 3, a, b), (9 * a) ** -0.5), "b": normal(keys[2 * i + 1], (b,), 0.1)}
             for i, (a, b) in enumerate(zip(channels, channels[1:]))]
    return {"convs": convs, "head": normal(keys[-1], (channels[-1], classes), channels[-1] ** -0.5)}


def convnet_loss(p, images, labels):
    """A small NHWC convnet: 3x3 convolutions (the second strided) with bias and ReLU, global mean
    pooling and a linear head, under softmax cross-entropy."""
    h = images
    for i, c in enumerate(p["convs"]):
        h = jax.lax.conv_general_dilated(h, c["w"], (1 + i, 1 + i), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jax.nn.relu(h + c["b"])
    logits = jnp.mean(h, axis=(1, 2)) @ p["head"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def custom_calls(step, *args) -> int:
    """The generated kernels' custom calls in the XLA program that `step` runs, after XLA's passes."""
    return step.lower(*args).compile().as_text().count('custom_call_target="tfsn_')


def adam_step(loss_fn, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    """One hand-written Adam step of loss_fn: what a training loop jits."""
    def step(params, state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        t = state["t"] + 1
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        params = jax.tree_util.tree_map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, m, v)
        return params, {"t": t, "m": m, "v": v}, loss
    return step


def adam_state(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"t": jnp.zeros((), jnp.float32), "m": zeros, "v": zeros}


# ---- tests ----

def test_mlp_loss_and_gradients_match_jit():
    key = jax.random.PRNGKey(0)
    params = mlp_params(key)
    x = normal(jax.random.PRNGKey(1), (7, 13))
    labels = jnp.array([0, 4, 2, 1, 3, 4, 0], jnp.int32)
    fn = jax.value_and_grad(mlp_loss)
    step = tfsn.jax.optimize(fn)           # the default path: the search picks plan and schedules
    threads = torch.get_num_threads()
    assert_tree_close(step(params, x, labels), jax.jit(fn)(params, x, labels), "mlp value_and_grad")
    assert torch.get_num_threads() == threads     # the kernels' one thread was the XLA call's only
    stats = generated(step)
    assert stats["kernels"] >= 5 and stats["externs"] >= 2      # gather and scatter-add stay in XLA
    # the fastest of tfsn's GEMMs and XLA's dots, each with kernels on one thread and on torch's count
    assert f"{stats['matmuls']}/{stats['threads']}" in stats["measured_ms"]
    assert stats["measured_ms"][f"{stats['matmuls']}/{stats['threads']}"] == min(stats["measured_ms"].values())


def test_matmuls_left_to_xla_dots():
    """matmuls="xla" (what the step's race picks where XLA's dot is faster): the products are XLA
    dots, everything around them generated kernels, with the same results."""
    params = block_params(jax.random.PRNGKey(20))
    x, target = normal(jax.random.PRNGKey(21), (2, 5, 24)), normal(jax.random.PRNGKey(22), (2, 5, 24))
    fn = jax.value_and_grad(block_loss)
    step = tfsn.jax.optimize(fn, schedule=Schedule(), matmuls="xla")
    assert_tree_close(step(params, x, target), jax.jit(fn)(params, x, target), "block with XLA dots")
    stats = generated(step)
    assert stats["matmuls"] == "xla" and stats["kernels"] >= 10
    hlo = step.lower(params, x, target).compile().as_text()
    assert hlo.count(" dot(") >= 10 and custom_calls(step, params, x, target) == stats["kernels"]
    with pytest.raises(ValueError, match="matmuls='blas'"):
        tfsn.jax.optimize(fn, matmuls="blas")
    with pytest.raises(ValueError, match="threads=0"):
        tfsn.jax.optimize(fn, threads=0)


def test_transformer_block_forward_and_gradients_match_jit():
    params = block_params(jax.random.PRNGKey(2))
    x = normal(jax.random.PRNGKey(3), (2, 9, 24))
    target = normal(jax.random.PRNGKey(4), (2, 9, 24))
    fn = jax.value_and_grad(block_loss, argnums=(0, 1))
    step = tfsn.jax.optimize(fn, schedule=Schedule())
    assert_tree_close(step(params, x, target), jax.jit(fn)(params, x, target), "block value_and_grad")
    forward = tfsn.jax.optimize(block, schedule=Schedule())
    assert_tree_close(forward(params, x), jax.jit(block)(params, x), "block forward")
    assert generated(step)["kernels"] >= 10


def test_convnet_forward_and_gradients_match_jit():
    """Convolutions and their gradients stay XLA ops; bias, ReLU and its mask, pooling, the head and
    the loss run as generated kernels inside the same XLA program."""
    params = conv_params(jax.random.PRNGKey(14))
    images = normal(jax.random.PRNGKey(15), (3, 11, 13, 3))          # odd batch and image sizes
    labels = jnp.array([5, 0, 2], jnp.int32)
    fn = jax.value_and_grad(convnet_loss)
    step = tfsn.jax.optimize(fn, schedule=Schedule())
    assert_tree_close(step(params, images, labels), jax.jit(fn)(params, images, labels), "convnet value_and_grad")
    stats = generated(step)
    graph = from_jaxpr(jax.make_jaxpr(fn)(params, images, labels))
    assert sum(n.op == "jax.conv_general_dilated" for n in graph.nodes) >= 5     # 2 forward, 3 backward
    assert stats["kernels"] >= 6
    assert custom_calls(step, params, images, labels) == stats["kernels"]


@pytest.mark.parametrize("model", ["mlp", "block", "convnet"])
def test_three_adam_steps_match_jit(model):
    if model == "mlp":
        params, loss = mlp_params(jax.random.PRNGKey(5)), mlp_loss
        batch = (normal(jax.random.PRNGKey(6), (7, 13)), jnp.array([1, 0, 3, 2, 4, 4, 1], jnp.int32))
    elif model == "convnet":
        params, loss = conv_params(jax.random.PRNGKey(16)), convnet_loss
        batch = (normal(jax.random.PRNGKey(17), (5, 9, 7, 3)), jnp.array([1, 0, 3, 5, 4], jnp.int32))
    else:
        params, loss = block_params(jax.random.PRNGKey(7)), block_loss
        batch = (normal(jax.random.PRNGKey(8), (2, 9, 24)), normal(jax.random.PRNGKey(9), (2, 9, 24)))
    step = adam_step(loss)
    ours, theirs = tfsn.jax.optimize(step, schedule=Schedule()), jax.jit(step)
    p_ours, s_ours = params, adam_state(params)
    p_ref, s_ref = params, adam_state(params)
    for i in range(3):
        p_ours, s_ours, l_ours = ours(p_ours, s_ours, *batch)
        p_ref, s_ref, l_ref = theirs(p_ref, s_ref, *batch)
        assert_tree_close((p_ours, s_ours, l_ours), (p_ref, s_ref, l_ref), f"{model} Adam step {i + 1}")
    assert float(l_ours) < float(loss(params, *batch))      # it trained
    assert len(ours.stats) == 1                              # one compile for the three steps
    assert custom_calls(ours, p_ours, s_ours, *batch) == generated(ours)["kernels"] > 0


def test_unsupported_primitives_run_in_xla():
    """Primitives the IR does not cover (cumsum, sort, argmax, rem, a loop, bf16 math) run as XLA
    runs them, between generated kernels, with the same results."""
    def fn(x, w):
        h = jnp.tanh(x @ w)
        c = jnp.cumsum(h, axis=1)
        s = jnp.sort(c, axis=0)
        i = jnp.argmax(s, axis=1)
        r = jnp.remainder(s, 0.7)
        loop = jax.lax.fori_loop(0, 3, lambda k, a: a * 0.5 + jnp.exp(-a), r)
        half = (loop.astype(jnp.bfloat16) * 3).astype(jnp.float32)
        return jnp.sum(half * 2.0, axis=1) + i, jax.grad(lambda w: jnp.sum(jnp.cumsum(jnp.tanh(x @ w), 0)))(w)

    x, w = normal(jax.random.PRNGKey(10), (6, 5)), normal(jax.random.PRNGKey(11), (5, 11))
    step = tfsn.jax.optimize(fn, schedule=Schedule())
    assert_tree_close(step(x, w), jax.jit(fn)(x, w), "unsupported primitives")
    stats = generated(step)
    assert stats["kernels"] >= 2 and stats["externs"] >= 5
    graph = from_jaxpr(jax.make_jaxpr(fn)(x, w))
    ops = {n.op for n in graph.nodes if n.kind == Kind.EXTERN}
    assert {"jax.cumsum", "jax.sort", "jax.argmax", "jax.rem", "jax.scan"} <= ops


def test_keyword_static_and_donated_arguments():
    def fn(x, scale, *, bias, square):
        y = jnp.tanh(x) * scale + bias
        return {"y": y * y if square else y}

    x, bias = normal(jax.random.PRNGKey(12), (4, 3)), normal(jax.random.PRNGKey(13), (3,))
    ours = tfsn.jax.optimize(fn, static_argnames="square", schedule=Schedule())
    expected = jax.jit(fn, static_argnames="square")(x, 2.0, bias=bias, square=True)
    assert_tree_close(ours(x, 2.0, bias=bias, square=True), expected, "keywords")
    static = tfsn.jax.optimize(lambda x, n: jnp.sum(x ** n, axis=0), static_argnums=1, donate_argnums=0,
                               schedule=Schedule())
    assert_tree_close(static(jnp.arange(6.0).reshape(2, 3), 3), jnp.array([27.0, 65.0, 133.0]), "static")


@pytest.mark.parametrize("schedule", [Schedule(), None], ids=["default", "searched"])
def test_donated_parameters_and_moments_are_updated_in_their_buffers(schedule):
    """With the parameters and Adam's state donated, the kernels that compute their new values write
    them over the donated buffers (the custom calls alias them, so XLA allocates nothing for them),
    and the three steps still compute what jax.jit's do."""
    params = block_params(jax.random.PRNGKey(20))
    batch = (normal(jax.random.PRNGKey(21), (2, 9, 24)), normal(jax.random.PRNGKey(22), (2, 9, 24)))
    step = adam_step(block_loss)
    ours = tfsn.jax.optimize(step, donate_argnums=(0, 1), schedule=schedule)
    theirs = jax.jit(step)
    copy = lambda tree: jax.tree_util.tree_map(jnp.array, tree)      # noqa: E731  (donated buffers are consumed)
    p_ours, s_ours = copy(params), copy(adam_state(params))           # m and v: one buffer each
    p_ref, s_ref = params, adam_state(params)
    matrices = sum(leaf.ndim == 2 for leaf in jax.tree_util.tree_leaves(params))
    hlo = ours.lower(p_ours, s_ours, *batch).compile().as_text()
    for i in range(3):
        p_ours, s_ours, l_ours = ours(p_ours, s_ours, *batch)
        p_ref, s_ref, l_ref = theirs(p_ref, s_ref, *batch)
        assert_tree_close((p_ours, s_ours, l_ours), (p_ref, s_ref, l_ref), f"donated Adam step {i + 1}")
    written = generated(ours)["written_in_place"]
    # both moments of each weight matrix, updated in the epilogue of the weight gradient's product (the
    # weights themselves are read by the forward too; the vectors' updates follow a reduction)
    assert written >= 2 * matrices
    aliased = re.findall(r"output_to_operand_aliasing=\{(.*?)\}\s*[,\n]", hlo)
    assert sum(pairs.count("(") for pairs in aliased) == written


def test_a_donated_operand_of_a_product_is_not_written_over():
    """w + x @ w with w donated: the epilogue could write each block of rows over w, but the product of a
    later block still reads all of w, so the kernel must not write in place (loopnest refuses it)."""
    w, x = normal(jax.random.PRNGKey(23), (32, 32)), normal(jax.random.PRNGKey(24), (32, 32))
    fn = lambda w, x: w + x @ w      # noqa: E731
    expected = jax.jit(fn)(w, x)
    ours = tfsn.jax.optimize(fn, donate_argnums=0, schedule=Schedule(gemm_block_rows=8))
    assert_tree_close(ours(jnp.array(w), x), expected, "w + x @ w")
    assert generated(ours)["written_in_place"] == 0


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "uint32"])
def test_a_float_converted_to_an_integer_type_is_what_xla_makes_of_it(dtype):
    """XLA clamps an out-of-range float to the integer type's range and makes NaN 0 (C would wrap, as
    torch does, or leave it undefined): such a conversion stays XLA's, the arithmetic around it tfsn's."""
    x = jnp.array([300.0, -300.0, 1e10, jnp.nan, 2.7, -2.7, 70000.0], jnp.float32)
    fn = lambda x: (x * 1.5 - 1.0).astype(dtype) + 1      # noqa: E731
    np.testing.assert_array_equal(tfsn.jax.optimize(fn, schedule=Schedule())(x), jax.jit(fn)(x))


def test_static_arguments_by_negative_position_and_by_name_either_way():
    """As jax.jit reads them: static_argnums=-1 is the last positional parameter; a static argument is
    static whether it is passed by position or by name."""
    x = jnp.ones(2)
    powers = lambda x, n: sum(x ** i for i in range(n))      # noqa: E731  (n must be a Python int)
    np.testing.assert_allclose(tfsn.jax.optimize(powers, static_argnums=-1, schedule=Schedule())(x, 3), [3.0, 3.0])
    np.testing.assert_allclose(tfsn.jax.optimize(powers, static_argnums=1, schedule=Schedule())(x, n=3), [3.0, 3.0])
    by_name = tfsn.jax.optimize(lambda x, act: x * 2 if act == "double" else x, static_argnames="act",
                                schedule=Schedule())
    np.testing.assert_allclose(by_name(x, "double"), [2.0, 2.0])
    np.testing.assert_allclose(by_name(x, act="same"), [1.0, 1.0])


@pytest.mark.parametrize("key_kind", ["raw", "typed", "made inside"])
def test_a_dropout_step_keeps_its_kernels_and_its_random_bits(key_kind):
    """A step drawing dropout masks with jax.random (an old-style uint32 key, a typed key, or a key made
    in the step): the keys stay XLA's, the rest is generated, and the masks are jax.jit's bit for bit."""
    def loss(w, x, key):
        h = jnp.tanh(x @ w)
        keep = jax.random.bernoulli(key, 0.8, h.shape)
        return jnp.mean(jnp.where(keep, h / 0.8, 0.0) ** 2)

    w, x = normal(jax.random.PRNGKey(25), (16, 24)), normal(jax.random.PRNGKey(26), (8, 16))
    if key_kind == "made inside":
        fn, args = jax.value_and_grad(lambda w, x: loss(w, x, jax.random.key(7))), (w, x)
    else:
        key = jax.random.PRNGKey(3) if key_kind == "raw" else jax.random.key(3)
        fn, args = jax.value_and_grad(loss), (w, x, key)
    ours = tfsn.jax.optimize(fn, schedule=Schedule())
    assert_tree_close(ours(*args), jax.jit(fn)(*args), f"dropout step, {key_kind} key")
    assert generated(ours)["kernels"] >= 2


def test_weight_gradient_is_written_in_the_weights_order():
    """JAX's gradient of x @ w for w is dot_general(g, x) transposed: tfsn computes it as x^T g, so
    the Adam update reads it row by row, not through a transposed view (one element per row)."""
    x, w = normal(jax.random.PRNGKey(18), (7, 5)), normal(jax.random.PRNGKey(19), (5, 3))
    fn = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    graph = from_jaxpr(jax.make_jaxpr(fn)(w, x))
    products = [n for n in graph.nodes if n.kind == Kind.MATMUL]
    assert [n.type.shape for n in products] == [(7, 3), (5, 3)]
    assert not any(n.op == "aten.permute.default" and graph.nodes[n.args[0].index].kind == Kind.MATMUL
                   for n in graph.nodes)
    assert_tree_close(tfsn.jax.optimize(fn, schedule=Schedule())(w, x), jax.jit(fn)(w, x), "weight gradient")


@pytest.mark.parametrize("shape,strides,new,expected", [
    ((4, 6), (6, 1), (24,), (1,)), ((4, 6), (6, 1), (2, 2, 3, 2), (12, 6, 2, 1)),
    ((6, 4), (1, 6), (24,), None),                        # a transposed matrix flattened: no strides do it
    ((6, 4), (1, 6), (6, 2, 2), (1, 12, 6)), ((3, 1, 5), (5, 5, 1), (3, 5, 1), (5, 1, 1)),
])
def test_view_strides(shape, strides, new, expected):
    assert view_strides(shape, strides, new) == expected


JAX_STEP_FILE = '''
import jax
import jax.numpy as jnp


def loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value


def build():
    return step


def inputs():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k[0], (24, 40)), "b1": jnp.zeros(40), "w2": jax.random.normal(k[1], (40, 3))}
    return params, jax.random.normal(k[2], (16, 24)), jax.random.normal(k[3], (16, 3))


def not_a_model():
    return 42
'''


@pytest.mark.parametrize("hardware", ["cpu", "h100"])
def test_tfsn_optimize_takes_a_jax_step(tmp_path, hardware):
    """`tfsn optimize --model FILE:FN` where FN returns a JAX step function: the step's one jaxpr is
    searched (on this CPU with timing, or predicted for a GPU) and reported as a torch model's is."""
    import json

    import typer
    from typer.testing import CliRunner

    from orchestrator.cli.optimizer import register

    app = typer.Typer()
    register(app)
    path = tmp_path / "jax_step.py"
    path.write_text(JAX_STEP_FILE)
    result = CliRunner().invoke(app, ["optimize", "--model", f"{path}:build", "--inputs", f"{path}:inputs",
                                      "--hardware", hardware, "--top-k", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert "graph 0 (step):" in result.output and "graph 1" not in result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert data["graphs"] == 1 and data["scored"] > 0 and data["predicted_step_s"] > 0
    assert data["measured_here"] == (hardware == "cpu")
    assert "gemm" in data["chosen"][0]             # the products were planned, not left aside

    bad = CliRunner().invoke(app, ["optimize", "--model", f"{path}:not_a_model", "--inputs", f"{path}:inputs"])
    assert bad.exit_code != 0 and "returned a int" in bad.output and "Traceback" not in bad.output
