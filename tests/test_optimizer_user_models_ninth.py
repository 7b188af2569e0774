"""A ninth set of user models (tests/user_models_ninth.py: PPO with Categorical and Normal policies, GAE by a
reversed loop and value clipping, SAC's tanh-squashed Normal, double DQN with a Polyak-averaged target network,
fake quantization by the ATen ops and by the straight-through estimator, LSQ, an FT-Transformer, TabNet-style
sparsemax and entmax-1.5 by sorting, DLRM with EmbeddingBags, factorization machines with DCN-v2 cross layers,
KL between distributions with a hard Gumbel-softmax and a focal loss with ignore_index, and losses in their
rarer options), compiled with the tfsn backend against eager PyTorch as tests/test_optimizer_user_models.py
compares its own (the same checks and tolerances): forward output, loss, input and parameter gradients and
buffers, in fp32, fp64 and under bf16 autocast, on the C target and a subset through the Triton kernels (on
this CPU under TRITON_INTERPRET=1); then SGD and AdamW training steps for two. Every compiled step must
generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_ninth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["ppo_categorical_gae", "double_dqn_polyak", "dlrm_embedding_bags", "lsq_quantized"]
# a learned temperature beside twin critics, and quantization steps that move with the weights
TRAINED = ["sac_tanh_normal", "lsq_quantized"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
