"""An eleventh set of user models (tests/user_models_eleventh.py: GPT-NeoX's parallel residual with partial
rotary; Gemma 2's (1 + w) RMSNorm, sqrt(d) embedding scale, GeGLU, attention and final logit soft-capping,
local/global layers; a Qwen/Mistral block over packed documents with QK LayerNorm, qkv bias and a
sliding-window mask from triu/tril; DeepSeek's MLA with decoupled rope, a capacity-limited MoE with a shared
expert, aux and z losses, and a multi-token-prediction head; a muP GPT with a tied head and a z-loss; a varlen
packed batch with a Switch MoE by index dispatch and a chunked loss; DPO against a frozen reference), compiled
with the tfsn backend against eager PyTorch as tests/test_optimizer_user_models.py compares its own (the same
checks and tolerances): forward output, loss, input and parameter gradients, in fp32, fp64 and under bf16
autocast, on the C target and a subset through the Triton kernels (on this CPU under TRITON_INTERPRET=1); then
SGD and AdamW training steps, and clipped steps with AdamW parameter groups as LLM trainers configure them.
Every compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402

from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models import check_training  # noqa: E402
from tests.test_optimizer_user_models_more import (forward_and_gradient_tests, no_graph_left_to_aten,  # noqa: E402
                                                   training_steps_test)
from tests.test_optimizer_user_models_third import CLIP, OPTIMIZERS as CLIPPED_OPTIMIZERS  # noqa: E402
from tests.user_models_eleventh import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["neox_parallel_partial_rotary", "mup_gpt_z_loss", "switch_varlen_chunked_loss", "dpo_frozen_reference",
                  "master_weights_bf16_casts"]
# routing with a capacity whose drops move as the router trains; soft-capped logits; a frozen reference
TRAINED = ["deepseek_mla_moe_mtp", "gemma2_softcap_local_global", "dpo_frozen_reference", "gemma2_pure_bf16",
           "master_weights_bf16_casts"]
# a tied head in a parameter group of its own kind; the packed model's QK-norm vectors in the no-decay group
CLIPPED = ["mup_gpt_z_loss", "qwen_packed_qk_norm_window"]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)


@pytest.mark.parametrize("optimizer", ["adamw_groups"])
@pytest.mark.parametrize("case", [c for c in cases() if c.name in CLIPPED], ids=lambda c: c.name)
def test_clipped_grouped_training_steps_match_eager(case, optimizer):
    """clip_grad_norm_ then AdamW with decay on matrices only, compiled together: each step's loss."""
    no_graph_left_to_aten(lambda: check_training(case, optimizer, CLIPPED_OPTIMIZERS[optimizer], clip=CLIP))
