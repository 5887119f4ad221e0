"""Aggregation maths as pure functions over tensors (no orchestration, no FS import)."""
from fs_plugins.aggregation.average import weighted_average  # noqa: F401
