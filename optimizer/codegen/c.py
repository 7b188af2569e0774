"""C/OpenMP source for one fused group: its loop nest (optimizer.loopnest) printed as C, shaped by
a Schedule. The loop nest decides what is computed where; this file only decides how C says it
(pragmas, vector widths, thread splits, column blocks, BLAS or our own GEMM micro-kernel).

Three loop shapes: pointwise (outer loops in parallel, the last axis SIMD), row reduction (per
row of kept indices: one pass per stage of reductions, then one pass for the pointwise members
that use them, so LayerNorm or softmax reads its row from cache), and GEMM (BLAS sgemm or our
micro-kernel on a block of rows, then the epilogue on that block while it is in cache).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Sequence

from optimizer.codegen.c_ops import (BUFFER_CTYPES, CTYPES, NONE, Operand, computed_in, expression,
                                     literal, narrowed, rounded, widened)
from optimizer.expr import Expr, render
from optimizer.ir import HALF_DTYPES, Graph, Node
from optimizer.loopnest import (Apply, Assign, Define, Group, Load, Name, RowSegment, RowVar, Select, Stmt, Store,
                                Temp, exact_halves, gemm_operand, lower)
from optimizer.loopnest import Operand as LoopOperand
from optimizer.ops import eager_rounded
from optimizer.schedule import Schedule

PRELUDE = """#include <stdint.h>
#include <stdio.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <tgmath.h>
/* exp for fp32, inline so it vectorizes with no call: Cody-Waite range reduction and a degree-6
   polynomial (Cephes' coefficients, ~1 ulp). Why our own: libmvec's vector expf leaves the SIMD
   path for a whole vector when one lane is out of range, and a causal mask makes half the lanes
   -inf. 2^n is applied as two factors 2^(n/2) so that results down to the smallest denormal come out
   as ATen's do (exp(-90) is 8.2e-40, and a log after it -90, not -inf); below exp(-104) it is 0. */
static inline __attribute__((always_inline)) float tfsn_expf(float x) {
  const float hi = 88.72283935f, lo = -104.0f;
  const float xc = x > hi ? hi : (x < lo ? lo : x);
  const float n = rintf(xc * 1.44269504088896341f);
  float r = fmaf(n, -0.693359375f, xc);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p, r * r, r) + 1.0f;
  const int32_t n1 = (int32_t)n >> 1, n2 = (int32_t)n - n1;    /* each in [-75, 64]: a normal 2^k */
  const int32_t bits1 = (n1 + 127) << 23, bits2 = (n2 + 127) << 23;
  float scale1, scale2;
  memcpy(&scale1, &bits1, sizeof scale1);
  memcpy(&scale2, &bits2, sizeof scale2);
  float y = p * scale1 * scale2;
  y = x < lo ? 0.0f : y;
  y = x > hi ? INFINITY : y;
  return x != x ? x : y;
}
/* integer power as torch's powi: exact, wrapping (the caller casts to the result's type, whose
   wrapped product is the int64 one's low bits), 0 for a negative exponent unless the base is +-1 */
static inline int64_t tfsn_ipow(int64_t a, int64_t b) {
  if (b < 0) return a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;
  int64_t r = 1;
  for (; b; b >>= 1, a *= a)
    if (b & 1) r *= a;
  return r;
}
/* C's fmod (the dividend's sign; exact) and Python's remainder (the divisor's), as ATen's: fmod, moved by
   the divisor where the signs differ; one pair per type the renderer computes them in (the integers' for a
   positive divisor only: optimizer/ops.py MODULOS) */
#define TFSN_MODULOS(T, suffix, fmod_of_a_b) \\
  static inline T tfsn_fmod##suffix(T a, T b) { return fmod_of_a_b; } \\
  static inline T tfsn_remainder##suffix(T a, T b) { \\
    const T r = fmod_of_a_b; \\
    return r != 0 && (r < 0) != (b < 0) ? r + b : r; \\
  }
TFSN_MODULOS(float, f, fmodf(a, b))
TFSN_MODULOS(double, , fmod(a, b))
TFSN_MODULOS(int64_t, _i64, a % b)
/* torch's floor division (`//`, rounding_mode="floor"), as ATen's: of floats, (a - fmod(a, b)) / b (a whole
   number up to the division's rounding), one less where fmod's sign differs from b's, then rounded to the
   nearest whole number; a zero with a / b's sign, and a / b itself for a zero b. Of integers, C's quotient,
   one less where the remainder's sign differs from b's (b positive: optimizer/ops.py ROUNDED_DIVISIONS). */
#define TFSN_DIV_FLOOR(T, suffix) \\
  static inline T tfsn_div_floor##suffix(T a, T b) { \\
    if (b == 0) return a / b; \\
    const T mod = tfsn_fmod##suffix(a, b); \\
    T q = (a - mod) / b; \\
    if (mod != 0 && (b < 0) != (mod < 0)) q -= 1; \\
    if (q == 0) return copysign##suffix(0, a / b); \\
    const T whole = floor##suffix(q); \\
    return q - whole > (T)0.5 ? whole + 1 : whole; \\
  }
TFSN_DIV_FLOOR(float, f)
TFSN_DIV_FLOOR(double, )
static inline int64_t tfsn_div_floor_i64(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return a % b != 0 && (a < 0) != (b < 0) ? q - 1 : q;
}
static inline float tfsn_f32_of_bits(uint32_t bits) {
  float x;
  memcpy(&x, &bits, sizeof x);
  return x;
}
static inline uint32_t tfsn_bits_of_f32(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  return bits;
}
/* bf16 <-> fp32 as torch converts (c10::BFloat16): a bf16 is the top 16 bits of an fp32; fp32 rounds to
   nearest even, and every NaN becomes c10's 0x7FC0 (ATen's bf16 ops write it; its fp32 -> bf16 copy 0xFFFF) */
static inline float tfsn_bf16_to_float(uint16_t h) {
  return tfsn_f32_of_bits((uint32_t)h << 16);
}
static inline uint16_t tfsn_float_to_bf16(float x) {
  const uint32_t bits = tfsn_bits_of_f32(x);
  return x != x ? (uint16_t)0x7FC0 : (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
/* fp16 <-> fp32 as torch converts (c10::Half, after Maratyszcza's FP16 library), in integer and fp32
   arithmetic that vectorizes (gcc vectorizes no _Float16 without AVX512-FP16): exact widening, denormals
   included; narrowing rounds to nearest even by an fp32 addition, NaN -> 0x7E00 with its sign (ATen's
   vectorized copy keeps the payload's top bits too) */
static inline float tfsn_fp16_to_float(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normal = tfsn_f32_of_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormal = tfsn_f32_of_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return tfsn_f32_of_bits(sign | tfsn_bits_of_f32(two_w < (1u << 27) ? denormal : normal));
}
static inline uint16_t tfsn_float_to_fp16(float x) {
  const uint32_t w = tfsn_bits_of_f32(x), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const float base = tfsn_f32_of_bits((bias >> 1) + 0x07800000u) + (fabsf(x) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t bits = tfsn_bits_of_f32(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
#if defined(__x86_64__) || defined(__i386__)
#define TFSN_WIDTH(bits) __attribute__((target("prefer-vector-width=" #bits)))
#else
#define TFSN_WIDTH(bits)
#endif
/* The generated GEMM's packed B: one buffer per calling thread, kept and grown, never freed. Why
   not malloc per call: a panel of a few hundred KiB is an mmap, and its page faults were paid
   again on every call of the step. */
static __thread float* tfsn_panel;
static __thread size_t tfsn_panel_floats;
static float* tfsn_panels(size_t floats) {
  if (floats > tfsn_panel_floats) {
    free(tfsn_panel);
    tfsn_panel = (float*)aligned_alloc(64, (floats + 15) / 16 * 64);
    if (tfsn_panel == NULL) {
      fprintf(stderr, "tfsn: out of memory packing a GEMM operand (%zu floats)\\n", floats);
      abort();
    }
    tfsn_panel_floats = floats;
  }
  return tfsn_panel;
}
/* whole SIMD vectors for the generated GEMM's register tiles (unaligned, may alias floats) */
typedef float tfsn_v4 __attribute__((vector_size(16), aligned(4), may_alias));
typedef float tfsn_v8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef float tfsn_v16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef void (*sgemm_fn)(const char*, const char*, const int*, const int*, const int*, const float*,
                         const float*, const int*, const float*, const int*, const float*, float*, const int*);
static sgemm_fn sgemm_;
void tfsn_set_sgemm(void* fn) { sgemm_ = (sgemm_fn)fn; }
"""
# glibc's libmvec has SIMD versions of these; declaring them lets the vectorizer call them
# without -ffast-math (whose finite-math assumption would break -inf masks in attention).
# The compiler defines TFSN_LIBMVEC only where it links libmvec.
SIMD_MATH = "#ifdef TFSN_LIBMVEC\n" + "".join(
    f"float {f}f(float) __attribute__((simd(\"notinbranch\")));\n"
    for f in ("exp", "log", "tanh", "erf", "log1p", "expm1", "sin", "cos")) + "#endif\n"


@dataclass(frozen=True)
class Kernel:
    name: str
    source: str
    params: tuple[int, ...]          # node indices whose buffers are the C function's arguments, in order
    outputs: tuple[int, ...]         # the members this kernel writes


def _ctype(node: Node) -> str:
    """The C type the node's values are computed in (fp32 for a half)."""
    return CTYPES[computed_in(node.type.dtype)]


def _buffer_ctype(node: Node) -> str:
    """The C type of an element of the node's buffer."""
    return BUFFER_CTYPES[node.type.dtype]


_DEFINITION = re.compile(r"const [\w ]+ (t\d+) = (.*);")


def _invariant(lines: list[str], var: str) -> tuple[list[str], list[str]]:
    """Split a loop body into the definitions that do not depend on loop index `var` (nor on values
    that do, nor on accumulators) and the rest. Why: gcc turns a load made only for one arm of a select
    into a masked load, which it cannot vectorize when the address does not move along the loop
    (BatchNorm's per-channel values in its backward): so such loads are made before the loop."""
    hoisted, kept, varying = [], [], set()
    index = re.compile(rf"\b{var}\b|\bacc\d+\b")
    for line in lines:
        m = _DEFINITION.fullmatch(line)
        if m and not index.search(m.group(2)) and not set(re.findall(r"\bt\d+\b", m.group(2))) & varying:
            hoisted.append(line)
        else:
            if m:
                varying.add(m.group(1))
            kept.append(line)
    return hoisted, kept


def _value_ctype(node: Node) -> str:
    """The C type of a value computed in a loop: a bool computed here (a comparison) is a 32-bit int,
    as wide as the floats around it. Why: a byte-sized temporary needs a vector of 8 bytes at 8 lanes,
    which x86 has not, and gcc then gives up vectorizing the whole loop (ReLU's backward mask)."""
    return "int32_t" if node.type.dtype == "bool" else _ctype(node)


def _paren(e: str) -> str:
    return e if e.isidentifier() or e.lstrip("-").isdigit() or (e.startswith("(") and e.endswith(")")) else f"({e})"


def c_index(e: Expr) -> str:
    """An index expression in C (its values are non-negative: C's `/` is floor division on them)."""
    return render(e, lambda a, k: f"{_paren(a)}*{k}", lambda a, d: f"{_paren(a)}/{d}", lambda a, n: f"({a})%{n}")


def _pragma_simd(s: Schedule, clauses: str = "") -> str:
    if s.vector_width == 1:       # scalar: the function is compiled without the vectorizer
        return f"#pragma GCC unroll {s.unroll}" if s.unroll > 1 and not clauses else ""
    if s.unroll > 1 and not clauses:
        # GCC takes no unroll pragma next to `omp simd`; ivdep keeps the vectorizer's licence
        return f"#pragma GCC ivdep\n#pragma GCC unroll {s.unroll}"
    simdlen = f" simdlen({s.vector_width})" if s.vector_width > 1 else ""
    return f"#pragma omp simd{simdlen}{clauses}"


def _attributes(s: Schedule, mixes_fp64_and_fp32: bool) -> str:
    """The vector width as the function's own compile options: no vectorizer, or a preferred width
    (x86 only: TFSN_WIDTH is empty elsewhere, where simdlen alone asks for the width).

    A kernel that computes in both fp64 and fp32 also goes without the SLP vectorizer. Why: gcc 12 (its
    FRE pass, after SLP) folds the 2-lane vector (double)(float)x that SLP makes of the 2 or 3 elements
    after a constant loop's last whole vector to x: x.float().double() in an fp64 model kept those
    elements unrounded (1e-6 from eager's at |x| ~ 20). The loop vectorizer converts by pack/unpack of
    vectors of different lane counts, which keeps the rounding, as does gcc without SLP."""
    if s.vector_width == 1:
        return '__attribute__((optimize("no-tree-vectorize"))) '
    no_slp = '__attribute__((optimize("no-tree-slp-vectorize"))) ' if mixes_fp64_and_fp32 else ""
    return f"{no_slp}TFSN_WIDTH({32 * s.vector_width}) "


_INIT = {"sum": "0", "mean": "0", "max": "-INFINITY", "min": "INFINITY"}


class KernelWriter:
    """Writes one group's loop nest (optimizer.loopnest) as a C function shaped by a schedule.
    Raises NotFusable when the group cannot be one loop nest."""

    def __init__(self, graph: Graph, group: Group, buffers: set[int], schedule: Schedule, name: str,
                 inplace: dict[int, int] | None = None) -> None:
        self.g, self.group, self.buffers, self.s, self.name = graph, group, buffers, schedule, name
        self.inplace = inplace or {}              # member -> the graph input its value is written over

    def write(self) -> Kernel:
        self.nest = lower(self.g, self.group, self.buffers, self.inplace, tables=True)
        self.names = {n: f"p{k}" for k, n in enumerate(self.nest.params)}
        self.tables: dict[Load, str] = {}
        self.exact = exact_halves(self.g, self.nest)
        self.computed: set[str] = set()           # the dtypes the kernel's pointwise ops compute in
        shape = self.nest.shape
        code = self.gemm() if shape == "gemm" else self.reduction() if shape == "reduction" else self.pointwise()
        code = [self.statement(d) for d in self.nest.prologue] + code
        code = [line for load, name in self.tables.items() for line in self.fill(load, name)] + code
        outputs = set(self.nest.outputs)
        args = ", ".join(f"{'' if n in outputs else 'const '}{_buffer_ctype(self.g.nodes[n])}* restrict {p}"
                         for n, p in self.names.items())
        computed = self.computed | {computed_in(self.g.nodes[n].type.dtype) for n in self.nest.params}
        attributes = _attributes(self.s, {"float32", "float64"} <= computed)
        source = f"{attributes}void {self.name}({args}) {{\n" + "\n".join(f"  {line}" for line in code) + "\n}\n"
        return Kernel(self.name, source, self.nest.params, self.nest.outputs)

    # ---- statements ----
    def value(self, name: Name) -> str:
        if isinstance(name, Temp):
            return f"t{name.id}"
        lanes = self.nest.lane_run
        if lanes is not None:
            return f"{name.kind}{name.node}[m{lanes[0]}]"
        return f"{name.kind}{name.node}[j]" if self.nest.column else f"{name.kind}{name.node}"

    def fill(self, load: Load, name: str) -> list[str]:
        """A table of a load's values along the merged loop it repeats in (LoopNest.tabled), made once
        per call before the loops: the loop then reads it at the merged index, contiguously (a
        remainder of the index, `w[m % C]`, does not vectorize)."""
        (m,) = load.offset.names()
        buffer, length = self.g.nodes[load.buffer], self.nest.lanes(int(m[1:]))
        element = widened(f"{self.names[load.buffer]}[{c_index(load.offset)}]", buffer.type.dtype)
        return [f"{_ctype(buffer)} {name}[{length}];",
                f"for (int64_t {m} = 0; {m} < {length}; {m}++) {name}[{m}] = {element};"]

    def apply(self, a: Apply) -> str:
        node = self.g.nodes[a.node]
        operands = [Operand(self.value(x.name), computed_in(x.dtype), zero_dim=x.zero_dim,
                            half=x.dtype if x.dtype in HALF_DTYPES else None, exact=self.exact.get(x.name) == x.dtype)
                    if isinstance(x, LoopOperand) else literal(x) if isinstance(x, (bool, int, float)) else NONE
                    for x in a.args]
        self.computed |= {computed_in(node.type.dtype), *(o.dtype for o in operands if not o.scalar)}
        return expression(node.op, operands, node.type.dtype, node.kwargs, eager_rounded(node.op, node.params))

    def select(self, v: Select) -> str:
        """A concatenation's element: conditionals on the index along its dim (a select gcc vectorizes)."""
        at = c_index(v.index)
        return "(" + "".join(f"{at} < {b} ? {self.value(x)} : " for b, x in zip(v.bounds, v.values)) + \
            f"{self.value(v.values[-1])})"

    def statement(self, s: Stmt) -> str:
        if isinstance(s, Define):
            v = s.value
            if isinstance(v, Load):
                buffer = self.g.nodes[v.buffer]
                if self.nest.tabled(v):
                    table = self.tables.setdefault(v, f"tb{len(self.tables)}")
                    return f"const {_ctype(buffer)} t{s.name.id} = {table}[{next(iter(v.offset.names()))}];"
                element = f"{self.names[v.buffer]}[{c_index(v.offset)}]"
                return f"const {_ctype(buffer)} t{s.name.id} = {widened(element, buffer.type.dtype)};"
            if isinstance(v, Apply):
                return f"const {_value_ctype(self.g.nodes[v.node])} t{s.name.id} = {self.apply(v)};"
            if isinstance(v, Select):
                return f"const {_value_ctype(self.g.nodes[v.node])} t{s.name.id} = {self.select(v)};"
            return f"const float t{s.name.id} = {rounded(self.gemm_value, self.g.nodes[v.node].type.dtype)};"
        if isinstance(s, Store):
            value = narrowed(self.value(s.value), self.g.nodes[s.buffer].type.dtype)
            return f"{self.names[s.buffer]}[{c_index(s.offset)}] = {value};"
        if isinstance(s, Assign):
            return f"{self.value(s.name)} = {self.apply(s.value)};"
        acc, v = self.value(RowVar("acc", s.node)), self.value(s.value)
        if s.op in ("sum", "mean"):
            return f"{acc} += {v};"
        # torch's amax/amin propagate NaN, which a comparison drops: a flag or-ed along the pass
        # (vectorizes, unlike a NaN test in the comparison that OpenMP's max reduction would drop
        # again when it combines the SIMD lanes)
        return f"{acc} = ({v} {'>' if s.op == 'max' else '<'} {acc}) ? {v} : {acc};\n" \
               f"{self.value(RowVar('nan', s.node))} |= ({v} != {v});"

    def lines(self, stmts: Sequence[Stmt]) -> list[str]:
        return [line for s in stmts for line in self.statement(s).split("\n")]

    # ---- loop nests ----
    def decompose(self, dims: Sequence[int], flat: str) -> list[str]:
        """Loop indices of `dims` from one flat outer index (row-major over those dims)."""
        out, stride = [], prod(self.group.domain[d] for d in dims)
        for k, d in enumerate(dims):
            stride //= self.group.domain[d]
            e = flat if stride == 1 else f"{flat} / {stride}"
            out.append(f"const int64_t i{d} = {e if k == 0 else f'({e}) % {self.group.domain[d]}'};")
        return out

    def parallel(self, elements: int, outer: int) -> str:
        s = self.s
        if s.parallel_axis < 0 or elements < s.parallel_min_elements or outer < 2:
            return ""
        chunk = f", {s.chunk}" if s.chunk else ""
        return f"#pragma omp parallel for schedule(static{chunk})"

    def loops(self, dims: Sequence[int], inner: list[str], simd: str) -> list[str]:
        """Nested loops over `dims` (the last one SIMD) around `inner`; the values of `inner` that do
        not change along the SIMD loop are computed once before it. Axes merged by the loop nest are one loop."""
        runs = self.nest.runs
        merged = {d for run in runs.values() for d in run[1:]}
        nest = [(f"m{d}", prod(self.group.domain[a] for a in runs[d])) if d in runs
                else (f"i{d}", self.group.domain[d]) for d in dims if d not in merged]
        code = inner
        for k, (var, extent) in enumerate(reversed(nest)):
            head = [simd] if k == 0 and simd else []
            before, code = _invariant(code, var) if k == 0 and simd else ([], code)
            code = before + head + [f"for (int64_t {var} = 0; {var} < {extent}; {var}++) {{"] + \
                [f"  {line}" for line in code] + ["}"]
        return code

    def pointwise(self) -> list[str]:
        dom, order = self.group.domain, self.nest.order
        inner = self.lines(self.nest.body)
        if len(dom) == 0:
            return inner
        simd = _pragma_simd(self.s)
        if len(dom) == 1:
            par = self.parallel(dom[0], dom[0])
            return self.loops([0], inner, par.replace("parallel for", "parallel for simd") if par else simd)
        merged = self.nest.runs.get(next(iter(self.nest.runs), None), (order[-1],))
        outer_dims = [d for d in order if d not in merged]
        outer = prod(dom[d] for d in outer_dims)
        nest = self.loops(list(merged), inner, simd)
        par = self.parallel(prod(dom), outer)
        return ([par] if par else []) + [f"for (int64_t r = 0; r < {outer}; r++) {{"] + \
            [f"  {line}" for line in self.decompose(outer_dims, "r") + nest] + ["}"]

    def reduction(self) -> list[str]:
        """Per row of kept indices: passes of reductions over the reduced axes, the per-row values
        between them (mean, rstd), then one pass for the members over the whole domain.

        When the axis innermost in memory is kept (a bias gradient: sum over rows; channels-last
        BatchNorm statistics), a "row" is a block of `column_block` columns of it instead, its values
        are arrays, and SIMD runs across the columns."""
        dom, nest = self.group.domain, self.nest
        if nest.lane_run is not None:
            return self.lane_reduction()
        last, column, kept, reduced = nest.order[-1], nest.column, nest.kept, nest.reduced
        count = prod(dom[d] for d in reduced)
        simd = _pragma_simd(self.s)
        if column:
            jb = self.s.column_block
            blocks = -(-dom[last] // jb)
            outer = prod(dom[d] for d in kept[:-1]) * blocks
            row = self.decompose(kept[:-1], f"(r / {blocks})") + [
                f"const int64_t jb = (r % {blocks}) * {jb};",
                f"const int64_t jn = {dom[last]} - jb < {jb} ? {dom[last]} - jb : {jb};"]

            def per_row(lines: list[str]) -> list[str]:
                return [simd, "for (int64_t j = 0; j < jn; j++) {", f"  const int64_t i{last} = jb + j;"] + \
                    [f"  {line}" for line in lines] + ["}"]

            def over_reduced(lines: list[str], clauses: str = "") -> list[str]:
                return self.loops(reduced, per_row(lines), "")
        else:
            jb, outer = 1, prod(dom[d] for d in kept)
            row = self.decompose(kept, "r") if kept else []

            def per_row(lines: list[str]) -> list[str]:
                return lines

            def over_reduced(lines: list[str], clauses: str = "") -> list[str]:
                return self.loops(reduced, lines, _pragma_simd(self.s, clauses))

        def declare(name: RowVar, ctype: str) -> str:
            """A per-row variable: a scalar, or one slot per column of the block."""
            plain = f"{name.kind}{name.node}"
            row.append(f"{ctype} {plain}[{jb}];" if column else f"{ctype} {plain};")
            return self.value(name)

        for segment in nest.segments:
            if isinstance(segment, RowSegment):
                declare(RowVar("row", segment.node), _ctype(self.g.nodes[segment.node]))
                row += per_row(self.lines(segment.body))
                continue
            clauses, finish = [], []
            for r in segment.reductions:
                ct = _ctype(self.g.nodes[r.node])
                acc = declare(RowVar("acc", r.node), ct)
                row += per_row([f"{acc} = {_INIT[r.op]};"])
                red = declare(RowVar("red", r.node), ct)
                if r.op in ("sum", "mean"):
                    finish.append(f"{red} = {self.reduced(r.node, acc + (f' / {count}' if r.op == 'mean' else ''))};")
                else:
                    nan = declare(RowVar("nan", r.node), "int32_t")
                    row += per_row([f"{nan} = 0;"])
                    clauses.append(f" reduction(|:{nan})")
                    finish.append(f"{red} = {nan} ? NAN : {acc};")
                clauses.append(f" reduction({ {'sum': '+', 'mean': '+'}.get(r.op, r.op)}:{acc})")
                finish.append(self.statement(r.store))
            row += over_reduced(self.lines(segment.body), "".join(clauses))
            row += per_row(finish)
        if nest.epilogue is not None:
            row += over_reduced(self.lines(nest.epilogue))
        return self.rows(row, outer) if kept else row

    def reduced(self, node: int, total: str) -> str:
        """A sum's or mean's `total` as the value ops after it read: rounded to its half where eager rounds it
        (ops.eager_rounded: a reduction of the user's), as the stored value is."""
        n = self.g.nodes[node]
        return rounded(total, n.type.dtype) if eager_rounded(n.op, n.params) else total

    def lane_reduction(self) -> list[str]:
        """A column reduction whose SIMD lanes run across whole columns (LoopNest.lane_run): per row
        of the kept outer axes, a pass accumulates one slot per lane over the other reduced axes, a
        column's value is the sum of its lanes (every C-th), computed at the first C lanes and copied
        along the others, and the members over the whole domain run on the lanes again. With one
        row (BatchNorm's statistics), threads split the other reduced axes (OpenMP array reductions)."""
        dom, nest = self.group.domain, self.nest
        lanes = nest.lane_run
        m, width, columns = f"m{lanes[0]}", nest.lanes(lanes[0]), dom[nest.order[-1]]
        outer_kept, others = nest.kept[:-1], [d for d in nest.reduced if d not in lanes]
        rows, steps = prod(dom[d] for d in outer_kept), prod(dom[d] for d in others)
        split = self.parallel(prod(dom), steps) if rows == 1 else ""
        row = self.decompose(outer_kept, "r")

        def per_column(lines: list[str]) -> list[str]:
            return [f"for (int64_t {m} = 0; {m} < {columns}; {m}++) {{"] + [f"  {line}" for line in lines] + ["}"]

        def copied(names: list[str]) -> list[str]:
            return [f"for (int64_t {m} = {columns}; {m} < {width}; {m}++) {{"] + \
                [f"  {name}[{m}] = {name}[{m} - {columns}];" for name in names] + ["}"]

        def over_lanes(lines: list[str], clauses: str = "") -> list[str]:
            lane_loop = self.loops(list(lanes), lines, _pragma_simd(self.s))
            return ([split + clauses] if split else []) + [f"for (int64_t q = 0; q < {steps}; q++) {{"] + \
                [f"  {line}" for line in self.decompose(others, "q") + lane_loop] + ["}"]

        for segment in nest.segments:
            if isinstance(segment, RowSegment):
                name = f"row{segment.node}"
                row += [f"{_ctype(self.g.nodes[segment.node])} {name}[{width}];"] + \
                    per_column(self.lines(segment.body)) + copied([name])
                continue
            clauses, finish, reds = "", [], []
            for r in segment.reductions:
                ct, acc, red = _ctype(self.g.nodes[r.node]), f"acc{r.node}", f"red{r.node}"
                row += [f"{ct} {acc}[{width}];", f"{ct} {red}[{width}];",
                        f"for (int64_t {m} = 0; {m} < {width}; {m}++) {acc}[{m}] = 0;"]
                clauses += f" reduction(+:{acc}[:{width}])"
                mean = f" / {prod(dom[d] for d in nest.reduced)}" if r.op == "mean" else ""
                finish += [f"{ct} {acc}_sum = 0;",
                           f"for (int64_t k = {m}; k < {width}; k += {columns}) {acc}_sum += {acc}[k];",
                           f"{red}[{m}] = {self.reduced(r.node, acc + '_sum' + mean)};", self.statement(r.store)]
                reds.append(red)
            row += over_lanes(self.lines(segment.body), clauses) + per_column(finish) + copied(reds)
        if nest.epilogue is not None:
            row += over_lanes(self.lines(nest.epilogue))
        return self.rows(row, rows) if outer_kept else row

    def rows(self, row: list[str], count: int) -> list[str]:
        """A reduction's code for one row, run for each of `count` rows (in parallel where worth it)."""
        par = self.parallel(prod(self.group.domain), count)
        return ([par] if par else []) + [f"for (int64_t r = 0; r < {count}; r++) {{"] + \
            [f"  {line}" for line in row] + ["}"]

    def gemm(self) -> list[str]:
        """C = A @ B on blocks of rows (BLAS, or micro_kernel on B packed once), each followed by
        the epilogue on that block. Row-major operands are column-major transposes, so sgemm
        computes C^T = B^T A^T."""
        mm, *epilogue = self.group.nodes
        node = self.g.nodes[mm]
        a, b = (self.g.nodes[r.index] for r in node.args[:2])
        batched = len(node.type.shape) == 3
        M, N = node.type.shape[-2:]
        K = a.type.shape[-1]
        generated = self.s.gemm == "generated"
        half_in, half = a.type.dtype in HALF_DTYPES, node.type.dtype in HALF_DTYPES   # a half addmm's product is fp32
        batch = node.type.shape[0] if batched else 1
        pa, pb = self.names[a.index], self.names[b.index]
        sa = a.type.strides[0] if batched else 0
        sb = b.type.strides[0] if batched else 0
        a_strides, b_strides = a.type.strides[-2:], b.type.strides[-2:]
        code = []
        if half_in and not generated:   # sgemm multiplies fp32: the operands widened into row-major copies
            code += self.widen("af", pa, (sa, *a_strides), batch, M, K) + \
                self.widen("bf", pb, (sb, *b_strides), batch, K, N)
            pa, pb, sa, sb, a_strides, b_strides = "af", "bf", M * K, K * N, (K, 1), (N, 1)
        ta, lda = gemm_operand(a_strides, M, K)
        tb, ldb = gemm_operand(b_strides, K, N)
        # blocks of rows let the epilogue run on a block while it is in cache; a library GEMM with
        # no epilogue is one call, as ATen would make it
        br = self.s.gemm_block_rows if epilogue or generated else M
        blocks = -(-M // br)
        # the product written straight into its own buffer, or into fp32 scratch for the epilogue (which
        # stores a half product, rounded, itself)
        keep = mm in self.nest.outputs and not half
        out = node.type.strides
        if keep:
            c_ptr = f"{self.names[mm]} + bi * {out[0] if batched else 0} + r0 * {out[-2]}"
            ldc = out[-2]
        else:
            c_ptr, ldc = "scratch", N
        i_row, i_col = (c_index(e) for e in self.nest.idx[-2:])
        self.gemm_value = f"c[({i_row} - r0) * {ldc} + {i_col}]"
        lines = self.lines(self.nest.body)
        if half and mm in self.nest.outputs:
            offset = " + ".join(f"{_paren(c_index(e))} * {stride}" for e, stride in zip(self.nest.idx, out))
            lines.append(f"{self.names[mm]}[{offset}] = {narrowed(self.gemm_value, node.type.dtype)};")
        epi = self.loops([len(self.nest.idx) - 1], lines, _pragma_simd(self.s))
        # threads only for GEMMs worth a fork (multiply-adds, at 16 per element of a pointwise loop)
        worth = batch * M * N * K >= 16 * self.s.parallel_min_elements
        # ... and with blocks enough to share; else BLAS threads each block itself
        par = "#pragma omp for schedule(static)" if batch * blocks >= 4 and self.s.parallel_axis >= 0 and worth else ""
        if generated:      # B's panels, shared by the threads: allocated before the parallel region
            width, panels = self.panels(N)
            code.append(f"float* restrict bp = tfsn_panels({batch * panels * width * K});")
        code += [
            # serial: no parallel region at all (MKL in an inactive region starts threads per call)
            "#pragma omp parallel" if par else "", "{",
            f"  float* scratch = {'NULL' if keep else f'(float*)malloc(sizeof(float) * {br * N})'};",
            f"  const int n = {N}, k = {K}, lda = {lda}, ldb = {ldb}, ldc = {ldc};",
            "  const float one = 1.0f, zero = 0.0f;",
        ]
        if generated:
            code += [f"  {line}" for line in self.pack_b(pb, b_strides, sb, batch, N, K, par)]
        if par:
            code.append(f"  {par}")
        code += [
            f"  for (int64_t blk = 0; blk < {batch * blocks}; blk++) {{",
            f"    const int64_t bi = blk / {blocks}, r0 = (blk % {blocks}) * {br};",
            f"    const int rows = {M} - r0 < {br} ? (int)({M} - r0) : {br};",
            f"    float* c = {c_ptr};",
        ]
        if generated:
            code.append(f"    const float* restrict bpb = bp + bi * {panels * K * width};")
            code += [f"    {line}" for line in self.micro_kernel(f"{pa} + bi * {sa} + r0 * {a_strides[0]}",
                                                                 a_strides, N, K)]
        else:
            code.append(f"    sgemm_(\"{tb}\", \"{ta}\", &n, &rows, &k, &one, {pb} + bi * {sb}, &ldb, "
                        f"{pa} + bi * {sa} + r0 * {a_strides[0]}, &lda, &zero, c, &ldc);")
        if batched:
            code.append(f"    const int64_t {c_index(self.nest.idx[0])} = bi;")
        code += [f"    for (int64_t {i_row} = r0; {i_row} < r0 + rows; {i_row}++) {{"] + \
            [f"      {line}" for line in epi] + ["    }", "  }", "  free(scratch);", "}"]
        return code + (["free(af);", "free(bf);"] if half_in and not generated else [])

    def operand_dtype(self) -> str:
        """The dtype of the GEMM's operands (both the same: ir.classify)."""
        return self.g.nodes[self.g.nodes[self.group.nodes[0]].args[0].index].type.dtype

    def widen(self, copy: str, src: str, strides: Sequence[int], batch: int, rows: int, cols: int) -> list[str]:
        """A half operand (batch, rows, cols at `strides`) as a row-major fp32 copy named `copy`."""
        dtype = self.operand_dtype()
        element = f"{src}[bi * {strides[0]} + i * {strides[1]} + j * {strides[2]}]"
        return [f"float* restrict {copy} = (float*)malloc(sizeof(float) * {batch * rows * cols});",
                f"for (int64_t bi = 0; bi < {batch}; bi++) for (int64_t i = 0; i < {rows}; i++)",
                f"  for (int64_t j = 0; j < {cols}; j++) {copy}[(bi * {rows} + i) * {cols} + j] = "
                f"{widened(element, dtype)};"]

    def micro_kernel(self, a: str, sa: Sequence[int], N: int, K: int) -> list[str]:
        """Our own GEMM for one block of `rows` rows of A into c, B already packed in `bp` (see
        pack_b): for each cache tile of depth kc and each panel of W columns, register tiles of
        mr rows x W columns, W = nr rounded up to whole vectors. The accumulators are named vector
        variables (GCC vector extensions), so they live in registers and each depth step is mr
        broadcasts, W / vw loads of B and mr * W / vw multiply-adds. A tile past the last row
        repeats the last row and one past the last column reads B's zero padding: every tile runs
        the same full-vector code, and only its store is cut to the block."""
        mr, vw, kc = self.s.gemm_mr, self.s.vector_width, self.s.gemm_kc
        width, panels = self.panels(N)
        nv = width // vw
        dtype = self.operand_dtype()
        element = BUFFER_CTYPES[dtype]
        vec = f"tfsn_v{vw}"
        accs = [f"c{ii}_{v}" for ii in range(mr) for v in range(nv)]
        step = [f"      const {vec} b{v} = *(const {vec}*)(b + k * {width} + {v * vw});" for v in range(nv)]
        for ii in range(mr):
            step.append(f"      const float x{ii} = {widened(f'a{ii}[k * {sa[1]}]', dtype)};")
            step += [f"      c{ii}_{v} += x{ii} * b{v};" for v in range(nv)]
        store_full = [f"      {{ {vec}* o = ({vec}*)(c + (i + {ii}) * ldc + j + {v * vw}); "
                      f"if (kk == 0) *o = c{ii}_{v}; else *o += c{ii}_{v}; }}" for ii in range(mr) for v in range(nv)]
        store_edge = [f"      float t[{mr}][{width}];"] + \
            [f"      *({vec}*)&t[{ii}][{v * vw}] = c{ii}_{v};" for ii in range(mr) for v in range(nv)] + \
            ["      for (int ii = 0; ii < mn; ii++) for (int64_t jj = 0; jj < nn; jj++)",
             "        c[(i + ii) * ldc + j + jj] = kk == 0 ? t[ii][jj] : c[(i + ii) * ldc + j + jj] + t[ii][jj];"]
        return [
            f"const {element}* restrict A = {a};",
            f"for (int64_t kk = 0; kk < {K}; kk += {kc}) {{",
            f"  const int64_t kn = {K} - kk < {kc} ? {K} - kk : {kc};",
            f"  for (int64_t jp = 0; jp < {panels}; jp++) {{",
            f"    const float* restrict b = bpb + (jp * {K} + kk) * {width};",
            f"    const int64_t j = jp * {width}, nn = {N} - j < {width} ? {N} - j : {width};",
            f"    for (int64_t i = 0; i < rows; i += {mr}) {{",
            f"      const int mn = rows - i < {mr} ? (int)(rows - i) : {mr};",
            *[f"      const {element}* restrict a{ii} = A + {f'(mn > {ii} ? i + {ii} : i)' if ii else 'i'} * {sa[0]}"
              f" + kk * {sa[1]};" for ii in range(mr)],
            f"      {vec} {' = {0}, '.join(accs)} = {{0}};",
            "      for (int64_t k = 0; k < kn; k++) {",
            *step,
            "      }",
            f"      if (mn == {mr} && nn == {width}) {{",
            *store_full,
            "      } else {",
            *store_edge,
            "      }",
            "    }", "  }", "}",
        ]

    def panels(self, N: int) -> tuple[int, int]:
        """The generated GEMM's B panels: their width W (gemm_nr rounded up to whole vectors) and
        how many cover N columns."""
        vw = self.s.vector_width
        width = -(-self.s.gemm_nr // vw) * vw
        return width, -(-N // width)

    def pack_b(self, b: str, sb: Sequence[int], sbatch: int, batch: int, N: int, K: int, par: str) -> list[str]:
        """B of every batch into panels of W contiguous columns (W as in micro_kernel), zero past
        the last column: the micro-kernel then reads B in one stream. Read along B's contiguous
        axis (its rows when B is a transposed weight), the panels shared by all threads."""
        width, panels = self.panels(N)
        src = f"{b}[bi * {sbatch} + kq * {sb[0]} + jx * {sb[1]}]"
        dst = f"bp[((bi * {panels} + jp) * {K} + kq) * {width} + jj]"
        inner = ([f"  for (int64_t jj = 0; jj < {width}; jj++) for (int64_t kq = 0; kq < {K}; kq++) {{"]
                 if sb[0] == 1 and sb[1] != 1 else
                 [f"  for (int64_t kq = 0; kq < {K}; kq++) for (int64_t jj = 0; jj < {width}; jj++) {{"])
        return ([par] if par else []) + (
                [f"for (int64_t pj = 0; pj < {batch * panels}; pj++) {{",
                 f"  const int64_t bi = pj / {panels}, jp = pj % {panels};"] + inner +
                [f"    const int64_t jx = jp * {width} + jj;",
                 f"    {dst} = jx < {N} ? {widened(src, self.operand_dtype())} : 0.0f;",
                 "  }", "}"])


def write_source(graph: Graph, groups: Sequence[Group], buffers: set[int], schedules: Sequence[Schedule],
                 inplace: dict[int, int] | None = None) -> tuple[str, list[Kernel | None]]:
    """One C file for a whole graph (one compile, one shared object); None for extern groups (but an
    attention whose schedule says "generated": codegen/c_attention.py).
    `inplace` (member -> graph input) are values written over an input instead of a buffer of their own."""
    from optimizer.codegen import c_attention       # it subclasses Kernel
    kernels: list[Kernel | None] = []
    for i, (group, schedule) in enumerate(zip(groups, schedules)):
        kernels.append(c_attention.write(graph, graph.nodes[group.nodes[0]], schedule, f"k{i}")
                       if group.kind == "extern" else
                       KernelWriter(graph, group, buffers, schedule, f"k{i}", inplace).write())
    return library_source(kernels), kernels


def library_source(kernels: Sequence[Kernel | None]) -> str:
    """The C file of these kernels: the prelude once, then each function; a kernel whose code is an earlier
    one's under another name is an alias of that function. Why: a model's repeated layers give kernels of the
    same code (its forward and backward, each block's), and gcc compiled every copy again (~10% of a small
    model's source, more of a deep one's), its time most of a compile's on a CPU."""
    functions: list[str] = []
    first: dict[str, str] = {}           # a kernel's code with its name left out -> the name it was written under
    for k in kernels:
        if k is None:
            continue
        code = re.sub(rf"\b{re.escape(k.name)}\b", "", k.source)
        if code in first:
            functions.append(f'__typeof__({first[code]}) {k.name} __attribute__((alias("{first[code]}")));\n')
        else:
            first[code] = k.name
            functions.append(k.source)
    return PRELUDE + SIMD_MATH + "\n".join(functions)
