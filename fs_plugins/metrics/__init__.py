"""Metrics computed by the clients' evaluation (pure functions over tensors)."""
from fs_plugins.metrics.token import next_token_accuracy  # noqa: F401

# name -> larger is better, for every metric `ClientProcedure.evaluate` reports
REPORTED_METRICS = {'token_acc': True}
