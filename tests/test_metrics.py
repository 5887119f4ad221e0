import math

import torch

from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.metrics.token import answer_token_stats, next_token_accuracy


def test_answer_token_stats_against_a_loop():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 1, IGNORE_INDEX],
                           [IGNORE_INDEX, 4, 4, 0, 6]])
    loss_sum, correct, count = answer_token_stats(logits, labels)
    exp_loss, exp_correct, exp_count = 0.0, 0, 0
    for b in range(2):
        for t in range(1, 5):
            if labels[b, t] == IGNORE_INDEX:
                continue
            logp = torch.log_softmax(logits[b, t - 1], -1)
            exp_loss -= float(logp[labels[b, t]])
            exp_correct += int(logits[b, t - 1].argmax() == labels[b, t])
            exp_count += 1
    assert count == exp_count == 6 and correct == exp_correct
    assert math.isclose(loss_sum, exp_loss, rel_tol=1e-5)
    assert math.isclose(next_token_accuracy(labels, logits), exp_correct / exp_count)


def test_no_answer_tokens_gives_nan():
    labels = torch.full((1, 4), IGNORE_INDEX)
    assert math.isnan(next_token_accuracy(labels, torch.zeros(1, 4, 3)))
