"""The schedule space of one kernel: every combination of the knobs that matter for its kind, as a
`Candidates` table for the cost model. Values are the ones the generator accepts; a knob that does
not apply to a kind is held at the default so that no two rows are the same kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from optimizer.costmodel import GEMM, GPU_MAX_DEPTH, GPU_REDUCTION_BLOCK, REDUCTION, Candidates, KernelFeatures
from optimizer.schedule import DEFAULT, VECTOR_WIDTHS

UNROLLS = (1, 2, 4, 8, 16)
CHUNKS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)      # 0: one block per thread
COLUMN_BLOCKS = (8, 16, 32, 64, 128)
BLOCK_ROWS = (8, 16, 32, 64, 128, 256, 512)
MRS = (1, 2, 3, 4, 6, 8)
NRS = (8, 16, 32, 48, 64)
KCS = (64, 128, 256, 512)
GEN_BLOCK_ROWS = (16, 32, 64, 128, 256)
GEN_VECTOR_WIDTHS = (4, 8, 16)


def _table(kernel: int, rows: list[dict]) -> Candidates:
    d = DEFAULT
    base = dict(vector_width=d.vector_width, unroll=d.unroll, parallel=1, chunk=d.chunk,
                column_block=d.column_block, generated=0, block_rows=d.gemm_block_rows, mr=d.gemm_mr,
                nr=d.gemm_nr, kc=d.gemm_kc, stages=d.gemm_stages, split=d.reduction_split)
    cols = {name: np.array([r.get(name, v) for r in rows], dtype=np.float64) for name, v in base.items()}
    return Candidates(kernel=np.full(len(rows), kernel, dtype=np.int64), **cols)


def _loops() -> list[dict]:
    serial = [dict(vector_width=v, unroll=u, parallel=0, chunk=0) for v in VECTOR_WIDTHS for u in UNROLLS]
    parallel = [dict(vector_width=v, unroll=u, parallel=1, chunk=c)
                for v in VECTOR_WIDTHS for u in UNROLLS for c in CHUNKS]
    return serial + parallel


def kernel_space(kernel: int, features: KernelFeatures) -> Candidates:
    """All candidate schedules of one kernel (index `kernel` in the feature table)."""
    return _with_kernel(_cpu_template(features.kind, features.kind == REDUCTION and features.columns > 0), kernel)


def _with_kernel(template: Candidates, kernel: int) -> Candidates:
    return dataclasses.replace(template, kernel=np.full(len(template), kernel, dtype=np.int64))


@functools.lru_cache(maxsize=None)
def _cpu_template(kind: int, column: bool) -> Candidates:
    """The space of a kind of kernel: the same for every kernel of that kind, so built once."""
    if kind == GEMM:
        rows = [dict(generated=0, block_rows=b, parallel=p, vector_width=v, unroll=1)
                for b, p, v in itertools.product(BLOCK_ROWS, (0, 1), VECTOR_WIDTHS)]
        rows += [dict(generated=1, mr=mr, nr=nr, kc=kc, block_rows=b, parallel=p, vector_width=v, unroll=1)
                 for mr, nr, kc, b, p, v in itertools.product(MRS, NRS, KCS, GEN_BLOCK_ROWS, (0, 1),
                                                              GEN_VECTOR_WIDTHS)
                 if nr % v == 0]        # the generator rounds nr up to whole vectors: one row per kernel
        return _table(0, rows)
    rows = _loops()
    if column:
        rows = [dict(r, column_block=b) for r in rows for b in COLUMN_BLOCKS]
    return _table(0, rows)


GPU_TILES = (32, 64, 128, 256)
GPU_DEPTHS = (16, 32, GPU_MAX_DEPTH)
GPU_WARPS = (1, 2, 4, 8, 16)
GPU_STAGES = (1, 2, 3, 4)
GPU_ELEMENTS = (256, 512, 1024, 2048, 4096, 8192)
GPU_ROWS = (1, 2, 4, 8, 16)
# the library GEMM's one row: the product by cuBLAS, its epilogue a program per 64 x 64 tile on 4 warps
GPU_LIBRARY_EPILOGUE = dict(block_rows=64, nr=64, kc=GPU_MAX_DEPTH, mr=4, stages=1)


def gpu_kernel_space(kernel: int, features: KernelFeatures) -> Candidates:
    """Candidate launch shapes of one kernel on a GPU, in the columns costmodel.predict_gpu reads:
    BM x BN x BK `tl.dot` tiles, warps and pipeline stages for GEMMs, and the product left to the
    vendor's library (one row); elements or rows per program and warps otherwise."""
    template = _gpu_template(features.kind)
    splits = gpu_splits(features)
    if splits:
        template = Candidates.concat([template] + [dataclasses.replace(template, split=np.full(len(template), float(s)))
                                                   for s in splits])
    return _with_kernel(template, kernel)


# A split reduction (Schedule.reduction_split) is tried where a launch has few row programs for a GPU's SMs and
# their rows are long: fewer rows than SPLIT_ROWS (a column sum's rows are its columns) of at least SPLIT_REDUCED
# elements each; its slices at least a block of GPU_REDUCTION_BLOCK long, and at most that many slices (the
# second kernel combines a row's partials in one block)
GPU_SPLITS = tuple(2 ** i for i in range(1, 11))
SPLIT_ROWS = 8192
SPLIT_REDUCED = 8192


def gpu_splits(features: KernelFeatures) -> tuple[int, ...]:
    """The splits of a reduction's extent worth pricing (none where its nest cannot split)."""
    if features.kind != REDUCTION or features.partials <= 0:
        return ()
    rows = features.rows * features.columns if features.columns > 0 else features.rows
    reduced = features.elements / max(rows, 1.0)
    if rows >= SPLIT_ROWS or reduced < SPLIT_REDUCED:
        return ()
    return tuple(s for s in GPU_SPLITS if s <= GPU_REDUCTION_BLOCK and reduced / s >= GPU_REDUCTION_BLOCK)


@functools.lru_cache(maxsize=None)
def _gpu_template(kind: int) -> Candidates:
    if kind == GEMM:
        rows = [dict(generated=1, block_rows=bm, nr=bn, kc=bk, mr=w, stages=s) for bm, bn, bk, w, s in
                itertools.product(GPU_TILES, GPU_TILES, GPU_DEPTHS, (2, 4, 8), GPU_STAGES)]
        rows.append(dict(generated=0, **GPU_LIBRARY_EPILOGUE))
    else:
        per = GPU_ROWS if kind == REDUCTION else GPU_ELEMENTS
        rows = [dict(chunk=c, mr=w) for c, w in itertools.product(per, GPU_WARPS)]
    return _table(0, rows)


def space_for(spec_kind: str):
    """The space function of a chip kind ("cpu" or "gpu")."""
    return gpu_kernel_space if spec_kind == "gpu" else kernel_space
