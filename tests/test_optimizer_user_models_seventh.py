"""A seventh set of user models (tests/user_models_seventh.py: a spatial transformer in each grid_sample mode,
padding mode and align_corners, F.interpolate's modes, ESPCN's pixel_shuffle, im2col by unfold and fold,
reflect / replicate / circular padded convs and a grouped, dilated ConvTranspose2d, fixed Sobel and Gaussian
filters, a dense detector's anchors, box coding, focal and GIoU losses, RoI pooling by gather, CenterNet's
heatmap focal loss, a channels_last_3d Conv3d net), compiled with the tfsn backend against eager PyTorch as
tests/test_optimizer_user_models.py compares its own (the same checks and tolerances): forward output, loss,
input and parameter gradients and buffers, in fp32 and fp64, on the C target and a subset through the
Triton kernels (on this CPU under TRITON_INTERPRET=1); then SGD and AdamW training steps for two, and
multi-scale training (one compiled model fed images of a new size each step, so that Dynamo makes the
sizes symbolic and the grids built from them by arange and meshgrid are made per shape). Every compiled
step must generate kernels and leave no graph to ATen."""
from __future__ import annotations

import os

if os.environ.get("TFSN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from optimizer.backend import make_backend  # noqa: E402
from tests.test_optimizer_correctness import fresh  # noqa: E402, F401  (autouse: shared compile cache, no dynamo state)
from tests.test_optimizer_user_models import close  # noqa: E402
from tests.test_optimizer_user_models_more import forward_and_gradient_tests, no_graph_left_to_aten, training_steps_test  # noqa: E402
from tests.user_models_seventh import cases  # noqa: E402

# small ones: Triton's interpreter runs each program in Python
THROUGH_TRITON = ["stn_bilinear_border_corners", "stn_nearest_reflection", "espcn", "roi_pool_gather"]
TRAINED = ["stn_bilinear_reflection_corners", "dense_detector_focal_giou"]
# a pixel grid by meshgrid of the image's (symbolic) height and width, a homography's grid of it
MULTI_SCALE = ["flow_warp_homography", "roi_pool_gather"]
SCALES = [(15, 13), (19, 17), (23, 21), (17, 15)]


test_forward_and_gradients_match_eager, test_through_triton_forward_and_gradients_match_eager = \
    forward_and_gradient_tests(cases(), THROUGH_TRITON)

test_training_steps_match_eager = training_steps_test(cases(), TRAINED)


@pytest.mark.parametrize("case", [c for c in cases() if c.name in MULTI_SCALE], ids=lambda c: c.name)
def test_multi_scale_steps_match_eager(case):
    """The case's image inputs resized to each of SCALES in turn, one compiled model against eager: output,
    loss, input and parameter gradients at every size."""
    def check() -> None:
        torch.manual_seed(0)
        eager = case.build()
        mine = copy.deepcopy(eager)
        compiled = torch.compile(mine, backend=make_backend())
        for H, W in SCALES:
            inputs, target = case.batch(torch.Generator().manual_seed(H))
            inputs = tuple(F.interpolate(t, size=(H, W), mode="bilinear") if t.dim() == 4 else t for t in inputs)
            inputs_e, inputs_m = (tuple(t.clone().requires_grad_(t.is_floating_point()) for t in inputs) for _ in "em")
            eager.zero_grad()
            mine.zero_grad()
            out_e, loss_e = case.step(eager, inputs_e, target)
            loss_e.backward()
            out_m, loss_m = case.step(compiled, inputs_m, target)
            loss_m.backward()
            close(out_m, out_e, f"{case.name} {H}x{W} output")
            close(loss_m, loss_e, f"{case.name} {H}x{W} loss")
            for a, b in zip(inputs_m, inputs_e):
                if b.grad is not None:
                    close(a.grad, b.grad, f"{case.name} {H}x{W} input grad")
            grads = dict(mine.named_parameters())
            for name, p in eager.named_parameters():
                close(grads[name].grad, p.grad, f"{case.name} {H}x{W} grad of {name}")
    no_graph_left_to_aten(check)
