"""What the benchmarks share: a plain text table."""
from __future__ import annotations

from typing import Any, Sequence


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Columns padded to fit; the first one left-aligned, the others right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
