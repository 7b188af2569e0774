"""A fifteenth set of user models (tests/user_models_fifteenth.py: a VQ-VAE with an EMA codebook, Laplace
smoothing and dead-code reset; residual VQ; Finite Scalar Quantization with // and torch.div's rounding modes on
negative floats and ints; lookup-free quantization with entropy losses; rectified flow with label dropout; EDM's
preconditioning; a cosine DDPM schedule built in the step with v-prediction and min-SNR weighting; consistency
training against an EMA target; a beta-VAE with free bits; GAN hinge and non-saturating losses), compiled with
the tfsn backend against eager PyTorch as tests/test_optimizer_user_models.py compares its own (the same checks and
tolerances): forward output, loss, input and parameter gradients, buffers, in fp32, fp64 and under bf16 autocast,
on the C target and a subset through the Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD and
AdamW training steps for two. Every compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_fifteenth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["fsq_div_modes", "lookup_free_quantizer", "edm_preconditioning", "vqvae_ema_codebook"]
# codebook buffers updated in the step, a target lerp_ed in the step
TRAINED = ["vqvae_ema_codebook", "consistency_ema_update_in_step"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
