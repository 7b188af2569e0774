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
    """A C float literal of x; in exponent form so that a whole number (a scale of 1.0) stays one."""
    return f"{x:.9e}f"


def _at(name: str, strides: tuple[int, ...], *index: str) -> str:
    """`name`'s element at `index` (batch, head, row[, column]) by its strides."""
    return f"{name}[" + " + ".join(f"({i}) * {s}" for i, s in zip(index, strides) if s != 0) + "]" \
        if any(s != 0 for s in strides) else f"{name}[0]"


def _scratch(floats: int) -> str:
    """A thread's blocks: aligned, and a one-line error rather than a crash when memory runs out."""
    return (f"(float*)aligned_alloc(64, ({floats} * sizeof(float) + 63) / 64 * 64);\n"
            f"  if (buf == NULL) {{ fprintf(stderr, \"tfsn: out of memory for attention blocks ({floats} floats)\\n\"); "
            "abort(); }")


def _ceil8(n: int) -> int:
    return -(-n // 8) * 8


def _tile(width: int) -> list[str]:
    """One step of the product's register tile: 4 rows x `width` vectors of 8 columns, over the depth."""
    accs = [f"c{r}{v}" for r in range(4) for v in range(width)]
    body = [f"      {'tfsn_v8 ' + ' = {0}, '.join(accs)} = {{0}};",
            "      for (int64_t k = 0; k < depth; k++) {",
            *[f"        const tfsn_v8 b{v} = *(const tfsn_v8*)(b + k * ldb + j + {8 * v});" for v in range(width)],
            *[f"        const float x{r} = a{r}[k * aks];" for r in range(4)],
            *[f"        c{r}{v} += x{r} * b{v};" for r in range(4) for v in range(width)],
            "      }"]
    for r in range(4):
        stores = " ".join(f"{{ tfsn_v8* o = (tfsn_v8*)(c + (i + {r}) * ldc + j + {8 * v}); "
                          f"if (add) *o += c{r}{v}; else *o = c{r}{v}; }}" for v in range(width))
        body.append(f"      if (mn > {r}) {{ {stores} }}")
    return body


def _product(name: str) -> str:
    """`name`_mm: c[r][0:n] = (or +=) sum over k < depth of a[r * ars + k * aks] * b[k * ldb + 0:n], r < m,
    n a multiple of 8. Why its own register tiles (as the generated GEMM's micro-kernel): every product of
    attention is a small GEMM, and a loop that adds one row at a time to a row of scores is store-bound."""
    return "\n".join([
        f"static inline void {name}_mm(float* restrict c, const int64_t ldc, const float* restrict a, "
        "const int64_t ars, const int64_t aks,",
        "    const float* restrict b, const int64_t ldb, const int64_t m, const int64_t n, const int64_t depth, "
        "const int add) {",
        "  for (int64_t i = 0; i < m; i += 4) {",
        "    const int64_t mn = m - i < 4 ? m - i : 4;",
        *[f"    const float* restrict a{r} = a + {f'(mn > {r} ? i + {r} : i)' if r else 'i'} * ars;" for r in range(4)],
        "    int64_t j = 0;",
        "    for (; j + 16 <= n; j += 16) {", *_tile(2), "    }",
        "    for (; j < n; j += 8) {", *_tile(1), "    }",
        "  }",
        "}",
    ]) + "\n"


def forward_source(name: str, s: Shape, strides: tuple[tuple[int, ...], ...], block: int) -> str:
    """void name(q, k, v, out, lse): `strides` of q, k, v, out and lse, in that order. `block` is a
    multiple of 8 (the product's vectors)."""
    sq, sk, sv, so, sl = strides
    bq = bk = block
    qblocks = -(-s.queries // bq)
    e, ev, evp = s.e, s.ev, _ceil8(s.ev)
    scratch = bq * e + e * bk + bk * evp + bq * bk + bq * evp + 2 * bq
    kend = f"({s.keys} < i0 + qn ? {s.keys} : i0 + qn)" if s.causal else str(s.keys)
    masked = "j >= kn || j0 + j > i0 + i" if s.causal else "j >= kn"
    return _product(name) + f"""void {name}(const float* restrict q, const float* restrict k, const float* restrict v,
          float* restrict out, float* restrict lse) {{
  #pragma omp parallel
  {{
  float* buf = {_scratch(scratch)}
  float (*restrict qb)[{e}] = (float (*)[{e}])buf;
  float (*restrict kt)[{bk}] = (float (*)[{bk}])(buf + {bq * e});
  float (*restrict vb)[{evp}] = (float (*)[{evp}])(buf + {bq * e + e * bk});
  float (*restrict sc)[{bk}] = (float (*)[{bk}])(buf + {bq * e + e * bk + bk * evp});
  float (*restrict acc)[{evp}] = (float (*)[{evp}])(buf + {bq * e + e * bk + bk * evp + bq * bk});
  float* restrict mx = buf + {scratch - 2 * bq};
  float* restrict sum = mx + {bq};
  #pragma omp for schedule(dynamic)
  for (int64_t t = 0; t < {s.batch * s.heads * qblocks}; t++) {{
    const int64_t b = t / {s.heads * qblocks}, h = (t / {qblocks}) % {s.heads}, i0 = (t % {qblocks}) * {bq};
    const int64_t qn = {s.queries} - i0 < {bq} ? {s.queries} - i0 : {bq};
    for (int64_t i = 0; i < qn; i++) {{
      for (int64_t x = 0; x < {e}; x++) qb[i][x] = {_at("q", sq, "b", "h", "i0 + i", "x")};
      for (int64_t d = 0; d < {evp}; d++) acc[i][d] = 0.0f;
      mx[i] = -INFINITY;
      sum[i] = 0.0f;
    }}
    const int64_t kend = {kend};
    for (int64_t j0 = 0; j0 < kend; j0 += {bk}) {{
      const int64_t kn = kend - j0 < {bk} ? kend - j0 : {bk};
      for (int64_t j = 0; j < {bk}; j++) {{
        for (int64_t x = 0; x < {e}; x++) kt[x][j] = j < kn ? {_at("k", sk, "b", "h", "j0 + j", "x")} : 0.0f;
        for (int64_t d = 0; d < {evp}; d++)
          vb[j][d] = j < kn && d < {ev} ? {_at("v", sv, "b", "h", "j0 + j", "d")} : 0.0f;
      }}
      {name}_mm(&sc[0][0], {bk}, &qb[0][0], {e}, 1, &kt[0][0], {bk}, qn, {bk}, {e}, 0);
      for (int64_t i = 0; i < qn; i++) {{
        float* restrict si = sc[i];
        float m = mx[i];
        #pragma omp simd reduction(max:m)
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
        for (int64_t d = 0; d < {evp}; d++) ai[d] *= alpha;
      }}
      {name}_mm(&acc[0][0], {evp}, &sc[0][0], {bk}, 1, &vb[0][0], {evp}, qn, {evp}, kn, 1);
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
    """void name(grad_out, q, k, v, out, lse, dq, dk, dv): `strides` of those nine, in that order.
    Rows of the head's copies are padded to whole vectors of 8 (zeros), the products' width."""
    sdo, sq, sk, sv, so, sl, sdq, sdk, sdv = strides
    bq = bk = block
    L, S, e, ev = s.queries, s.keys, s.e, s.ev
    ep, evp = _ceil8(e), _ceil8(ev)
    masked = "j >= kn || j0 + j > i0 + i" if s.causal else "j >= kn"
    columns = {"qc": ep, "kc": ep, "doc": evp, "dqc": ep, "kt": bk, "vt": bk, "pb": bk, "ds": bk,
               "dkb": ep, "dvb": evp}
    rows = {"qc": L, "kc": S, "doc": L, "dqc": L, "kt": e, "vt": ev, "pb": bq, "ds": bq, "dkb": bk, "dvb": bk}
    offsets, at = {}, 0
    for buf in columns:
        offsets[buf], at = at, at + rows[buf] * columns[buf]
    scratch = at + 2 * L                          # and the head's lse and rowsum(dO O)
    views = "\n".join(f"  float (*restrict {b})[{c}] = (float (*)[{c}])(buf + {offsets[b]});" for b, c in columns.items())
    return _product(name) + f"""void {name}(const float* restrict go, const float* restrict q, const float* restrict k,
          const float* restrict v, const float* restrict o, const float* restrict lse,
          float* restrict dq, float* restrict dk, float* restrict dv) {{
  #pragma omp parallel
  {{
  float* buf = {_scratch(scratch)}
{views}
  float* restrict lv = buf + {at};
  float* restrict dd = lv + {L};
  #pragma omp for schedule(dynamic)
  for (int64_t t = 0; t < {s.batch * s.heads}; t++) {{
    const int64_t b = t / {s.heads}, h = t % {s.heads};
    for (int64_t i = 0; i < {L}; i++) {{
      for (int64_t x = 0; x < {ep}; x++) {{ qc[i][x] = x < {e} ? {_at("q", sq, "b", "h", "i", "x")} : 0.0f; dqc[i][x] = 0.0f; }}
      float r = 0.0f;
      for (int64_t d = 0; d < {evp}; d++) {{
        doc[i][d] = d < {ev} ? {_at("go", sdo, "b", "h", "i", "d")} : 0.0f;
        r += d < {ev} ? doc[i][d] * {_at("o", so, "b", "h", "i", "d")} : 0.0f;
      }}
      dd[i] = r;
      lv[i] = {_at("lse", sl, "b", "h", "i")};
    }}
    for (int64_t j = 0; j < {S}; j++)
      for (int64_t x = 0; x < {ep}; x++) kc[j][x] = x < {e} ? {_at("k", sk, "b", "h", "j", "x")} : 0.0f;
    for (int64_t j0 = 0; j0 < {S}; j0 += {bk}) {{
      const int64_t kn = {S} - j0 < {bk} ? {S} - j0 : {bk};
      for (int64_t j = 0; j < {bk}; j++) {{
        for (int64_t x = 0; x < {e}; x++) kt[x][j] = j < kn ? kc[j0 + j][x] : 0.0f;
        for (int64_t d = 0; d < {ev}; d++) vt[d][j] = j < kn ? {_at("v", sv, "b", "h", "j0 + j", "d")} : 0.0f;
      }}
      for (int64_t j = 0; j < kn; j++) {{
        for (int64_t x = 0; x < {ep}; x++) dkb[j][x] = 0.0f;
        for (int64_t d = 0; d < {evp}; d++) dvb[j][d] = 0.0f;
      }}
      for (int64_t i0 = {"j0" if s.causal else "0"}; i0 < {L}; i0 += {bq}) {{
        const int64_t qn = {L} - i0 < {bq} ? {L} - i0 : {bq};
        {name}_mm(&pb[0][0], {bk}, qc[i0], {ep}, 1, &kt[0][0], {bk}, qn, {bk}, {e}, 0);
        {name}_mm(&ds[0][0], {bk}, doc[i0], {evp}, 1, &vt[0][0], {bk}, qn, {bk}, {ev}, 0);
        for (int64_t i = 0; i < qn; i++) {{
          float* restrict p = pb[i];
          float* restrict g = ds[i];
          const float l = lv[i0 + i], r = dd[i0 + i];
          #pragma omp simd
          for (int64_t j = 0; j < {bk}; j++) {{
            p[j] = ({masked}) ? 0.0f : tfsn_expf(p[j] * {_flt(s.scale)} - l);
            g[j] = p[j] * (g[j] - r) * {_flt(s.scale)};
          }}
        }}
        {name}_mm(&dvb[0][0], {evp}, &pb[0][0], 1, {bk}, doc[i0], {evp}, kn, {evp}, qn, 1);
        {name}_mm(&dkb[0][0], {ep}, &ds[0][0], 1, {bk}, qc[i0], {ep}, kn, {ep}, qn, 1);
        {name}_mm(dqc[i0], {ep}, &ds[0][0], {bk}, 1, kc[j0], {ep}, qn, {ep}, kn, 1);
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


def _inputs(graph: Graph, call: Call) -> tuple[list[torch.Tensor], dict]:
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
        tensors, kwargs = _inputs(graph, call)
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
