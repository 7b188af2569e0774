"""A tenth set of user models (tests/user_models_tenth.py: GCN, GAT with an edge softmax by scatter_reduce and
index_add_, GIN with a readout by scatter_reduce, DGCNN's EdgeConv over cdist + topk neighbours; a Conformer
block, a hand-written log-mel front end with SpecAugment masks, an RNN-T joint and lattice loss, an x-vector
TDNN with masked statistics pooling; a linear-chain CRF's loss, a pointer network, a biaffine parser; a
masked bidirectional RNN by flip and a packed batch unpacked by repeat_interleave), compiled with the tfsn
backend against eager PyTorch as tests/test_optimizer_user_models.py compares its own (the same checks and
tolerances): forward output, loss, input and parameter gradients, in fp32, fp64 and under bf16 autocast, on
the C target and a subset through the Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD and
AdamW training steps for two. Every compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_tenth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["gcn_symmetric_norm", "linear_chain_crf", "packed_attention"]
# an edge softmax whose attention moves with the weights, and a CRF's transitions
TRAINED = ["gat_edge_softmax", "linear_chain_crf"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
