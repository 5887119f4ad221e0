"""Fed-Med (Fed-MoLE Table 2/6): three medical clients with different tasks -> <out>/fedmed.jsonl.

    python benchmarks_ext/fedmed/prepare.py --raw RAW --out OUT [--seed 0]
        [--train-sizes vqa=2979,report=6558,detection=6000] [--test-sizes vqa=200,...]
        [--images symlink|copy|absolute] [--keep-multiword]

Clients: vqa (SLAKE English + VQA-RAD, pooled), report (MIMIC-CXR report generation), detection
(RadGenome-ChestCT lesion boxes). RAW holds slake/, vqa_rad/, mimic_cxr/, radgenome/ laid out as
benchmarks_ext/fedmed/README.md describes. Default sizes: Fed-MoLE Table 6.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ''):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks_ext.common import Benchmark, PrepareError, read_csv, read_json, require_file  # noqa: E402
from fs_plugins.metrics.detection import format_boxes, pixel_box_to_scaled  # noqa: E402

README = 'benchmarks_ext/fedmed/README.md'
BENCHMARK = 'fedmed'
TRAIN_SIZES = {'vqa': 2979, 'report': 6558, 'detection': 6000}
TEST_SIZES = {'vqa': 200, 'report': 200, 'detection': 200}
REPORT_QUESTION = 'Write the radiology report for this chest X-ray.'
DETECTION_QUESTION = ('Locate the {label} in this chest CT image. Answer with the bounding box '
                      '[x1, y1, x2, y2] as integers from 0 to 1000 relative to the image width and '
                      'height; separate several boxes with "; ".')
BOX_COLUMNS = ('image', 'label', 'x1', 'y1', 'x2', 'y2')


def load_slake(root: str, split: str) -> list[dict]:
    """SLAKE 1.0 train.json / test.json: [{qid, img_name, question, answer, q_lang, ...}]; images
    in imgs/<img_name>. English questions only."""
    rows = read_json(os.path.join(root, f'{split}.json'), 'slake', README)
    return [{'raw_id': row['qid'], 'image_src': os.path.join(root, 'imgs', row['img_name']),
             'image_rel': row['img_name'], 'question': row['question'].strip(),
             'answer': str(row['answer']).strip(), 'answer_type': row.get('answer_type')}
            for row in rows if row.get('q_lang', 'en') == 'en']


VQA_RAD_JSON = 'VQA_RAD Dataset Public.json'
VQA_RAD_IMAGES = 'VQA_RAD Image Folder'


def load_vqa_rad(root: str, split: str) -> list[dict]:
    """VQA-RAD's one JSON file [{qid, image_name, question, answer, phrase_type, ...}]; a
    phrase_type starting with "test" marks the test questions. Ids use the row index (qid kept as a field)."""
    rows = read_json(os.path.join(root, VQA_RAD_JSON), 'vqa_rad', README)
    return [{'raw_id': i, 'qid': row.get('qid'), 'image_src': os.path.join(root, VQA_RAD_IMAGES, row['image_name']),
             'image_rel': row['image_name'], 'question': str(row['question']).strip(),
             'answer': str(row['answer']).strip(), 'answer_type': row.get('answer_type')}
            for i, row in enumerate(rows)
            if str(row.get('phrase_type', '')).startswith('test') == (split == 'test')]


def load_mimic_cxr(root: str, split: str) -> list[dict]:
    """MIMIC-CXR in R2Gen's annotation.json {train|val|test: [{id, study_id, report, image_path: [..]}]};
    images under images/. The first listed image of a study is used."""
    annotation = read_json(os.path.join(root, 'annotation.json'), 'mimic_cxr', README)
    if split not in annotation:
        raise PrepareError(f'mimic_cxr: {os.path.join(root, "annotation.json")} has no "{split}" list')
    return [{'raw_id': row['id'], 'study_id': row.get('study_id'),
             'image_src': os.path.join(root, 'images', row['image_path'][0]), 'image_rel': row['image_path'][0],
             'question': REPORT_QUESTION, 'answer': row['report'].strip()}
            for row in annotation[split] if row['report'].strip()]


def image_size(path: str, dataset: str) -> tuple[int, int]:
    from PIL import Image
    require_file(path, dataset, README)
    with Image.open(path) as image:
        return image.size


def load_radgenome(root: str, split: str) -> list[dict]:
    """RadGenome-ChestCT boxes exported to 2D: <split>_boxes.csv with columns image,label,x1,y1,x2,y2
    (pixels of the image file under images/). Rows with the same image and label form one record
    whose answer lists all their boxes, scaled to 0..1000."""
    rows = read_csv(os.path.join(root, f'{split}_boxes.csv'), 'radgenome', README, BOX_COLUMNS)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault((row['image'], row['label'].strip()), []).append(i)
    out = []
    for (image, label), indices in groups.items():
        src = os.path.join(root, 'images', image)
        width, height = image_size(src, 'radgenome')
        boxes = [pixel_box_to_scaled([float(rows[i][c]) for c in ('x1', 'y1', 'x2', 'y2')], width, height)
                 for i in indices]
        out.append({'raw_id': indices[0], 'image_src': src, 'image_rel': image,
                    'question': DETECTION_QUESTION.format(label=label), 'answer': format_boxes(boxes),
                    'boxes': [[int(v) for v in box] for box in boxes], 'label': label})
    return out


# client -> (task, [(source, loader)])
CLIENT_SOURCES = {
    'vqa': ('vqa', [('slake', load_slake), ('vqa_rad', load_vqa_rad)]),
    'report': ('report', [('mimic_cxr', load_mimic_cxr)]),
    'detection': ('detection', [('radgenome', load_radgenome)]),
}


FEDMED = Benchmark(BENCHMARK, CLIENT_SOURCES, TRAIN_SIZES, TEST_SIZES, README)
prepare = FEDMED.prepare


def main(argv=None) -> dict:
    return FEDMED.main(argv, __doc__.split('\n')[0])


if __name__ == '__main__':
    main(sys.argv[1:])
