"""A twentieth set of user models (tests/user_models_twentieth.py: NAFNet with its LayerNorm2d autograd.Function
and PSNR loss, Restormer's transposed attention, ESRGAN's RRDB with relativistic average losses, AdaIN and
Johnson style transfer with Gram and total-variation losses, TimeSformer's divided space-time attention, a
SlowFast lateral connection with temporal shifts, RAFT's correlation pyramid, lookup and convex upsampling, MAML
by torch.func.grad, Reptile and prototypical networks), compiled with the tfsn backend against eager PyTorch as
tests/test_optimizer_user_models.py compares its own (the same checks and tolerances): forward output, loss, input
and parameter gradients, buffers, in fp32, fp64 and under bf16 autocast, on the C target and a subset through the
Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD and AdamW training steps of Reptile. Every compiled
step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_twentieth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["prototypical_network", "maml_first_order", "slowfast_lateral_tsm"]
# meta weights, a buffer, interpolated in the step
TRAINED = ["reptile_meta_interpolation"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
