"""A seventeenth set of user models (tests/user_models_seventeenth.py: the Lovasz-softmax and Lovasz hinge losses
by sort, gather of the permutation and cumsum; Dice, Tversky, focal-Tversky and a boundary-weighted cross-entropy;
segmentation_models_pytorch's Dice, Jaccard and focal losses with MMSeg's OHEM sampler; PSPNet's pyramid pooling
and HRNet's multi-resolution fusion; CapsNet's dynamic routing and margin loss in two reference forms; FiLM;
CondInst's dynamic convolutions by grouped conv and bmm; CutMix and Mixup in the step; a product-key memory by
topk and embedding_bag), compiled with the tfsn backend against eager PyTorch as tests/test_optimizer_user_models.py
compares its own (the same checks and tolerances): forward output, loss, input and parameter gradients, buffers,
in fp32, fp64 and under bf16 autocast, on the C target and a subset through the Triton kernels (on this CPU under
TRITON_INTERPRET=1); then SGD and AdamW training steps for two. Every compiled step must generate kernels and leave
no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_seventeenth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["lovasz_softmax_hinge", "capsnet_dynamic_routing", "product_key_memory"]
# BatchNorm buffers, routing and a memory trained through embedding_bag
TRAINED = ["capsnet_dynamic_routing", "product_key_memory"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
