"""More models written the way users write them (tests/user_models_more.py), compiled with the tfsn
backend against eager PyTorch as tests/test_optimizer_user_models.py compares its own (the same checks
and tolerances): forward output, loss, input and parameter gradients and buffers, in fp32, fp64 and
under bf16 autocast, on the C target; a subset through the Triton kernels (on this CPU under
TRITON_INTERPRET=1); SGD training steps for a few. Every compiled step must generate kernels and leave
no graph to ATen: a model that fell back would test nothing."""
from __future__ import annotations

import os
from typing import Callable

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402

from optimizer import backend  # noqa: E402
from optimizer.backend import make_backend  # noqa: E402
from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models import check_forward_and_gradients, check_training  # noqa: E402
from tests.user_models_more import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["unet_bilinear_bf16", "instance_group_norm", "clip", "hand_lstm_fp64", "ops_zoo", "integer_features"]
TRAINED = ["in_place_channels_last", "clip", "hand_lstm"]   # BatchNorm buffers, a learned temperature, a loop


def no_graph_left_to_aten(check) -> None:
    """Run `check`; fail if any graph it compiled ran as ATen (generator failure or unsupported graph)."""
    before = backend.STATS["aten_graphs"]
    check()
    assert backend.STATS["aten_graphs"] == before, "a graph ran as ATen: see the log for why"


def forward_and_gradient_tests(suite: list, through_triton: list[str]) -> tuple[Callable, Callable]:
    """A suite's two tests of forward outputs and gradients against eager: every case on the C target, and
    those named in `through_triton` through the Triton kernels; bound to test_* names, pytest runs them."""
    @pytest.mark.parametrize("case", suite, ids=lambda c: c.name)
    def test_forward_and_gradients_match_eager(case):
        no_graph_left_to_aten(lambda: check_forward_and_gradients(case, make_backend()))

    @pytest.mark.parametrize("case", [c for c in suite if c.name in through_triton], ids=lambda c: c.name)
    def test_through_triton_forward_and_gradients_match_eager(case):
        pytest.importorskip("triton")
        no_graph_left_to_aten(lambda: check_forward_and_gradients(case, make_backend(codegen="triton")))
    return test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager


def training_steps_test(suite: list, trained: list[str]) -> Callable:
    """A suite's test of training steps against eager, with each of OPTIMIZERS, for the cases named in `trained`;
    bound to a test_* name, pytest runs it."""
    from tests.test_optimizer_user_models import OPTIMIZERS

    @pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
    @pytest.mark.parametrize("case", [c for c in suite if c.name in trained], ids=lambda c: c.name)
    def test_training_steps_match_eager(case, optimizer):
        no_graph_left_to_aten(lambda: check_training(case, optimizer))
    return test_training_steps_match_eager


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)


@pytest.mark.parametrize("case", [c for c in cases() if c.name in TRAINED], ids=lambda c: c.name)
def test_sgd_training_steps_match_eager(case):
    no_graph_left_to_aten(lambda: check_training(case, "sgd"))
