"""torch's intra-op thread count (OpenMP's and MKL's, which tfsn's generated kernels share) set for a block
and put back after it: the search, the calibration and the plan each measure with the threads the work will
run with, without changing the caller's."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch.set_num_threads(n) inside the block (None or 0: the count as it is), the previous count after."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)
