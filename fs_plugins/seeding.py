"""Seeds derived from the run seed and a purpose, so each random part of a run is
independent of how many random numbers other parts drew (and of the runner)."""
from __future__ import annotations

import hashlib


def derive_seed(seed: int, *tags) -> int:
    """A stable 31-bit seed from the run seed and tags such as ('batches', client_id)."""
    text = '/'.join([str(int(seed))] + [str(t) for t in tags])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], 'little') & 0x7FFFFFFF
