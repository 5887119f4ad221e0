"""Metrics computed by the clients' evaluation (pure functions over tensors)."""
from fs_plugins.core import registry
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS  # noqa: F401  (registers them)
from fs_plugins.metrics.token import next_token_accuracy  # noqa: F401

# name -> larger is better, for every metric `ClientProcedure.evaluate` reports
# ('acc': a sequence classifier's class accuracy, fs_plugins.models.classifier)
REPORTED_METRICS = {'token_acc': True, 'acc': True}
for _name, _larger_is_better in REPORTED_METRICS.items():
    registry.REPORTED_METRICS.add(_name, _larger_is_better)
