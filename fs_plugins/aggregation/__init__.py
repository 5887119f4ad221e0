"""Aggregation maths as pure functions over tensors (no orchestration, no FS import)."""
from fs_plugins.aggregation.activation import activation_aware_weights  # noqa: F401,E402
from fs_plugins.aggregation.average import weighted_average  # noqa: F401
from fs_plugins.aggregation.distill import ensemble_logits, kd_divergence  # noqa: F401,E402
from fs_plugins.aggregation.eeqa import eeqa_quota  # noqa: F401,E402
from fs_plugins.aggregation.lora import (  # noqa: F401
    fed_a2,
    fed_a2_naive,
    flexlora,
    hetlora_pad,
    hetlora_truncate,
    lora_delta_norm,
)
from fs_plugins.aggregation.mosaic import (  # noqa: F401,E402
    align_a,
    align_b,
    customised_globals,
    pq_block_layers,
    rela_weights,
)
