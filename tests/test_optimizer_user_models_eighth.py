"""An eighth set of user models (tests/user_models_eighth.py: Mamba with a looped and a segment-sum selective
scan, minGRU's log-space scan, S4D and Hyena long convolutions by FFT, RWKV-4's WKV recurrence, causal linear
attention with GLU variants, RetNet retention with xPos, interleaved rotary with running extrema, segment
pooling by index_add and scatter_reduce, Mixture-of-Depths routing), compiled with the tfsn backend against
eager PyTorch as tests/test_optimizer_user_models.py compares its own (the same checks and tolerances):
forward output, loss, input and parameter gradients, in fp32, fp64 and under bf16 autocast, on the C target
and a subset through the Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD and AdamW training
steps for two. Every compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_eighth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["min_gru_log_space", "linear_attention_swiglu", "segment_pool"]
# a scan in log space whose gates move, and routing whose chosen tokens move with the weights
TRAINED = ["min_gru_log_space", "mixture_of_depths"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
