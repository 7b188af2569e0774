"""The schedule space of one kernel: every combination of the knobs that matter for its kind, as a
`Candidates` table for the cost model. Values are the ones the generator accepts; a knob that does
not apply to a kind is held at the default so that no two rows are the same kernel.
"""
from __future__ import annotations

import itertools

import numpy as np

from optimizer.costmodel import GEMM, REDUCTION, Candidates, KernelFeatures
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
                nr=d.gemm_nr, kc=d.gemm_kc)
    cols = {name: np.array([r.get(name, v) for r in rows], dtype=np.float64) for name, v in base.items()}
    return Candidates(kernel=np.full(len(rows), kernel, dtype=np.int64), **cols)


def _loops() -> list[dict]:
    serial = [dict(vector_width=v, unroll=u, parallel=0, chunk=0) for v in VECTOR_WIDTHS for u in UNROLLS]
    parallel = [dict(vector_width=v, unroll=u, parallel=1, chunk=c)
                for v in VECTOR_WIDTHS for u in UNROLLS for c in CHUNKS]
    return serial + parallel


def kernel_space(kernel: int, features: KernelFeatures) -> Candidates:
    """All candidate schedules of one kernel (index `kernel` in the feature table)."""
    if features.kind == GEMM:
        rows = [dict(generated=0, block_rows=b, parallel=p, vector_width=v, unroll=1)
                for b, p, v in itertools.product(BLOCK_ROWS, (0, 1), VECTOR_WIDTHS)]
        rows += [dict(generated=1, mr=mr, nr=nr, kc=kc, block_rows=b, parallel=p, vector_width=v, unroll=1)
                 for mr, nr, kc, b, p, v in itertools.product(MRS, NRS, KCS, GEN_BLOCK_ROWS, (0, 1),
                                                              GEN_VECTOR_WIDTHS)]
        return _table(kernel, rows)
    rows = _loops()
    if features.kind == REDUCTION and features.columns > 0:
        rows = [dict(r, column_block=b) for r in rows for b in COLUMN_BLOCKS]
    return _table(kernel, rows)
