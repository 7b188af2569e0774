"""C/OpenMP source for one fused group: a loop nest over the group's domain, the members'
expressions inlined into it, shaped by a Schedule.

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

from optimizer.codegen.c_ops import CTYPES, NONE, POINTWISE, Operand, literal
from optimizer.ir import Graph, Kind, Node, Ref, add_terms, broadcast_index, fold_splits, mul, view_index
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
   -inf. Results below 2.5e-38 flush to 0 (ATen would give that tiny value or a denormal). */
static inline __attribute__((always_inline)) float tfsn_expf(float x) {
  const float hi = 88.72283935f, lo = -86.6f;
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
  const int32_t bits = ((int32_t)n + 126) << 23;      /* 2^(n-1): 2^128 itself is no float */
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  float y = p * scale * 2.0f;
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


MERGE_BELOW = 1024      # an innermost loop shorter than this takes in the next axis where memory allows (merge)
_UNFOLDED = re.compile(r"\bm\d+\)?[/%]")     # a merged loop's index still divided in some offset


class NotFusable(Exception):
    """The group as given cannot be one loop nest (a member read at another index, ...)."""


@dataclass(frozen=True)
class Group:
    """One step of the program: a fused kernel, a GEMM with its epilogue, or one extern call.
    This is the fusion decision as data: the search of the next issue rewrites lists of these."""
    kind: str                        # "kernel" | "gemm" | "extern"
    nodes: tuple[int, ...]           # members in topological order (a gemm's first is its matmul)
    domain: tuple[int, ...] = ()     # the loop nest's shape
    reduced: tuple[int, ...] = ()    # axes of the domain that reductions sum over (kernel only)


@dataclass(frozen=True)
class Kernel:
    name: str
    source: str
    params: tuple[int, ...]          # node indices whose buffers are the C function's arguments, in order
    outputs: tuple[int, ...]         # the members this kernel writes


def row_shapes(domain: tuple[int, ...], reduced: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Shapes of a per-row value of a reduction group (reduced axes as 1, or dropped)."""
    if not reduced:
        return ()
    return (tuple(1 if d in reduced else n for d, n in enumerate(domain)),
            tuple(n for d, n in enumerate(domain) if d not in reduced))


def _ctype(node: Node) -> str:
    return CTYPES[node.type.dtype]


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


def _offset(node: Node, idx: Sequence[str]) -> str:
    t = node.type
    return add_terms([mul(e, s) for e, s in fold_splits([(e, s) for e, s, n in zip(idx, t.strides, t.shape) if n != 1])])


def _pragma_simd(s: Schedule, clauses: str = "") -> str:
    if s.vector_width == 1:       # scalar: the function is compiled without the vectorizer
        return f"#pragma GCC unroll {s.unroll}" if s.unroll > 1 and not clauses else ""
    if s.unroll > 1 and not clauses:
        # GCC takes no unroll pragma next to `omp simd`; ivdep keeps the vectorizer's licence
        return f"#pragma GCC ivdep\n#pragma GCC unroll {s.unroll}"
    simdlen = f" simdlen({s.vector_width})" if s.vector_width > 1 else ""
    return f"#pragma omp simd{simdlen}{clauses}"


def _attributes(s: Schedule) -> str:
    """The vector width as the function's own compile options: no vectorizer, or a preferred width
    (x86 only: TFSN_WIDTH is empty elsewhere, where simdlen alone asks for the width)."""
    if s.vector_width == 1:
        return '__attribute__((optimize("no-tree-vectorize"))) '
    return f"TFSN_WIDTH({32 * s.vector_width}) "


class KernelWriter:
    """Writes one group as a C function. Raises NotFusable when the group cannot be one loop nest."""

    def __init__(self, graph: Graph, group: Group, buffers: set[int], schedule: Schedule, name: str,
                 inplace: dict[int, int] | None = None) -> None:
        self.g, self.group, self.buffers, self.s, self.name = graph, group, buffers, schedule, name
        self.inplace = inplace or {}              # member -> the graph input its value is written over
        self.members = set(group.nodes)
        self.targets = {i for n, i in self.inplace.items() if n in self.members}
        self.order = self.memory_order()          # the domain's axes, outermost first, as loops nest them
        self.merging = True
        self.reset()

    def reset(self) -> None:
        """The state of one writing of the group (write() may write it twice, see there)."""
        self.written: set[int] = set()            # inputs this body has already written over
        self.runs: dict[int, tuple[int, ...]] = {}    # axes run by one loop: its outermost axis -> the axes
        self.params: dict[int, str] = {}
        self.outputs: list[int] = []
        self.lines: list[str] = []
        self.cse: dict[tuple, str] = {}
        self.locals: dict[int, str] = {}          # members already computed at the current index
        self.row: dict[int, str] = {}             # per-row values (reductions, mean, rstd) of the current row
        self.idx: tuple[str, ...] = tuple(f"i{d}" for d in range(len(self.group.domain)))
        self.gemm_value: str | None = None
        self.tmp = 0
        self.prologue: list[str] = []             # loop-invariant values (scalars), computed once
        self.hoisted: dict[tuple, str] = {}
        self.loads: list[tuple[int, str]] = []    # (buffer, offset expression) of every load: the cost model's
                                                  # view of the access pattern

    # ---- values ----
    def param(self, n: int, output: bool = False) -> str:
        if n not in self.params:
            self.params[n] = f"p{len(self.params)}"
        if output and n not in self.outputs:
            self.outputs.append(n)
        return self.params[n]

    def emit(self, ctype: str, expr: str, hoist: bool = False) -> str:
        self.tmp += 1
        (self.prologue if hoist else self.lines).append(f"const {ctype} t{self.tmp} = {expr};")
        return f"t{self.tmp}"

    def is_row_value(self, node: Node) -> bool:
        return node.type.shape != self.group.domain and \
            node.type.shape in row_shapes(self.group.domain, self.group.reduced)

    def row_index(self, node: Node) -> tuple[str, ...]:
        """The index at which a per-row member's value belongs to the current row."""
        red = self.group.reduced
        if len(node.type.shape) == len(self.idx):
            return tuple("0" if d in red else e for d, e in enumerate(self.idx))
        return tuple(e for d, e in enumerate(self.idx) if d not in red)

    def load(self, n: int, idx: tuple[str, ...]) -> str:
        key = (n, idx)
        if key in self.cse:
            return self.cse[key]
        if key in self.hoisted:
            return self.hoisted[key]
        node = self.g.nodes[n]
        # An element at a constant index (a 0-d step count, beta ** step) is the same in every
        # iteration: computed once before the loops, not per element.
        hoist = n not in self.members and all(e.isdigit() for e in idx) and not (
            node.kind in (Kind.POINTWISE, Kind.VIEW) and n not in self.buffers and self.reads(n))
        if n in self.members:
            if n in self.row and idx == self.row_index(node):
                return self.row[n]
            if node.kind == Kind.MATMUL and self.gemm_value is not None and idx == self.idx:
                value = self.emit("float", self.gemm_value)
            elif n in self.locals and idx == self.idx:
                return self.locals[n]
            else:
                raise NotFusable(f"{node.name} is read at another index, or before it is computed")
        elif n in self.buffers or node.kind in (Kind.INPUT, Kind.EXTERN, Kind.MATMUL, Kind.REDUCE):
            offset = _offset(node, idx)
            if n in self.targets and (n in self.written or offset != _offset(node, self.idx)):
                raise NotFusable(f"{node.name} is read after, or elsewhere than, where this kernel writes over it")
            self.loads.append((n, offset))
            value = self.emit(_ctype(node), f"{self.param(n)}[{offset}]", hoist)
        elif node.kind == Kind.VIEW:
            base, base_idx = view_index(self.g, node, idx)
            value = self.load(base, base_idx)
        elif node.kind == Kind.POINTWISE:
            value = self.emit(_value_ctype(node), self.expression(node, idx), hoist)
        else:
            raise NotFusable(f"{node.name} has no value to read")
        (self.hoisted if hoist else self.cse)[key] = value
        return value

    def expression(self, node: Node, idx: tuple[str, ...]) -> str:
        operands = []
        for a in node.args:
            if isinstance(a, Ref):
                src = self.g.nodes[a.index].type
                operands.append(Operand(self.load(a.index, broadcast_index(src.shape, node.type.shape, idx)),
                                        src.dtype, zero_dim=not src.shape))
            elif isinstance(a, (bool, int, float)):
                operands.append(literal(a))
            else:
                operands.append(NONE)
        return POINTWISE[node.op](operands, node.type.dtype, node.kwargs)

    def compute_member(self, n: int) -> None:
        """A pointwise member at the current index: its value, stored to its buffer if it has one."""
        node = self.g.nodes[n]
        if node.kind == Kind.POINTWISE:
            value = self.emit(_value_ctype(node), self.expression(node, self.idx))
        elif node.kind == Kind.REDUCE and not node.params["dims"]:     # of a 0-d tensor: its one element
            value = self.load(node.args[0].index, self.idx)
        else:
            value = self.load(n, self.idx)
        self.locals[n] = value
        if n in self.buffers:
            self.lines.append(self.store(n, self.idx, value))

    def store(self, n: int, idx: tuple[str, ...], value: str) -> str:
        """The C statement that writes member n's value at idx: to its own buffer, or over the graph
        input it replaces (an in-place update: the optimizer's parameters, BatchNorm's running stats)."""
        target = self.inplace.get(n, n)
        if target != n:
            self.written.add(target)
        return f"{self.param(target, output=True)}[{_offset(self.g.nodes[target], idx)}] = {value};"

    # ---- loop nests ----
    def body(self, members: Sequence[int]) -> list[str]:
        self.lines, self.cse, self.locals = [], {}, {}
        for n in members:
            self.compute_member(n)
        return self.lines

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
        not change along the SIMD loop are computed once before it. Axes merged by `merge` are one loop."""
        merged = {d for run in self.runs.values() for d in run[1:]}
        nest = [(f"m{d}", prod(self.group.domain[a] for a in self.runs[d])) if d in self.runs
                else (f"i{d}", self.group.domain[d]) for d in dims if d not in merged]
        code = inner
        for k, (var, extent) in enumerate(reversed(nest)):
            head = [simd] if k == 0 and simd else []
            before, code = _invariant(code, var) if k == 0 and simd else ([], code)
            code = before + head + [f"for (int64_t {var} = 0; {var} < {extent}; {var}++) {{"] + \
                [f"  {line}" for line in code] + ["}"]
        return code

    def merge(self, dims: Sequence[int], keep_outer: bool) -> None:
        """Run the innermost of `dims` (outermost first) as one loop while the innermost loop is
        shorter than MERGE_BELOW: a [24, 12, 52, 52] tensor's last two axes are one loop of 2704,
        not 52 loops of 52 (each a SIMD remainder and a loop set-up). The axes' indices become
        divisions of the merged index, which ir.fold_splits takes out of every offset where the
        strides allow; write() checks that it did. `keep_outer`: leave one axis for the outer loop."""
        dom = self.group.domain
        if not self.merging or len(dims) < 2:
            return
        run = [dims[-1]]
        while len(run) < len(dims) - keep_outer and prod(dom[d] for d in run) < MERGE_BELOW:
            outer = dims[len(dims) - 1 - len(run)]
            if self.order.index(outer) != self.order.index(run[0]) - 1:    # not next in memory
                break
            run.insert(0, outer)
        if len(run) < 2:
            return
        var, inner, idx = f"m{run[0]}", 1, list(self.idx)
        for k, d in enumerate(reversed(run)):
            idx[d] = f"({var})%{dom[d]}" if k == 0 else f"{var}/{inner}" if k == len(run) - 1 else \
                f"({var}/{inner})%{dom[d]}"
            inner *= dom[d]
        self.idx = tuple(idx)
        self.runs[run[0]] = tuple(run)

    def memory_order(self) -> tuple[int, ...]:
        """The domain's axes by decreasing stride of the group's main tensor (its first stored member of
        the domain's shape, else the first such tensor it reads), so that the innermost loop walks
        memory: a channels-last activation runs with its channels innermost. The logical order when
        that tensor is laid out in it (the usual case)."""
        dom = self.group.domain
        logical = tuple(range(len(dom)))
        if self.group.kind == "gemm" or len(dom) < 2:
            return logical
        main = next((self.g.nodes[n] for n in self.group.nodes
                     if n in self.buffers and self.g.nodes[n].type.shape == dom), None)
        seen, todo = set(), list(self.group.nodes)
        while main is None and todo:
            node = self.g.nodes[todo.pop(0)]
            for i in node.inputs:
                src = self.g.nodes[i]
                if i in seen or src.type is None:
                    continue
                seen.add(i)
                stored = i in self.buffers or src.kind in (Kind.INPUT, Kind.EXTERN, Kind.MATMUL)
                if stored and src.type.shape == dom and i not in self.members:
                    main = src
                    break
                if src.kind == Kind.POINTWISE and not stored:
                    todo.append(i)
        if main is None:
            return logical
        strides = [main.type.strides[d] if dom[d] != 1 and main.type.strides[d] != 0 else None for d in logical]
        sized = [st for st in strides if st is not None]
        if sized == sorted(sized, reverse=True):
            return logical
        return tuple(sorted(logical, key=lambda d: (strides[d] is not None, -(strides[d] or 0), d)))

    def write(self) -> Kernel:
        code = self.emit_code()
        if self.runs and _UNFOLDED.search("\n".join(code)):    # a merged index still divided: unmerged
            self.merging = False
            self.reset()
            code = self.emit_code()
        args = ", ".join(f"{'' if n in self.outputs else 'const '}{_ctype(self.g.nodes[n])}* restrict {p}"
                         for n, p in self.params.items())
        source = f"{_attributes(self.s)}void {self.name}({args}) {{\n" + "\n".join(f"  {line}" for line in code) + "\n}\n"
        return Kernel(self.name, source, tuple(self.params), tuple(self.outputs))

    @property
    def inner_loop(self) -> tuple[str, int]:
        """The innermost loop's index and length (the SIMD loop): what the cost model reads strides along."""
        dom = self.group.domain
        if not dom:
            return "i0", 1
        if self.group.kind == "gemm":
            return f"i{len(dom) - 1}", dom[-1]
        reduced = self.group.reduced
        inner = self.order[-1] if not reduced or self.order[-1] not in reduced else \
            [d for d in self.order if d in reduced][-1]
        for first, run in self.runs.items():
            if inner in run:
                return f"m{first}", prod(dom[d] for d in run)
        return f"i{inner}", dom[inner]

    def emit_code(self) -> list[str]:
        kind = self.group.kind
        code = self.gemm() if kind == "gemm" else self.reduction() if self.group.reduced else self.pointwise()
        return self.prologue + code

    def pointwise(self) -> list[str]:
        dom = self.group.domain
        if len(dom) > 1:
            self.merge(self.order, keep_outer=True)
        inner = self.body(self.group.nodes)
        if len(dom) == 0:
            return inner
        simd = _pragma_simd(self.s)
        if len(dom) == 1:
            par = self.parallel(dom[0], dom[0])
            return self.loops([0], inner, par.replace("parallel for", "parallel for simd") if par else simd)
        merged = self.runs.get(next(iter(self.runs), None), (self.order[-1],))
        outer_dims = [d for d in self.order if d not in merged]
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
        dom = self.group.domain
        last = self.order[-1]
        column = last not in self.group.reduced
        kept = [d for d in self.order if d not in self.group.reduced]
        reduced = [d for d in self.order if d in self.group.reduced]
        if not column:
            self.merge(reduced, keep_outer=False)
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

        def value(name: str, ctype: str) -> str:
            """A per-row variable: a scalar, or one slot per column of the block."""
            row.append(f"{ctype} {name}[{jb}];" if column else f"{ctype} {name};")
            return f"{name}[j]" if column else name

        self.row = {}
        epilogue: list[int] = []
        for kind, nodes in self.segments(epilogue):
            self.lines, self.cse, self.locals = [], {}, {}
            if kind == "row":
                node = self.g.nodes[nodes[0]]
                var = value(f"row{node.index}", _ctype(node))
                self.lines.append(f"{var} = {self.expression(node, self.row_index(node))};")
                if node.index in self.buffers:
                    self.lines.append(self.store(node.index, self.row_index(node), var))
                row += per_row(self.lines)
                self.row[node.index] = var
                continue
            clauses, finish = [], []
            for n in nodes:
                node = self.g.nodes[n]
                op, ct = node.params["reduce"], _ctype(node)
                init = {"sum": "0", "mean": "0", "max": "-INFINITY", "min": "INFINITY"}[op]
                acc = value(f"acc{n}", ct)
                row += per_row([f"{acc} = {init};"])
                v = self.load(node.args[0].index, self.idx)
                red = value(f"red{n}", ct)
                if op in ("sum", "mean"):
                    self.lines.append(f"{acc} += {v};")
                    finish.append(f"{red} = {acc}{'' if op != 'mean' else f' / {count}'};")
                else:
                    # torch's amax/amin propagate NaN, which a comparison drops: a flag or-ed along
                    # the pass (vectorizes, unlike a NaN test in the comparison that OpenMP's max
                    # reduction would drop again when it combines the SIMD lanes)
                    nan = value(f"nan{n}", "int32_t")
                    row += per_row([f"{nan} = 0;"])
                    self.lines.append(f"{acc} = ({v} {'>' if op == 'max' else '<'} {acc}) ? {v} : {acc};")
                    self.lines.append(f"{nan} |= ({v} != {v});")
                    clauses.append(f" reduction(|:{nan})")
                    finish.append(f"{red} = {nan} ? NAN : {acc};")
                clauses.append(f" reduction({ {'sum': '+', 'mean': '+'}.get(op, op)}:{acc})")
                finish.append(self.store(n, self.row_index(node), red))
                self.row[n] = red
            row += over_reduced(self.lines, "".join(clauses))
            row += per_row(finish)
        if epilogue:
            row += over_reduced(self.body(epilogue))
        if not kept:
            return row
        par = self.parallel(prod(dom), outer)
        return ([par] if par else []) + [f"for (int64_t r = 0; r < {outer}; r++) {{"] + \
            [f"  {line}" for line in row] + ["}"]

    def segments(self, epilogue: list[int]) -> list[tuple[str, list[int]]]:
        """Members in order as row segments: ("pass", reductions sharing one pass over the row) or
        ("row", [a per-row pointwise value]); members over the whole domain go to `epilogue`."""
        out: list[tuple[str, list[int]]] = []
        for n in self.group.nodes:
            node = self.g.nodes[n]
            if node.kind == Kind.REDUCE:
                if out and out[-1][0] == "pass" and not self.reads(n) & set(out[-1][1]):
                    out[-1][1].append(n)
                else:
                    out.append(("pass", [n]))
            elif self.is_row_value(node):
                out.append(("row", [n]))
            else:
                epilogue.append(n)
        return out

    def reads(self, n: int) -> set[int]:
        """Members that node n's inlined expression reads."""
        seen, todo, found = set(), list(self.g.nodes[n].inputs), set()
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if m in self.members:
                found.add(m)
                continue
            node = self.g.nodes[m]
            if node.kind in (Kind.VIEW, Kind.POINTWISE) and m not in self.buffers:
                todo += node.inputs
        return found

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
        ta, lda = gemm_operand(a.type.strides[-2:], M, K)
        tb, ldb = gemm_operand(b.type.strides[-2:], K, N)
        generated = self.s.gemm == "generated"
        # blocks of rows let the epilogue run on a block while it is in cache; a library GEMM with
        # no epilogue is one call, as ATen would make it
        br = self.s.gemm_block_rows if epilogue or generated else M
        blocks = -(-M // br)
        batch = node.type.shape[0] if batched else 1
        pa, pb = self.param(a.index), self.param(b.index)
        keep = mm in self.buffers
        out = node.type.strides
        sa = a.type.strides[0] if batched else 0
        sb = b.type.strides[0] if batched else 0
        if keep:
            c_ptr = f"{self.param(mm, output=True)} + bi * {out[0] if batched else 0} + r0 * {out[-2]}"
            ldc = out[-2]
        else:
            c_ptr, ldc = "scratch", N
        i_row, i_col = self.idx[-2], self.idx[-1]
        self.gemm_value = f"c[({i_row} - r0) * {ldc} + {i_col}]"
        lines = self.body(epilogue) if epilogue else []
        epi = self.loops([len(self.idx) - 1], lines, _pragma_simd(self.s))
        # threads only for GEMMs worth a fork (multiply-adds, at 16 per element of a pointwise loop)
        worth = batch * M * N * K >= 16 * self.s.parallel_min_elements
        # ... and with blocks enough to share; else BLAS threads each block itself
        par = "#pragma omp for schedule(static)" if batch * blocks >= 4 and self.s.parallel_axis >= 0 and worth else ""
        code = []
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
            code += [f"  {line}" for line in self.pack_b(pb, b.type.strides[-2:], sb, batch, N, K, par)]
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
            code += [f"    {line}" for line in self.micro_kernel(f"{pa} + bi * {sa} + r0 * {a.type.strides[-2]}",
                                                                 a.type.strides[-2:], N, K)]
        else:
            code.append(f"    sgemm_(\"{tb}\", \"{ta}\", &n, &rows, &k, &one, {pb} + bi * {sb}, &ldb, "
                        f"{pa} + bi * {sa} + r0 * {a.type.strides[-2]}, &lda, &zero, c, &ldc);")
        if batched:
            code.append(f"    const int64_t {self.idx[0]} = bi;")
        code += [f"    for (int64_t {i_row} = r0; {i_row} < r0 + rows; {i_row}++) {{"] + \
            [f"      {line}" for line in epi] + ["    }", "  }", "  free(scratch);", "}"]
        return code


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
        vec = f"tfsn_v{vw}"
        accs = [f"c{ii}_{v}" for ii in range(mr) for v in range(nv)]
        step = [f"      const {vec} b{v} = *(const {vec}*)(b + k * {width} + {v * vw});" for v in range(nv)]
        for ii in range(mr):
            step.append(f"      const float x{ii} = a{ii}[k * {sa[1]}];")
            step += [f"      c{ii}_{v} += x{ii} * b{v};" for v in range(nv)]
        store_full = [f"      {{ {vec}* o = ({vec}*)(c + (i + {ii}) * ldc + j + {v * vw}); "
                      f"if (kk == 0) *o = c{ii}_{v}; else *o += c{ii}_{v}; }}" for ii in range(mr) for v in range(nv)]
        store_edge = [f"      float t[{mr}][{width}];"] + \
            [f"      *({vec}*)&t[{ii}][{v * vw}] = c{ii}_{v};" for ii in range(mr) for v in range(nv)] + \
            ["      for (int ii = 0; ii < mn; ii++) for (int64_t jj = 0; jj < nn; jj++)",
             "        c[(i + ii) * ldc + j + jj] = kk == 0 ? t[ii][jj] : c[(i + ii) * ldc + j + jj] + t[ii][jj];"]
        return [
            f"const float* restrict A = {a};",
            f"for (int64_t kk = 0; kk < {K}; kk += {kc}) {{",
            f"  const int64_t kn = {K} - kk < {kc} ? {K} - kk : {kc};",
            f"  for (int64_t jp = 0; jp < {panels}; jp++) {{",
            f"    const float* restrict b = bpb + (jp * {K} + kk) * {width};",
            f"    const int64_t j = jp * {width}, nn = {N} - j < {width} ? {N} - j : {width};",
            f"    for (int64_t i = 0; i < rows; i += {mr}) {{",
            f"      const int mn = rows - i < {mr} ? (int)(rows - i) : {mr};",
            *[f"      const float* restrict a{ii} = A + {f'(mn > {ii} ? i + {ii} : i)' if ii else 'i'} * {sa[0]}"
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
                 f"    {dst} = jx < {N} ? {src} : 0.0f;", "  }", "}"])


def gemm_operand(strides: Sequence[int], rows: int, cols: int) -> tuple[str, int]:
    """How BLAS reads a row-major (rows x cols) operand with these strides: ("N", ld) when rows are
    contiguous, ("T", ld) when columns are. NotFusable otherwise (the GEMM stays an ATen call)."""
    s_row, s_col = strides
    if (s_col == 1 or cols == 1) and s_row >= max(cols, 1):
        return "N", max(s_row, cols, 1)
    if (s_row == 1 or rows == 1) and s_col >= max(rows, 1):
        return "T", max(s_col, rows, 1)
    raise NotFusable("GEMM operand with strides BLAS cannot read")


def gemm_fits(graph: Graph, mm: int) -> bool:
    node = graph.nodes[mm]
    a, b = (graph.nodes[r.index] for r in node.args[:2])
    if node.type.strides[-1] != 1 or node.type.strides[-2] < node.type.shape[-1]:
        return False
    M, N = node.type.shape[-2:]
    K = a.type.shape[-1]
    if min(M, N, K) == 0:
        return False
    try:
        gemm_operand(a.type.strides[-2:], M, K)
        gemm_operand(b.type.strides[-2:], K, N)
    except NotFusable:
        return False
    return True


def write_source(graph: Graph, groups: Sequence[Group], buffers: set[int], schedules: Sequence[Schedule],
                 inplace: dict[int, int] | None = None) -> tuple[str, list[Kernel | None]]:
    """One C file for a whole graph (one compile, one shared object); None for extern groups.
    `inplace` (member -> graph input) are values written over an input instead of a buffer of their own."""
    kernels: list[Kernel | None] = []
    for i, (group, schedule) in enumerate(zip(groups, schedules)):
        kernels.append(None if group.kind == "extern" else
                       KernelWriter(graph, group, buffers, schedule, f"k{i}", inplace).write())
    return library_source(kernels), kernels


def library_source(kernels: Sequence[Kernel | None]) -> str:
    """The C file of these kernels: the prelude once, then each function."""
    return PRELUDE + SIMD_MATH + "\n".join(k.source for k in kernels if k is not None)
