"""Metrics computed by the clients' evaluation (pure functions over tensors)."""
from fs_plugins.metrics.token import next_token_accuracy  # noqa: F401

# name -> larger is better, for every metric `ClientProcedure.evaluate` reports
# ('acc': a sequence classifier's class accuracy, fs_plugins.models.classifier)
REPORTED_METRICS = {'token_acc': True, 'acc': True}


def evaluation_metric_names() -> list[str]:
    """Every test_<metric> a client's evaluation can report (the choices of FS's
    eval.best_res_update_round_wise_key for fsplug runs)."""
    from fs_plugins.metrics.generation_metrics import GENERATION_METRICS
    return ['test_avg_loss'] + [f'test_{name}' for name in list(REPORTED_METRICS) + sorted(GENERATION_METRICS)]
