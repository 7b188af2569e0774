"""A sixteenth set of user models (tests/user_models_sixteenth.py: SchNet with a Gaussian basis, the cosine cutoff and
continuous-filter convolutions scattered by index_add_ and scatter_add_; EGNN with coordinate updates over a graph
holding zero-length self pairs; PaiNN's vector features and gated equivariant blocks; DimeNet-lite's bond angles by
acos and atan2 with Legendre and Bessel bases; a Lennard-Jones potential; force training, forces = -dE/dpos by
torch.func.grad inside the compiled step with the loss on energies and forces; a Hamiltonian NN with a leapfrog
integrator unrolled; a physics-informed DeepONet), compiled with the tfsn backend against eager PyTorch as
tests/test_optimizer_user_models.py compares its own (the same checks and tolerances): forward output, loss,
input and parameter gradients, buffers, in fp32, fp64 and under bf16 autocast, on the C target and a subset
through the Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD and AdamW training steps for a force
model, and an HNN's trained with its graphs replayed as CUDA graphs. Every compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import logging
import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


import pytest  # noqa: E402

from optimizer import graphs  # noqa: E402
from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_training_loops import SeededRerun  # noqa: E402
from tests.test_optimizer_user_models import check_training  # noqa: E402
from tests.test_optimizer_user_models_more import (forward_and_gradient_tests, no_graph_left_to_aten,  # noqa: E402
                                                   training_steps_test)
from tests.user_models_sixteenth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["egnn_self_pairs", "lennard_jones_forces"]
# the energy and force loss's double backward trained (HNN's below, its graphs replayed)
TRAINED = ["lennard_jones_forces"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)


@pytest.mark.parametrize("case", [c for c in cases() if c.name == "hamiltonian_nn_leapfrog"], ids=lambda c: c.name)
def test_force_training_replayed_as_cuda_graphs_matches_eager(case, monkeypatch, caplog):
    """As on a GPU: each graph replayed by the stand-in of a CUDA graph once captured. The backward of a loss on a
    gradient taken inside the step reads an expanded tensor (ones of E.sum()'s gradient, a stride-0 dim) that its
    forward saved; every graph must be captured (the stand-in once failed on that input, so the backward ran
    unrecorded and its replays went untested)."""
    monkeypatch.setattr(graphs, "recorder_for", lambda device: SeededRerun())
    monkeypatch.setattr(graphs, "COUNTS", dict.fromkeys(graphs.COUNTS, 0))
    with caplog.at_level(logging.WARNING, logger="tfsn.optimizer"):
        no_graph_left_to_aten(lambda: check_training(case, "sgd"))
    assert graphs.COUNTS["replays"] > 0, graphs.COUNTS
    failed = [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()]
    assert not failed, failed
