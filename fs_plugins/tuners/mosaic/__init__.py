"""FedMosaic's adapters: PQ-LoRA (frozen orthonormal A, B; shared P, Q) at block ends and
conventional LoRA elsewhere, each with a frozen global copy mixed in by a learnable gate."""
