"""Generation metrics: VQA normalisation / accuracy, detection IoU, ROUGE-L, the report judge."""
import json
import math
import os
import sys

import pytest

from fs_plugins.metrics.detection import box_iou, detection_iou, format_boxes, parse_boxes, pixel_box_to_scaled
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS, generation_metric
from fs_plugins.metrics.judge import build_prompt, load_template, parse_score, summarise_scores
from fs_plugins.metrics.text import rouge_l
from fs_plugins.metrics.vqa import normalize_answer, vqa_accuracy, vqa_exact_accuracy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts'))
import judge_reports  # noqa: E402


@pytest.mark.parametrize('raw, expected', [
    ('Yes', 'yes'), ('  No. ', 'no'), ('The Dog', 'dog'), ('a red car!', 'red car'), ('an apple', 'apple'),
    ('Two', '2'), ('ten', '10'), ('1,000', '1000'), ('2.5', '2.5'), ('3.', '3'), ("man's", 'mans'),
    ('black-and-white', 'black and white'), ('left/right', 'left right'), ('theater', 'theater'),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_vqa_accuracy_exact_match_after_normalisation():
    predictions = ['Yes.', 'two', 'a cat', 'red car', 'blue']
    references = ['yes', '2', ['dog', 'the cat'], 'red', ['green', 'Blue!']]
    assert vqa_accuracy(predictions, references) == pytest.approx(4 / 5)   # 'red car' != 'red'
    assert math.isnan(vqa_accuracy([], []))
    with pytest.raises(ValueError, match='2 predictions but 1 references'):
        vqa_accuracy(['a', 'b'], ['a'])
    with pytest.raises(ValueError, match='no acceptable answer'):
        vqa_accuracy(['a'], [[]])


def test_vqa_exact_is_strict_apart_from_surrounding_white_space():
    """The paper's exact match: case, articles and punctuation count."""
    predictions = [' yes\n', 'Yes', 'two', 'the cat', 'blue']
    references = ['yes', 'yes', '2', ['dog', 'the cat'], ['green', 'Blue']]
    assert vqa_exact_accuracy(predictions, references) == pytest.approx(2 / 5)
    assert vqa_accuracy(predictions, references) == 1.0
    assert math.isnan(vqa_exact_accuracy([], []))
    with pytest.raises(ValueError, match='no acceptable answer'):
        vqa_exact_accuracy(['a'], [[]])


def test_box_iou_known_values():
    assert box_iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(1 / 3)
    assert box_iou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(1 / 7)
    assert box_iou((0, 0, 4, 4), (1, 1, 3, 3)) == pytest.approx(4 / 16)
    assert box_iou((0, 0, 1, 1), (2, 2, 3, 3)) == 0.0
    assert box_iou((3, 3, 1, 1), (3, 3, 1, 1)) == 0.0      # x2 < x1: empty box


def test_parse_and_format_boxes():
    assert parse_boxes('The box is [100, 200, 300.5, 400].') == [(100, 200, 300.5, 400)]
    assert parse_boxes('(1,2,3,4); [5, 6, 7, 8]') == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert parse_boxes('[1, 2, 3]') == [] and parse_boxes('no box') == []
    assert format_boxes([(100, 100, 500.4, 500), (1, 2, 3, 4)]) == '[100, 100, 500, 500]; [1, 2, 3, 4]'
    assert pixel_box_to_scaled((20, 10, 100, 50), 200, 100) == (100, 100, 500, 500)
    assert pixel_box_to_scaled((-5, 0, 250, 100), 200, 100) == (0, 0, 1000, 1000)   # clamped


def test_detection_iou_mean_with_unparseable_and_multi_box():
    predictions = ['[0, 0, 10, 10]', 'I cannot tell', 'box: (5, 0, 15, 10)', '[0, 0, 10, 10]; [50, 50, 60, 60]',
                   '[0, 0, 10, 10]']
    references = ['[0, 0, 10, 10]', '[0, 0, 10, 10]', [0, 0, 10, 10], [[0, 0, 10, 10]],
                  '[0, 0, 10, 10]; [20, 20, 30, 30]']
    # 1, 0 (unparseable), 1/3, 1/2 (extra box), 1/2 (missing box)
    assert detection_iou(predictions, references) == pytest.approx((1 + 0 + 1 / 3 + 0.5 + 0.5) / 5)
    with pytest.raises(ValueError, match='holds no box'):
        detection_iou(['[0, 0, 1, 1]'], ['nothing'])


def test_rouge_l_known_values():
    # LCS 'the cat on the mat' = 5 of 6 tokens each side -> F = 5/6; 'a b c d' vs 'a c': P 2/4, R 1 -> F 2/3
    assert rouge_l(['the cat sat on the mat'], ['the cat is on the mat']) == pytest.approx(5 / 6)
    assert rouge_l(['the cat sat on the mat', 'a b c d'],
                   ['the cat is on the mat', 'a c']) == pytest.approx((5 / 6 + 2 / 3) / 2)
    assert rouge_l(['a b c d'], [['x y', 'a c']]) == pytest.approx(2 / 3)   # best reference counts
    assert rouge_l(['Same Text.'], ['same text']) == pytest.approx(1.0)


def test_generation_metrics_mapping():
    assert set(GENERATION_METRICS) == {'vqa_acc', 'vqa_exact', 'iou', 'rougeL', 'bleu', 'meteor',
                                       'bertscore_p', 'bertscore_r', 'bertscore_f1',
                                       'mgsm_accuracy', 'pass_at_1', 'execution_accuracy',
                                       'choice_token_acc'}
    assert generation_metric('vqa_acc')(['Yes'], ['yes']) == 1.0
    assert generation_metric('iou')(['[0, 0, 2, 2]'], ['[1, 1, 3, 3]']) == pytest.approx(1 / 7)
    with pytest.raises(KeyError, match='unknown generation metric'):
        generation_metric('cider')


@pytest.mark.parametrize('text, expected', [
    ('Score: 4\nReason: the findings match.', 4), ('**Score:** 3\n**Reason:** ...', 3), ('Score (1-5): 5', 5),
    ('score: 2/5', 2), ('The score is 1.', 1), ('4', 4), ('5/5\nvery close', 5), ('Score: 4.0', 4),
    ('<think>maybe Score: 1</think>\nScore: 5', 5), ('Score: <Score>\nScore: 3', 3),
    ('Score: 10', None), ('Score: 0', None), ('Score: <Score>', None), ('I rate it highly', None), ('', None),
])
def test_parse_judge_score(text, expected):
    assert parse_score(text) == expected


def test_summarise_scores_scales_mean_by_100():
    assert summarise_scores([4, None, 2, 3]) == {'score': 300.0, 'mean': 3.0, 'n': 4, 'n_scored': 3, 'n_missing': 1}
    empty = summarise_scores([None, None])
    assert math.isnan(empty['score']) and empty['n_missing'] == 2


def test_template_fields_and_prompt():
    template = load_template()
    prompt = build_prompt(template, 'No {acute} findings.', ' Lungs clear. ')
    assert 'Generated report: No {acute} findings.' in prompt and 'Reference report: Lungs clear.' in prompt
    assert '1 (poor) to 5 (excellent)' in prompt and 'Score:' in prompt


class CannedJudge:
    """Stands in for ReportJudge: returns fixed judge outputs in order."""

    def __init__(self, outputs):
        self.pending = list(outputs)

    def outputs(self, predictions, references):
        taken, self.pending = self.pending[:len(predictions)], self.pending[len(predictions):]
        return taken


def write_predictions(path, rows):
    with open(path, 'w') as handle:
        handle.writelines(json.dumps(row) + '\n' for row in rows)


def prediction_rows():
    return [{'client': client, 'id': f'{client}{i}', 'question': 'Write the report.',
             'prediction': f'heart size normal {i}', 'reference': 'the heart is normal'}
            for client in ('report', 'other') for i in range(3)]


def test_judge_clients_per_client_with_missing_scores(tmp_path):
    write_predictions(tmp_path / 'p.jsonl', prediction_rows())
    by_client = judge_reports.read_predictions(str(tmp_path / 'p.jsonl'), None)
    judge = CannedJudge(['Score: 4', 'Score: 2\nReason: x', 'gibberish', 'Score: 5', 'Score: 5', 'Score: 5'])
    summary, details = judge_reports.judge_clients(judge, by_client)
    assert summary['report'] == {'score': 300.0, 'mean': 3.0, 'n': 3, 'n_scored': 2, 'n_missing': 1}
    assert summary['other']['score'] == 500.0
    assert [d['score'] for d in details] == [4, 2, None, 5, 5, 5]
    assert judge_reports.read_predictions(str(tmp_path / 'p.jsonl'), ['other']).keys() == {'other'}
    with pytest.raises(SystemExit, match='no predictions for client'):
        judge_reports.read_predictions(str(tmp_path / 'p.jsonl'), ['missing'])


def test_judge_script_with_tiny_random_llama(tmp_path):
    from fs_plugins.models.tiny import ensure_tiny_llama
    write_predictions(tmp_path / 'p.jsonl', prediction_rows())
    summary = judge_reports.main([str(tmp_path / 'p.jsonl'), '--judge-model', ensure_tiny_llama(),
                                  '--clients', 'report', '--batch-size', '2', '--max-new-tokens', '6',
                                  '--out', str(tmp_path / 'judge.json'), '--details', str(tmp_path / 'd.jsonl')])
    result = summary['report']
    assert result['n'] == 3 and result['n_scored'] + result['n_missing'] == 3
    assert math.isnan(result['score']) if result['n_scored'] == 0 else 100 <= result['score'] <= 500
    saved = json.loads((tmp_path / 'judge.json').read_text())['clients']['report']
    assert saved['n_missing'] == result['n_missing']
    assert len((tmp_path / 'd.jsonl').read_text().splitlines()) == 3


def test_judge_uses_the_chat_template_when_there_is_one(tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from fs_plugins.metrics.judge import ReportJudge
    from fs_plugins.models.tiny import ensure_tiny_llama
    model_dir = str(tmp_path / 'chat-model')
    shutil.copytree(ensure_tiny_llama(), model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
                               "not enable_thinking %}<think></think>{% endif %}{% endif %}")
    tokenizer.save_pretrained(model_dir)
    judge = ReportJudge(model_dir, max_new_tokens=2)
    assert judge._model_input('rubric') == '<|user|>rubric<|assistant|><think></think>'
    assert judge.tokenizer.padding_side == 'left'
    assert len(judge.outputs(['a', 'b c d'], ['e', 'f'])) == 2
