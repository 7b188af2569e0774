"""A fifth set of user models (tests/user_models_fifth.py: LoRA, ConvNeXt, Swin, Perceiver, sinusoidal and
timestep embeddings, a VAE, MAE, a diffusion UNet, SegNet with mixup), compiled with the tfsn backend against
eager PyTorch as tests/test_optimizer_user_models.py compares its own (the same checks and tolerances):
forward output, loss, input and parameter gradients (and none for frozen parameters) and buffers, in fp32 and
fp64, on the C target and a subset through the Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD
and AdamW training steps for a few. Every compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_fifth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["lora", "vae"]
# frozen base weights (AdamW and SGD given parameters without a gradient) with trained adapters
TRAINED = ["lora"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
