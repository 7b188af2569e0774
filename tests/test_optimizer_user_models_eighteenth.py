"""An eighteenth set of user models (tests/user_models_eighteenth.py: efficient-kan's Cox-de Boor B-splines and its
grid update by least squares, pykan's recursive bases and FastKAN's radial bases; xLSTM's sLSTM and mLSTM with exponential gating and the max stabilizer; aMLP's spatial
gating unit with tiny attention; nflows' rational-quadratic spline coupling, forward and inverse; soft-DTW (cell by cell, by
anti-diagonals, and with a hand-written backward), an HMM's forward algorithm, CTC's forward algorithm by hand,
Viterbi, Glow-TTS's monotonic alignment search and SuperGlue's log-domain Sinkhorn, unrolled in Python; NeuralSort;
and knowledge distillation from a no_grad teacher), compiled with the tfsn backend against eager PyTorch as
tests/test_optimizer_user_models.py compares its own (the same checks and tolerances): forward output, loss, input
and parameter gradients, buffers, in fp32, fp64 and under bf16 autocast, on the C target and a subset through the
Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD and AdamW training steps for a few. Every compiled
step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_eighteenth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["efficient_kan_cox_de_boor", "knowledge_distillation", "hmm_forward_algorithm"]
# a KAN whose grid is a frozen Parameter, a spline flow whose bin locations are written in place. Not the KAN that
# refits its grid: its least squares (13 samples, 8 bases, the outer ones on a few samples) amplify rounding, and
# after 3 SGD steps one spline weight of 120 ended 7e-5 apart (2e-4 relative) in one run of five.
TRAINED = ["fastkan_rbf_frozen_grid", "rq_spline_coupling"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
