"""FedMosaic Table 13 (paper line 702-709): HFLB's nine clients, the dataset each one learns
and its four PFL-Dynamic tasks in the paper's order. The one place the client -> dataset ->
task mapping lives; `rules.py` says how a sample is assigned to one of these tasks."""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks_ext.hflb.pfl_records import TaskSpec


@dataclass(frozen=True)
class HflbClient:
    name: str                      # record `client` value; sorts in the paper's client order
    dataset: str                   # raw folder / record `source`
    subset: str                    # the paper's subset of the dataset ('' = all of it)
    tasks: tuple[TaskSpec, ...]    # the paper's four tasks, in its order
    rule: str                      # how samples are assigned to tasks (documentation)


def tasks(*pairs: tuple[str, str]) -> tuple[TaskSpec, ...]:
    return tuple(TaskSpec(f't{i}_{slug}', label) for i, (slug, label) in enumerate(pairs, start=1))


GQA_TASKS_YES_NO = tasks(('attribute', 'Attribute'), ('relation', 'Relation'), ('object', 'Object'),
                         ('global', 'Global'))
GQA_TASKS_CHOICE = tasks(('attribute', 'Attribute'), ('relation', 'Relation'), ('category', 'Category'),
                         ('global', 'Global'))

TABLE_13 = (
    HflbClient('c01_gqa_yes_no', 'gqa', 'Yes/No', GQA_TASKS_YES_NO,
               "yes/no answers; task = the question's GQA semantic type"),
    HflbClient('c02_gqa_four_choice', 'gqa', 'Four-choice', GQA_TASKS_CHOICE,
               'open (query) questions given four options; task = GQA semantic type'),
    HflbClient('c03_gqa_two_choice', 'gqa', 'Two-choice', GQA_TASKS_CHOICE,
               'choose / compare questions (two options in the question); task = GQA semantic type'),
    HflbClient('c04_abstract', 'abstract', '',
               tasks(('attribute', 'Attribute'), ('number', 'Number'), ('yes_no', 'Yes/No'), ('others', 'Others')),
               'VQA answer_type; "other" answers split by attribute keywords'),
    HflbClient('c05_snli_ve', 'snli_ve', '',
               tasks(('action', 'Action'), ('scene_relations', 'Scene Context & Obj Relations'),
                     ('object_centric', 'Object-Centric'), ('commonsense', 'Commonsense')),
               'keyword rule on the hypothesis (the paper: keywords or GPT)'),
    HflbClient('c06_cocoqa', 'cocoqa', '',
               tasks(('object', 'Object'), ('number', 'Number'), ('color', 'Color'), ('location', 'Location')),
               "COCO-QA's own question types (types.txt)"),
    HflbClient('c07_nlvr2', 'nlvr2', '',
               tasks(('presupposition_negation_universal', 'Presupposition Negation Universal'),
                     ('spatial_comparative', 'Spatial Comparative'),
                     ('cardinality_existential', 'Cardinality Existential'),
                     ('coordination_coreference', 'Coordination Coreference')),
               'keyword rule on the sentence (the paper: keywords or GPT)'),
    HflbClient('c08_vizwiz', 'vizwiz', '',
               tasks(('food_brand_label', 'Food, Brand, and Label Identification'),
                     ('color_type', 'Color and Type Identification'),
                     ('ocr', 'Optical Character Recognition'),
                     ('general_object', 'General Object Identification')),
               'keyword rule on the question (the paper: keywords or GPT)'),
    HflbClient('c09_aqua', 'aqua', '',
               tasks(('standing', '"standing" keyword'), ('sit', '"sit" keyword'),
                     ('wear_hold_walk_talk', '"wear", "hold", "walk", "talk" keywords'),
                     ('other', 'Other keywords')),
               "the paper's keywords in the question"),
)
