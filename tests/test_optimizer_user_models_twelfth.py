"""A twelfth set of user models (tests/user_models_twelfth.py: DeepAR with negative-binomial and Student-t
likelihoods, torch.distributions heads, Gaussian NLL with full=True, pinball and Tweedie losses with a learned
power; Cox's partial likelihood by logcumsumexp, a Weibull AFT with Kumaraswamy severities, CORAL ordinal
regression, discrete-time survival by cumprod; a head of torch.special functions; PatchTST with RevIN, N-BEATS'
polynomial and Fourier bases, a weight-normed causal TCN, TFT's variable selection; targets with NaNs by nanmean
and nansum; clamp with tensor bounds, copysign, frexp/ldexp, floor_divide and remainder of negatives), compiled
with the tfsn backend against eager PyTorch as tests/test_optimizer_user_models.py compares its own (the same
checks and tolerances): forward output, loss, input and parameter gradients, in fp32, fp64 and under bf16
autocast, on the C target and a subset through the Triton kernels (on this CPU under TRITON_INTERPRET=1); then
SGD and AdamW training steps for two. Every compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_twelfth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["distribution_heads", "cox_partial_likelihood", "special_function_head", "numerics_zoo",
                  "regression_losses_tweedie", "missing_targets_nan", "weibull_aft_kumaraswamy",
                  "weibull_aft_kumaraswamy_fp64"]
# a learned Tweedie power, and a likelihood through lgamma
TRAINED = ["regression_losses_tweedie", "deepar_nb_student_t"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
