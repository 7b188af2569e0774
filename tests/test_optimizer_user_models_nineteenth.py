"""A nineteenth set of user models (tests/user_models_nineteenth.py: Whisper's log-mel spectrogram by torch.stft with
pre-emphasis and per-utterance CMVN; torchaudio's MFCC by hand with SpecAugment masks drawn in the step;
parallel_wavegan's multi-resolution STFT loss; HiFi-GAN's multi-period discriminator with feature-matching and least-
squares losses; wav2vec 2.0's Gumbel codebook quantizer with its diversity and contrastive losses; ECAPA-TDNN's
attentive statistics pooling under an additive angular margin; DeepFM; DCN-v2's low-rank mixture of cross experts;
DIN's target attention with Dice; a two-tower retrieval model with the logQ correction; BPR matrix factorization;
ListNet, RankNet and LambdaRank), compiled with the tfsn backend against eager PyTorch as
tests/test_optimizer_user_models.py compares its own (the same checks and tolerances): forward output, loss, input
and parameter gradients, buffers, in fp32, fp64, under bf16 autocast and cast to bf16, on the C target and a subset
through the Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD and AdamW training steps for a few. Every
compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors


from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, training_steps_test  # noqa: E402
from tests.user_models_nineteenth import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["deepfm", "bpr_matrix_factorization", "listnet_ranknet_lambdarank"]
# Dice's and DeepFM's BatchNorm running statistics written in the step; a codebook trained through a hard Gumbel
# straight-through estimator drawing its noise in the step; SpecAugment masks drawn in the step before a GRU
TRAINED = ["din_dice_target_attention", "deepfm", "wav2vec2_gumbel_softmax_in_step", "mfcc_specaugment_in_step"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)
