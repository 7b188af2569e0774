"""The schedule: every knob the code generator takes, as one frozen dataclass.

Why data: the next step searches over schedules with a cost model; a schedule must be hashable
(cache key), comparable and copyable, and the generator must take it as a plain parameter.
"""
from __future__ import annotations

from dataclasses import dataclass


VECTOR_WIDTHS = (1, 4, 8, 16)


@dataclass(frozen=True)
class Schedule:
    """How one kernel is laid out in loops. The defaults are the hand-written heuristic."""
    vector_width: int = 16            # fp32 SIMD lanes: 1 = scalar (no vectorizer), 4/8/16 = 128/256/512-bit
                                      # vectors (the function's preferred vector width and omp simd simdlen)
    unroll: int = 1                   # unroll of innermost non-reduction loops (GCC unroll + ivdep in place
                                      # of omp simd, which GCC will not combine with it); 1 = omp simd
    parallel_axis: int = 0            # loop level split across threads: 0 = the outer loop, -1 = serial
    parallel_min_elements: int = 65536  # below this many elements a kernel runs on one thread (ATen: 2 x grain)
    chunk: int = 0                    # OpenMP static chunk in outer iterations; 0 = one block per thread
    column_block: int = 64            # reductions that keep the last axis: columns per block (SIMD across them)
    gemm: str = "library"             # "library" = BLAS sgemm per row block (a GPU: cuBLAS's product, then the
                                      # epilogue's program); "generated" = our micro-kernel (a GPU: tl.dot tiles)
                                      # (the default keeps the library: MKL is near peak on this CPU)
    gemm_block_rows: int = 64         # rows of C per GEMM block: the epilogue runs on a block while in cache
    gemm_mr: int = 4                  # generated GEMM: register tile rows
    gemm_nr: int = 32                 # generated GEMM: register tile columns (a multiple of vector_width)
    gemm_kc: int = 256                # generated GEMM: depth of a cache tile of A and B
    gemm_stages: int = 3              # GPU GEMM: tiles of A and B in flight in shared memory (Triton's
                                      # num_stages; 1: each tile loaded, then multiplied)
    attention: str = "library"        # an attention extern: "library" = ATen's flash attention; "generated" =
                                      # our online-softmax pair (optimizer/attention.py), where timing picks it
    attention_block: int = 64         # generated attention: query and key rows per block (a multiple of 8)
    reduction_split: int = 1          # GPU reduction: slices of the reduced axes run by programs of their own, their
                                      # partial results combined by a second kernel (1: one program per row block)

    def __post_init__(self) -> None:
        if self.vector_width not in VECTOR_WIDTHS:
            raise ValueError(f"Schedule.vector_width is {self.vector_width}; use one of {VECTOR_WIDTHS}")
        if self.gemm not in ("library", "generated"):
            raise ValueError(f"Schedule.gemm is {self.gemm!r}; use 'library' or 'generated'")
        if self.attention not in ("library", "generated"):
            raise ValueError(f"Schedule.attention is {self.attention!r}; use 'library' or 'generated'")
        if self.attention_block % 8:
            raise ValueError(f"Schedule.attention_block is {self.attention_block}; use a multiple of 8 (the "
                             "generated attention's products are tiled in vectors of 8)")
        if self.gemm == "generated" and self.vector_width == 1:
            raise ValueError("Schedule.vector_width is 1 with gemm='generated'; the generated GEMM's register "
                             "tiles are SIMD vectors: use vector_width 4, 8 or 16")
        for knob in ("vector_width", "unroll", "gemm_block_rows", "gemm_mr", "gemm_nr", "gemm_kc", "gemm_stages",
                     "column_block", "attention_block", "reduction_split"):
            if getattr(self, knob) < 1:
                raise ValueError(f"Schedule.{knob} is {getattr(self, knob)}; it must be at least 1")
        if self.parallel_axis not in (0, -1) or self.chunk < 0 or self.parallel_min_elements < 0:
            raise ValueError("Schedule.parallel_axis must be 0 (outer loop) or -1 (serial); chunk and "
                             "parallel_min_elements must be >= 0")


DEFAULT = Schedule()
