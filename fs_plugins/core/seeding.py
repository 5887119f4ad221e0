"""Seeds derived from the run seed and a purpose, so each random part of a run is
independent of how many random numbers other parts drew (and of the runner)."""
from __future__ import annotations

import hashlib
import os

import torch


def derive_seed(seed: int, *tags) -> int:
    """A stable 31-bit seed from the run seed and tags such as ('batches', client_id)."""
    text = '/'.join([str(int(seed))] + [str(t) for t in tags])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], 'little') & 0x7FFFFFFF


def use_deterministic_algorithms(on: bool) -> None:
    """fsplug.train.deterministic: torch's deterministic kernels (warn-only where an op has
    none), so that the same YAML and seed give bit-identical results. Without it, CPU kernels
    that split reductions over threads (e.g. the MoE experts' index_add) differ in the last bits
    from run to run."""
    if on:
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')   # cuBLAS needs it
    torch.use_deterministic_algorithms(on, warn_only=True)
