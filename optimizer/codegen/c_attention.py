"""C/OpenMP source of the generated attention pair (optimizer/attention.py says when it runs): a forward
with online softmax and a FlashAttention-2 backward, neither of which writes a query x key tensor.

Forward: per (batch, head, block of query rows), the key blocks in turn: scores of the block, the
row's running max and sum rescaled as a larger max arrives, and the output accumulated in the same
pass; at the end the output over the sum and the log-sum-exp (max + log sum) the backward reads.
Backward: per (batch, head), each key block with the query blocks that see it: the probabilities
recomputed from the saved log-sum-exp, dV += P^T dO, dS = P (dO V^T - rowsum(dO O)), dK += dS^T Q,
dQ += dS K (dQ in a buffer of the head, so that no two threads add to one row).
Every size and stride is a constant of the function (kernels are specialized to their shapes, as the
generated loop nests are); operands are copied into contiguous blocks, so any strides are read.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from optimizer.attention import Call, Shape, call_of
from optimizer.codegen.c import Kernel
from optimizer.ir import Graph, Node, TensorType
from optimizer.schedule import Schedule

log = logging.getLogger("tfsn.optimizer")


@dataclass(frozen=True)
class AttentionKernel(Kernel):
    """A generated attention call: `params` are its tensor arguments (graph nodes), `results` the
    layouts of the tensors it returns as the ATen op does (output, log-sum-exp; or dQ, dK, dV),
    passed after them; `outputs` is empty, the run-time step allocates the results."""
    results: tuple[TensorType, ...]


def _flt(x: float) -> str:
    return f"{x:.9g}f"


def _at(name: str, strides: tuple[int, ...], *index: str) -> str:
    """`name`'s element at `index` (batch, head, row[, column]) by its strides."""
    return f"{name}[" + " + ".join(f"({i}) * {s}" for i, s in zip(index, strides) if s != 0) + "]" \
        if any(s != 0 for s in strides) else f"{name}[0]"


def forward_source(name: str, s: Shape, strides: tuple[tuple[int, ...], ...], block: int) -> str:
    """void name(q, k, v, out, lse): `strides` of q, k, v, out and lse, in that order."""
    sq, sk, sv, so, sl = strides
    bq = bk = block
    qblocks = -(-s.queries // bq)
    e, ev = s.e, s.ev
    scratch = bq * e + e * bk + bk * ev + bq * bk + bq * ev + 2 * bq
    kend = f"({s.keys} < i0 + qn ? {s.keys} : i0 + qn)" if s.causal else str(s.keys)
    masked = "j >= kn || j0 + j > i0 + i" if s.causal else "j >= kn"
    return f"""void {name}(const float* restrict q, const float* restrict k, const float* restrict v,
          float* restrict out, float* restrict lse) {{
  #pragma omp parallel
  {{
  float* buf = (float*)aligned_alloc(64, ({scratch} * sizeof(float) + 63) / 64 * 64);
  float (*restrict qb)[{e}] = (float (*)[{e}])buf;
  float (*restrict kt)[{bk}] = (float (*)[{bk}])(buf + {bq * e});
  float (*restrict vb)[{ev}] = (float (*)[{ev}])(buf + {bq * e + e * bk});
  float (*restrict sc)[{bk}] = (float (*)[{bk}])(buf + {bq * e + e * bk + bk * ev});
  float (*restrict acc)[{ev}] = (float (*)[{ev}])(buf + {bq * e + e * bk + bk * ev + bq * bk});
  float* restrict mx = buf + {scratch - 2 * bq};
  float* restrict sum = mx + {bq};
  #pragma omp for schedule(dynamic)
  for (int64_t t = 0; t < {s.batch * s.heads * qblocks}; t++) {{
    const int64_t b = t / {s.heads * qblocks}, h = (t / {qblocks}) % {s.heads}, i0 = (t % {qblocks}) * {bq};
    const int64_t qn = {s.queries} - i0 < {bq} ? {s.queries} - i0 : {bq};
    for (int64_t i = 0; i < qn; i++) {{
      for (int64_t x = 0; x < {e}; x++) qb[i][x] = {_at("q", sq, "b", "h", "i0 + i", "x")};
      for (int64_t d = 0; d < {ev}; d++) acc[i][d] = 0.0f;
      mx[i] = -INFINITY;
      sum[i] = 0.0f;
    }}
    const int64_t kend = {kend};
    for (int64_t j0 = 0; j0 < kend; j0 += {bk}) {{
      const int64_t kn = kend - j0 < {bk} ? kend - j0 : {bk};
      for (int64_t j = 0; j < {bk}; j++) {{
        for (int64_t x = 0; x < {e}; x++) kt[x][j] = j < kn ? {_at("k", sk, "b", "h", "j0 + j", "x")} : 0.0f;
        for (int64_t d = 0; d < {ev}; d++) vb[j][d] = j < kn ? {_at("v", sv, "b", "h", "j0 + j", "d")} : 0.0f;
      }}
      for (int64_t i = 0; i < qn; i++) {{
        float* restrict si = sc[i];
        #pragma omp simd
        for (int64_t j = 0; j < {bk}; j++) si[j] = 0.0f;
        for (int64_t x = 0; x < {e}; x++) {{
          const float qx = qb[i][x];
          #pragma omp simd
          for (int64_t j = 0; j < {bk}; j++) si[j] += qx * kt[x][j];
        }}
        float m = mx[i];
        for (int64_t j = 0; j < {bk}; j++) {{
          si[j] = ({masked}) ? -INFINITY : si[j] * {_flt(s.scale)};
          m = si[j] > m ? si[j] : m;
        }}
        const float alpha = mx[i] == -INFINITY ? 0.0f : tfsn_expf(mx[i] - m);
        const float shift = m == -INFINITY ? 0.0f : m;     /* a row with no key yet: every p is 0 */
        float rowsum = 0.0f;
        #pragma omp simd reduction(+:rowsum)
        for (int64_t j = 0; j < {bk}; j++) {{
          si[j] = tfsn_expf(si[j] - shift);
          rowsum += si[j];
        }}
        mx[i] = m;
        sum[i] = sum[i] * alpha + rowsum;
        float* restrict ai = acc[i];
        #pragma omp simd
        for (int64_t d = 0; d < {ev}; d++) ai[d] *= alpha;
        for (int64_t j = 0; j < kn; j++) {{
          const float p = si[j];
          #pragma omp simd
          for (int64_t d = 0; d < {ev}; d++) ai[d] += p * vb[j][d];
        }}
      }}
    }}
    for (int64_t i = 0; i < qn; i++) {{
      const float inv = 1.0f / sum[i];
      for (int64_t d = 0; d < {ev}; d++) {_at("out", so, "b", "h", "i0 + i", "d")} = acc[i][d] * inv;
      {_at("lse", sl, "b", "h", "i0 + i")} = mx[i] + logf(sum[i]);
    }}
  }}
  free(buf);
  }}
}}
"""


def backward_source(name: str, s: Shape, strides: tuple[tuple[int, ...], ...], block: int) -> str:
    """void name(grad_out, q, k, v, out, lse, dq, dk, dv): `strides` of those nine, in that order."""
    sdo, sq, sk, sv, so, sl, sdq, sdk, sdv = strides
    bq = bk = block
    L, S, e, ev = s.queries, s.keys, s.e, s.ev
    head = L * e + S * e + S * ev + L * ev + L * e + 2 * L       # q, k, v, dO, dQ of the head; lse, rowsum(dO O)
    block_floats = e * bk + ev * bk + 2 * bq * bk + bk * e + bk * ev
    scratch = head + block_floats
    masked = "j >= kn || j0 + j > i0 + i" if s.causal else "j >= kn"
    offsets, at = {}, 0
    for buf, size in (("qc", L * e), ("kc", S * e), ("vc", S * ev), ("doc", L * ev), ("dqc", L * e), ("lv", L),
                      ("dd", L), ("kt", e * bk), ("vt", ev * bk), ("pb", bq * bk), ("ds", bq * bk),
                      ("dkb", bk * e), ("dvb", bk * ev)):
        offsets[buf], at = at, at + size
    columns = {"qc": e, "kc": e, "vc": ev, "doc": ev, "dqc": e, "kt": bk, "vt": bk, "pb": bk, "ds": bk,
               "dkb": e, "dvb": ev}
    views = "\n".join(f"  float (*restrict {b})[{c}] = (float (*)[{c}])(buf + {offsets[b]});" for b, c in columns.items())
    return f"""void {name}(const float* restrict go, const float* restrict q, const float* restrict k,
          const float* restrict v, const float* restrict o, const float* restrict lse,
          float* restrict dq, float* restrict dk, float* restrict dv) {{
  #pragma omp parallel
  {{
  float* buf = (float*)aligned_alloc(64, ({scratch} * sizeof(float) + 63) / 64 * 64);
{views}
  float* restrict lv = buf + {offsets["lv"]};
  float* restrict dd = buf + {offsets["dd"]};
  #pragma omp for schedule(dynamic)
  for (int64_t t = 0; t < {s.batch * s.heads}; t++) {{
    const int64_t b = t / {s.heads}, h = t % {s.heads};
    for (int64_t i = 0; i < {L}; i++) {{
      for (int64_t x = 0; x < {e}; x++) {{ qc[i][x] = {_at("q", sq, "b", "h", "i", "x")}; dqc[i][x] = 0.0f; }}
      float r = 0.0f;
      for (int64_t d = 0; d < {ev}; d++) {{
        doc[i][d] = {_at("go", sdo, "b", "h", "i", "d")};
        r += doc[i][d] * {_at("o", so, "b", "h", "i", "d")};
      }}
      dd[i] = r;
      lv[i] = {_at("lse", sl, "b", "h", "i")};
    }}
    for (int64_t j = 0; j < {S}; j++) {{
      for (int64_t x = 0; x < {e}; x++) kc[j][x] = {_at("k", sk, "b", "h", "j", "x")};
      for (int64_t d = 0; d < {ev}; d++) vc[j][d] = {_at("v", sv, "b", "h", "j", "d")};
    }}
    for (int64_t j0 = 0; j0 < {S}; j0 += {bk}) {{
      const int64_t kn = {S} - j0 < {bk} ? {S} - j0 : {bk};
      for (int64_t j = 0; j < {bk}; j++) {{
        for (int64_t x = 0; x < {e}; x++) kt[x][j] = j < kn ? kc[j0 + j][x] : 0.0f;
        for (int64_t d = 0; d < {ev}; d++) vt[d][j] = j < kn ? vc[j0 + j][d] : 0.0f;
      }}
      for (int64_t j = 0; j < kn; j++) {{
        for (int64_t x = 0; x < {e}; x++) dkb[j][x] = 0.0f;
        for (int64_t d = 0; d < {ev}; d++) dvb[j][d] = 0.0f;
      }}
      for (int64_t i0 = {"j0" if s.causal else "0"}; i0 < {L}; i0 += {bq}) {{
        const int64_t qn = {L} - i0 < {bq} ? {L} - i0 : {bq};
        for (int64_t i = 0; i < qn; i++) {{
          float* restrict p = pb[i];
          float* restrict g = ds[i];
          #pragma omp simd
          for (int64_t j = 0; j < {bk}; j++) {{ p[j] = 0.0f; g[j] = 0.0f; }}
          for (int64_t x = 0; x < {e}; x++) {{
            const float qx = qc[i0 + i][x];
            #pragma omp simd
            for (int64_t j = 0; j < {bk}; j++) p[j] += qx * kt[x][j];
          }}
          for (int64_t d = 0; d < {ev}; d++) {{
            const float gd = doc[i0 + i][d];
            #pragma omp simd
            for (int64_t j = 0; j < {bk}; j++) g[j] += gd * vt[d][j];
          }}
          const float l = lv[i0 + i], r = dd[i0 + i];
          #pragma omp simd
          for (int64_t j = 0; j < {bk}; j++) {{
            p[j] = ({masked}) ? 0.0f : tfsn_expf(p[j] * {_flt(s.scale)} - l);
            g[j] = p[j] * (g[j] - r) * {_flt(s.scale)};
          }}
          for (int64_t j = 0; j < kn; j++) {{
            const float pj = p[j], gj = g[j];
            #pragma omp simd
            for (int64_t d = 0; d < {ev}; d++) dvb[j][d] += pj * doc[i0 + i][d];
            #pragma omp simd
            for (int64_t x = 0; x < {e}; x++) {{
              dkb[j][x] += gj * qc[i0 + i][x];
              dqc[i0 + i][x] += gj * kc[j0 + j][x];
            }}
          }}
        }}
      }}
      for (int64_t j = 0; j < kn; j++) {{
        for (int64_t x = 0; x < {e}; x++) {_at("dk", sdk, "b", "h", "j0 + j", "x")} = dkb[j][x];
        for (int64_t d = 0; d < {ev}; d++) {_at("dv", sdv, "b", "h", "j0 + j", "d")} = dvb[j][d];
      }}
    }}
    for (int64_t i = 0; i < {L}; i++)
      for (int64_t x = 0; x < {e}; x++) {_at("dq", sdq, "b", "h", "i", "x")} = dqc[i][x];
  }}
  free(buf);
  }}
}}
"""


def write(graph: Graph, node: Node, schedule: Schedule, name: str) -> AttentionKernel | None:
    """The generated kernel of an attention node under `schedule`; None when ATen's runs it (the schedule
    says so, or the call is one the pair does not cover)."""
    call = call_of(graph, node)
    if call is None or schedule.attention != "generated":
        return None
    strides = tuple(graph.nodes[n].type.strides for n in call.operands) + tuple(t.strides for t in call.results)
    source = (backward_source if call.backward else forward_source)(name, call.shape, strides,
                                                                     schedule.attention_block)
    return AttentionKernel(name, source, call.operands, (), call.results)


def runner(kernel: AttentionKernel, lib) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The kernel as ATen's op is called: its tensor arguments in, the tuple of its results out."""
    fn = getattr(lib, kernel.name)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * (len(kernel.params) + len(kernel.results))

    def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        results = tuple(torch.empty_strided(t.shape, t.strides, dtype=torch.float32) for t in kernel.results)
        fn(*[t.data_ptr() for t in (*tensors, *results)])
        return results
    return run


def _inputs(graph: Graph, node: Node, call: Call) -> tuple[list[torch.Tensor], dict]:
    """Seeded tensors of the operands' layouts (a backward's out and log-sum-exp from ATen's forward of
    its q, k, v, so that its probabilities are ones), and the op's other arguments."""
    generator = torch.Generator().manual_seed(0)

    def like(n: int, values: torch.Tensor | None = None) -> torch.Tensor:
        t = graph.nodes[n].type
        out = torch.empty_strided(t.shape, t.strides, dtype=torch.float32)
        return out.copy_(values) if values is not None else out.normal_(generator=generator)

    tensors = [like(n) for n in call.operands]
    kwargs = {"scale": call.shape.scale}
    if call.backward:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *tensors[1:4], 0.0, call.shape.causal, scale=call.shape.scale)
        tensors[4], tensors[5] = like(call.operands[4], out), like(call.operands[5], lse)
    return tensors, kwargs


def time_against_library(graph: Graph, node: Node, call: Call, schedules: Sequence[Schedule]) -> list[float | None]:
    """Seconds per call of ATen's op and of the generated kernel under each schedule, timed in the same
    rounds on the same inputs; None for a schedule whose results differ from ATen's (a generator bug,
    logged: it never wins)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from optimizer import measure
    from optimizer.codegen import compiler
    from optimizer.codegen.c import library_source
    kernels = [write(graph, node, s, f"attention{i}") for i, s in enumerate(schedules)]
    lib = compiler.load_library(compiler.build_library(library_source(kernels)))
    with unset_fake_temporarily():     # inside torch.compile the ambient mode makes fake tensors: ours are real
        tensors, kwargs = _inputs(graph, node, call)
        op = node.target
        fixed = (0.0, call.shape.causal)
        want = op(*tensors, *fixed, **kwargs)
        runs = [runner(k, lib) for k in kernels]
        valid = []
        for schedule, run in zip(schedules, runs):
            got = run(*tensors)
            ok = measure.same_outputs(dict(enumerate(got)), dict(enumerate(want)))
            if not ok:
                log.warning("tfsn search: discarded the generated attention (block %d): its results differ "
                            "from ATen's (a generator bug; please report it): %s", schedule.attention_block, call)
            valid.append(ok)
        calls = [(lambda: op(*tensors, *fixed, **kwargs), ())] + [(run, tensors) for run, ok in zip(runs, valid) if ok]
        timings = iter(measure.time_calls(calls, rounds=3, budget_s=2.0))
        library = next(timings).best
        return [library] + [next(timings).best if ok else None for ok in valid]
