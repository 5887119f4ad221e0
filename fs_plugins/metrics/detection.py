"""Detection IoU for box answers written as text.

Box format (what Fed-Med's detection answers contain and what the model is trained to write):
`[x1, y1, x2, y2]` with integers 0..1000, the corners relative to the image width / height
(x1, y1 top-left, x2, y2 bottom-right; 0 = left/top edge, 1000 = right/bottom edge). Several boxes
are separated by "; ". The parser is lenient: round or square brackets, integers or decimals,
any text around the boxes. A box whose x2 <= x1 or y2 <= y1 has zero area (it scores 0).

Score of one sample: boxes are matched one-to-one greedily by descending IoU; the sum of matched
IoUs is divided by max(#predicted, #reference) boxes, so missing or extra boxes cost. With one box
on each side this is the plain IoU. A prediction without any parseable box scores 0.
"""
from __future__ import annotations

import re

from fs_plugins.metrics.vqa import check_lengths

BOX_SCALE = 1000
_NUM = r'\s*(-?\d+(?:\.\d+)?)\s*'
_BOX = re.compile(r'[\[\(]' + ','.join([_NUM] * 4) + r'[\]\)]')

Box = tuple[float, float, float, float]


def parse_boxes(text: str) -> list[Box]:
    return [tuple(float(v) for v in match.groups()) for match in _BOX.finditer(str(text))]


def format_boxes(boxes) -> str:
    """The answer text for boxes already in 0..1000 units."""
    return '; '.join('[' + ', '.join(str(int(round(v))) for v in box) + ']' for box in boxes)


def pixel_box_to_scaled(box, width: int, height: int) -> Box:
    """Pixel corners -> integer corners in 0..BOX_SCALE, clamped to the image."""
    x1, y1, x2, y2 = box
    scale = [BOX_SCALE / width, BOX_SCALE / height] * 2
    return tuple(float(min(BOX_SCALE, max(0, round(v * s)))) for v, s in zip((x1, y1, x2, y2), scale))


def box_area(box: Box) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def box_iou(a: Box, b: Box) -> float:
    inter = box_area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = box_area(a) + box_area(b) - inter
    return inter / union if union > 0 else 0.0


def matched_iou(predicted: list[Box], reference: list[Box]) -> float:
    if not predicted or not reference:
        return 0.0
    pairs = sorted(((box_iou(p, r), i, j) for i, p in enumerate(predicted)
                    for j, r in enumerate(reference)), reverse=True)
    used_pred, used_ref, total = set(), set(), 0.0
    for iou, i, j in pairs:
        if i not in used_pred and j not in used_ref:
            used_pred.add(i)
            used_ref.add(j)
            total += iou
    return total / max(len(predicted), len(reference))


def reference_boxes(reference) -> list[Box]:
    """A reference is answer text, one box (4 numbers) or a list of boxes."""
    if isinstance(reference, str):
        boxes = parse_boxes(reference)
    elif len(reference) == 4 and all(isinstance(v, (int, float)) for v in reference):
        boxes = [tuple(float(v) for v in reference)]
    else:
        boxes = [tuple(float(v) for v in box) for box in reference]
    if not boxes or any(len(box) != 4 for box in boxes):
        raise ValueError(f'reference {reference!r} holds no box [x1, y1, x2, y2]')
    return boxes


def detection_iou(predictions: list[str], references: list) -> float:
    """Mean per-sample IoU in 0..1 (nan without any sample)."""
    check_lengths(predictions, references)
    if not predictions:
        return float('nan')
    scores = [matched_iou(parse_boxes(pred), reference_boxes(ref))
              for pred, ref in zip(predictions, references)]
    return sum(scores) / len(scores)
