"""Channels-last activations for convolutions: the layout decision of the training step.

oneDNN (ATen's CPU convolution) runs a channels-last (NHWC) convolution without reordering its
input and output; given NCHW it reorders both on every call, forward and backward. On this
machine the CNN suite's two convolutions took 9.4 ms forward + backward in NCHW and 6.3 ms in
NHWC. So each convolution's activation arguments are made channels-last in the joint graph,
before it is split into forward and backward, and the layout flows from there: the convolution's
output is NHWC, so are the pointwise ops after it, and the generated loops follow the memory
(KernelWriter.memory_order), so BatchNorm and ReLU read it in order and the next convolution's
input is written NHWC by the kernel that computes it, with no copy of its own.

The graph's own outputs (the model's results, the gradients) keep the layout they had: a view
the user takes of an output, or an optimizer's view of a gradient, must not see other strides.
"""
from __future__ import annotations

import logging

import torch
import torch.fx

log = logging.getLogger("tfsn.optimizer")
aten = torch.ops.aten

# the arguments of each convolution op that are activations (weights keep their layout: oneDNN
# reorders a weight to its own blocked format whatever it is given)
ACTIVATIONS = {aten.convolution.default: (0,), aten.convolution_backward.default: (0, 1)}


# ops that read or write memory by explicit strides: other strides upstream would change their result
STRIDED = {aten.as_strided.default, aten.as_strided_.default, aten.as_strided_scatter.default,
           aten.as_strided_copy.default}


def _channels_last(val) -> bool:
    return val.dim() == 4 and val.is_contiguous(memory_format=torch.channels_last)


def _wants(node: torch.fx.Node) -> bool:
    """A 2-D convolution of fp32 CPU tensors (the case oneDNN's NHWC path covers)."""
    val = node.meta.get("val")
    if node.target not in ACTIVATIONS:
        return False
    args = [node.args[i] for i in ACTIVATIONS[node.target]]
    vals = [a.meta.get("val") for a in args if isinstance(a, torch.fx.Node)]
    out = val[0] if isinstance(val, (tuple, list)) else val
    return len(vals) == len(args) and all(
        isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype == torch.float32 and v.device.type == "cpu"
        for v in vals) and (out is None or isinstance(out, torch.Tensor))


def channels_last_convolutions(joint: torch.fx.GraphModule) -> bool:
    """Rewrite `joint` in place so that its 2-D convolutions take channels-last activations, and
    recompute every node's fake value (strides) from there. Leaves the graph as it was and returns
    False when there is nothing to do or the rewrite does not hold (a view the new strides forbid)."""
    convs = [n for n in joint.graph.nodes if n.op == "call_function" and _wants(n)]
    if not convs or any(n.target in STRIDED for n in joint.graph.nodes):
        return False
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = [n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode(placeholders)
    if mode is None:
        return False
    todo = [(conv, i) for conv in convs for i in ACTIVATIONS[conv.target]
            if not _channels_last(conv.args[i].meta["val"])]
    if not todo:             # done already (the partitioners see the graph after searched_partition)
        return False
    before = {n: n.meta.get("val") for n in joint.graph.nodes}
    output = next(iter(joint.graph.find_nodes(op="output")))
    saved_graph = torch.fx.Graph()
    mapping = saved_graph.graph_copy(joint.graph, {})
    saved_graph.output(mapping)
    made: dict[torch.fx.Node, torch.fx.Node] = {}
    for conv, i in todo:
        arg = conv.args[i]
        if arg not in made:
            with joint.graph.inserting_after(arg):
                made[arg] = joint.graph.call_function(aten.clone.default, (arg,),
                                                      {"memory_format": torch.channels_last})
        conv.update_arg(i, made[arg])
    # outputs back to the strides they had
    result = output.args[0]
    single = not isinstance(result, (list, tuple))
    outs = [result] if single else list(result)
    try:
        with mode:
            FakeTensorProp(joint, mode).propagate_dont_convert_inputs(*placeholders)
        for arg, clone in made.items():       # NHWC already, from an earlier convolution: no copy
            if _channels_last(arg.meta["val"]):
                clone.replace_all_uses_with(arg)
                joint.graph.erase_node(clone)
        changed = False
        for k, o in enumerate(outs):
            old, new = before.get(o), o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor) or old.stride() == new.stride():
                continue
            if not old.is_contiguous():
                raise ValueError(f"output {k} changed strides and was not contiguous")
            with joint.graph.inserting_before(output):
                outs[k] = joint.graph.call_function(aten.clone.default, (o,),
                                                    {"memory_format": torch.contiguous_format})
            changed = True
        if changed:
            output.args = (outs[0] if single else type(result)(outs),)
            with mode:
                FakeTensorProp(joint, mode).propagate_dont_convert_inputs(*placeholders)
    except Exception as e:        # a view the new strides do not allow, a meta kernel that refuses
        log.info("tfsn: convolutions stay in their layout (%s)", str(e).splitlines()[0][:200])
        joint.graph = saved_graph
        joint.recompile()
        return False
    joint.graph.eliminate_dead_code()
    joint.recompile()
    log.info("tfsn: %d convolution(s) take channels-last activations", len(convs))
    return True
