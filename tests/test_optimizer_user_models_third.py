"""A third set of user models (tests/user_models_third.py), compiled with the tfsn backend against eager
PyTorch as tests/test_optimizer_user_models.py compares its own (the same checks and tolerances):
forward output, loss, input and parameter gradients and buffers, in fp32, fp64, bf16 (a model cast to
it, and autocast), on the C target and a subset through the Triton kernels (on this CPU under
TRITON_INTERPRET=1); then training steps the way users write them: gradient clipping with
clip_grad_norm_ before the step, Adam with L2 weight_decay, AdamW with two parameter groups (no decay
and a larger lr for biases and norms), SGD with Nesterov momentum and weight decay, the clipping and
the step compiled together. Every compiled step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from optimizer.backend import make_backend  # noqa: E402
from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models import check_training  # noqa: E402
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, no_graph_left_to_aten  # noqa: E402
from tests.user_models_third import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["index_moe", "scan_masks_fp64", "ties", "masked_rows", "views_zoo", "stateful", "pure_bf16"]
TRAINED = ["index_moe", "stateful"]    # gather/index_add routing; buffers written in forward (a tied head: user_models' gpt)
TRAINED_THROUGH_TRITON = ["stateful"]
CLIP = 0.5                                               # below the gradients' norm: clipping scales them


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)


def param_groups(model: nn.Module, lr: float) -> list[dict]:
    """The usual split: matrices decay; biases, norm weights and other vectors do not, at 3x the lr."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices}, {"params": vectors, "lr": 3 * lr, "weight_decay": 0.0}]


OPTIMIZERS = {
    "adam_l2": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.05),
    "adamw_groups": lambda m: torch.optim.AdamW(param_groups(m, 1e-2), lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95)),
    "sgd_nesterov_groups": lambda m: torch.optim.SGD(param_groups(m, 0.05), lr=0.05, momentum=0.9, nesterov=True,
                                                     weight_decay=1e-3),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("case, codegen", [(c, "c") for c in cases() if c.name in TRAINED]
                         + [(c, "triton") for c in cases() if c.name in TRAINED_THROUGH_TRITON],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_clipped_training_steps_match_eager(case, codegen, optimizer):
    """The loss of each step against eager's; after SGD every parameter and buffer too. After Adam only
    the losses: Adam divides out the gradient's size, so rounding noise in a small or exactly-zero
    gradient moves its element by up to lr (see tests/test_optimizer_user_models.py's check_training)."""
    if codegen == "triton":
        pytest.importorskip("triton")
    no_graph_left_to_aten(lambda: check_training(case, optimizer, OPTIMIZERS[optimizer], make_backend(codegen=codegen),
                                                 clip=CLIP))
