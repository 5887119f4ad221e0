"""FedMosaic Table 34 (paper lines 1182-1193): DRAKE's ten clients and the four tasks each one
learns, in the paper's order, with the raw folder each task is read from. Clients 1, 5, 6 learn
visual relation tasks, 7, 8, 9 multi-modal reasoning, 2, 3, 4, 10 VQA (Table 34 caption)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from benchmarks_ext.hflb.pfl_records import TaskSpec

RELATION, REASONING, VQA = 'visual_relation', 'multimodal_reasoning', 'vqa'


@dataclass(frozen=True)
class DrakeTask:
    dataset: str      # the paper's dataset name: RAW/<dataset>/
    subset: str = ''  # the paper's subset name: RAW/<dataset>/<subset>/ ('' = the dataset folder)

    @property
    def folder(self) -> str:
        return os.path.join(self.dataset, self.subset) if self.subset else self.dataset

    @property
    def label(self) -> str:
        return f'{self.dataset}: {self.subset}' if self.subset else self.dataset


@dataclass(frozen=True)
class DrakeClient:
    name: str                     # record `client` value; sorts in the paper's client order
    kind: str                     # record `task` value: the client's task sub-group
    tasks: tuple[DrakeTask, ...]  # in the paper's order

    def specs(self) -> list[tuple[TaskSpec, DrakeTask]]:
        return [(TaskSpec(f't{i}_{slug(task.label)}', task.label), task)
                for i, task in enumerate(self.tasks, start=1)]


def slug(text: str) -> str:
    return re.sub(r'[^a-z0-9]+', '_', text.lower()).strip('_')


T = DrakeTask
TABLE_34 = (
    DrakeClient('c01_visual_relation', RELATION, (T('Fashion200K', 'ClothCombination'), T('FashionIQ'),
                                                  T('VISION', '2_Img'), T('MagicBrush'))),
    DrakeClient('c02_vqa', VQA, (T('Co-Instruct', '2_ImgCompare'), T('SEED-Bench-2', 'KGQA'),
                                 T('IconQA', 'ShortAnswerEasy'), T('WCVQA', 'DishName'))),
    DrakeClient('c03_vqa', VQA, (T('Co-Instruct', 'HowWhat'), T('DVQA'), T('IconQA', 'ShortAnswerHard'),
                                 T('WCVQA', 'ContextDishName'))),
    DrakeClient('c04_vqa', VQA, (T('Co-Instruct', '3_ImgCompare'), T('SEED-Bench-2', 'InstanceQA'),
                                 T('IconQA', 'MultiChoiceEasy'), T('WCVQA', 'AdvContextDishName'))),
    DrakeClient('c05_visual_relation', RELATION, (T('Fashion200K', 'ColorConsistency'), T('NLVR2', 'Subset1'),
                                                  T('VISION', '4_Img'), T('VSR'))),
    DrakeClient('c06_visual_relation', RELATION, (T('Fashion200K', 'StyleConsistency'), T('NLVR2', 'Subset2'),
                                                  T('CIRR'), T('SEED-Bench-2', 'TemporalQA'))),
    DrakeClient('c07_multimodal_reasoning', REASONING, (T('IRFL', 'MetaphorSimileMatching'),
                                                        T('Bongard-HOI', 'ActionDetection'), T('VizWiz'),
                                                        T('MIT-States'))),
    DrakeClient('c08_multimodal_reasoning', REASONING, (T('IRFL', 'FigurativeVerification'),
                                                        T('IRFL', 'IdiomMatching'),
                                                        T('Bongard-OpenWorld', 'ConceptDetection'),
                                                        T('COMICS', 'Dialogue'))),
    DrakeClient('c09_multimodal_reasoning', REASONING, (T('IRFL', 'PhraseSelection'),
                                                        T('Bongard-OpenWorld', 'ConceptQuery'),
                                                        T('Bongard-HOI', 'ConceptQuery'),
                                                        T('Bongard-HOI', 'ActionIncoherence'))),
    DrakeClient('c10_vqa', VQA, (T('Co-Instruct', 'YesNO'), T('TQA'), T('IconQA', 'MultiChoiceHard'),
                                 T('WCVQA', 'Location'))),
)
