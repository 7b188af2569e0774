"""A thirteenth set of user models (tests/user_models_thirteenth.py: margin softmax heads, ArcFace with and without
easy_margin, CosFace and SphereFace on acos of clamped cosines, insightface's in-place arccos_/cos_ margin; CLIP
with a clamped logit scale and SigLIP's sigmoid loss with a learned bias; batch-hard triplet mining; supervised
contrastive; MoCo v2 with a momentum encoder and a queue written by slicing; Barlow Twins and VICReg with their
off-diagonal views; DINO's centred teacher over multi-crop pairs; DINOv2's Sinkhorn-Knopp targets and KoLeo; the
center loss with an index_add_ update; the circle loss; proxy-anchor), compiled with the tfsn backend against eager
PyTorch as tests/test_optimizer_user_models.py compares its own (the same checks and tolerances): forward output,
loss, input and parameter gradients, in fp32, fp64 and under bf16 autocast, on the C target and a subset through
the Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD and AdamW training steps for two. Every
compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_thirteenth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["margin_heads_arcface_sphereface", "insightface_combined_margin", "batch_hard_triplet",
                  "supcon_two_views", "circle_loss", "proxy_anchor", "dinov2_sinkhorn_koleo"]
# buffers carried across steps: DINO's centre, the centre loss' index_add_ update. Not MoCo: on one repeated
# batch its queue fills with the batch's own keys, which become negatives, and the eager loss rises.
TRAINED = ["dino_multicrop_center", "center_loss_index_add"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
