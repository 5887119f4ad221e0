"""How an HFLB sample is assigned to one of its client's four tasks (FedMosaic Table 13).

The paper (A.6, line 687; Table 13 caption, line 709) partitions each dataset "using keyword
rules or GPT judgement" and names the tasks, but gives the keywords only for AQUA. Here every
rule is deterministic and needs no model:

- AQUA: the paper's keywords, first match in the table's order ("standing"; "sit"; "wear",
  "hold", "walk", "talk"; else other). Word forms: sit/sits/sitting, wear/wears/wearing, ...
- GQA, COCO-QA, Abstract VQA: the datasets' own question-type annotations (GQA's
  types.semantic, COCO-QA's types.txt, VQA's answer_type), plus attribute keywords for
  Abstract's "other" answers.
- SNLI-VE, NLVR2, VizWiz (GPT judgement in the paper): keyword rules of our own, below. They
  approximate the paper's split; the summary file reports how many samples each task got.

A rule returns the task's slug (TaskSpec.key without its 't<k>_' prefix) or None when the
sample belongs to none of the client's tasks (it is then left out).
"""
from __future__ import annotations

import re


class KeywordRule:
    """The task of a text: the first group, in the order given, with a pattern found in the
    lower-cased text as a whole word (patterns are regular expressions); no match: fallback."""

    def __init__(self, groups: list[tuple[str, list[str]]], fallback: str | None):
        self.groups = [(task, re.compile(r'\b(?:' + '|'.join(patterns) + r')\b')) for task, patterns in groups]
        self.fallback = fallback

    def __call__(self, text: str) -> str | None:
        text = normalise_text(text)
        for task, pattern in self.groups:
            if pattern.search(text):
                return task
        return self.fallback


def normalise_text(text: str) -> str:
    return str(text).lower().replace('\u2019', "'")


# ---------------------------------------------------------------- AQUA (the paper's keywords)
AQUA_RULE = KeywordRule([
    ('standing', ['standing']),
    ('sit', ['sit', 'sits', 'sitting']),
    ('wear_hold_walk_talk', ['wear', 'wears', 'wearing', 'hold', 'holds', 'holding',
                             'walk', 'walks', 'walking', 'talk', 'talks', 'talking']),
], fallback='other')


# ---------------------------------------------------------------- VizWiz (our keywords)
# order matters: "what kind of cereal is this" is food, "what does this say" is OCR; no "can"
# (VizWiz questions often start "can you tell me ...")
VIZWIZ_RULE = KeywordRule([
    ('food_brand_label', ['food', 'foods', 'eat', 'drink', 'drinks', 'flavou?rs?', 'brands?', 'labels?',
                          'products?', 'cans', 'canned', 'tins?', 'box', 'boxes', 'package', 'packages',
                          'bottles?', 'jars?',
                          'soups?', 'cereals?', 'coffee', 'tea', 'milk', 'juice', 'snacks?', 'cand(?:y|ies)',
                          'cookies?', 'chips', 'sauces?', 'spices?', 'seasonings?', 'ingredients?',
                          'expiration', 'expires?', 'nutrition', 'calories', 'meals?', 'dinner', 'frozen',
                          'beer', 'wine', 'soda']),
    ('color_type', ['colou?rs?', 'colou?red', 'types?', 'kinds?', 'patterns?']),
    ('ocr', ['read', 'reads', 'say', 'says', 'said', 'written', 'writing', 'text', 'words?', 'numbers?',
             'titles?', 'screen', 'display', 'page', 'letters?', 'signs?', 'printed', 'time', 'date',
             'address', 'phone']),
], fallback='general_object')


# ---------------------------------------------------------------- SNLI-VE (our keywords)
# on the hypothesis: mental states, intentions and social relations need commonsense; then the
# place or the spatial relation; then a progressive verb ("is running"); else the objects
SNLI_VE_RULE = KeywordRule([
    ('commonsense', ['happy', 'sad', 'angry', 'upset', 'tired', 'bored', 'excited', 'scared', 'afraid',
                     'lonely', 'proud', 'nervous', 'hungry', 'enjoy(?:s|ing)?', 'loves?', 'likes?',
                     'wants?', 'hoping', 'trying', 'about to', 'waiting', 'because', 'going to',
                     'friends?', 'family', 'married', 'wife', 'husband', 'mother', 'father', 'sons?',
                     'daughters?', 'brothers?', 'sisters?', 'couple', 'celebrat(?:e|es|ing)',
                     'birthday', 'vacation', 'professional', 'first time']),
    ('scene_relations', ['outside', 'outdoors', 'inside', 'indoors', 'streets?', 'roads?', 'city',
                         'beach', 'ocean', 'lake', 'river', 'water', 'pool', 'park', 'field', 'grass',
                         'snow', 'mountains?', 'forest', 'woods', 'desert', 'stage', 'restaurant',
                         'stores?', 'shop', 'market', 'kitchen', 'room', 'house', 'home', 'building',
                         'office', 'church', 'school', 'stadium', 'crowd', 'sidewalk', 'near', 'next to',
                         'beside', 'behind', 'in front of', 'under', 'above', 'on top of', 'across',
                         'around', 'between']),
    ('action', [r'(?:is|are|was|were)\s+\w+ing']),
], fallback='object_centric')


# ---------------------------------------------------------------- NLVR2 (our keywords)
# NLVR2 sentences refer to "the left image", "each image", ...: those phrases are dropped first,
# so that "left" or "each" only count when they are about the content.
NLVR2_IMAGE_REFERENCE = re.compile(
    r'\b(?:(?:the|each|both|one|either|neither|an?|any|other|the other|one of the)\s+)?'
    r'(?:(?:left|right)(?:\s+and\s+(?:left|right))?\s+)?(?:images?|pictures?|photos?|pics?)'
    r'(?:\s+on\s+the\s+(?:left|right))?\b')
NLVR2_GROUPS = [
    ('presupposition_negation_universal', ['no', 'not', 'none', 'nothing', 'nobody', 'neither', 'nor',
                                           'never', 'without', r"\w+n't", 'all', 'every', 'each',
                                           'only', 'also', 'again', 'another', 'too', 'still']),
    ('spatial_comparative', ['left', 'right', 'above', 'below', 'top', 'bottom', 'behind', 'front',
                             'next to', 'beside', 'near', 'under', 'underneath', 'over', 'inside',
                             'outside', 'between', 'facing', 'towards?', 'away', 'more', 'less', 'fewer',
                             'than', 'same', r'\w+er than', 'larger', 'bigger', 'smaller', 'taller',
                             'shorter', 'higher', 'lower', 'closer', 'farther', 'further']),
    ('coordination_coreference', ['and', 'or', 'both', 'either', 'it', 'its', 'they', 'them', 'their',
                                  'he', 'she', 'his', 'her', 'who', 'which', 'whose', 'each other']),
]
# existential / cardinal statements ("two dogs are lying down") are what is left
NLVR2_KEYWORDS = KeywordRule(NLVR2_GROUPS, fallback='cardinality_existential')


def nlvr2_task(sentence: str) -> str:
    return NLVR2_KEYWORDS(NLVR2_IMAGE_REFERENCE.sub(' ', normalise_text(sentence)))


# ---------------------------------------------------------------- Abstract VQA
ABSTRACT_ATTRIBUTE = KeywordRule([('attribute', ['colou?rs?', 'colou?red', 'shapes?', 'materials?',
                                                 'made of', 'patterns?', 'sizes?', 'kinds?', 'types?',
                                                 'breed', 'texture', 'style'])], fallback='others')
ABSTRACT_ANSWER_TYPES = {'yes/no': 'yes_no', 'number': 'number'}


def abstract_task(candidate: dict) -> str:
    """VQA answer_type yes/no and number are tasks of their own; "other" answers are Attribute
    when the question has an attribute keyword, else Others."""
    answer_type = candidate.get('answer_type') or inferred_answer_type(candidate['answer'])
    return ABSTRACT_ANSWER_TYPES.get(answer_type) or ABSTRACT_ATTRIBUTE(candidate['question'])


def inferred_answer_type(answer: str) -> str:
    """For annotations without answer_type."""
    answer = normalise_text(answer).strip()
    if answer in ('yes', 'no'):
        return 'yes/no'
    return 'number' if answer.isdigit() else 'other'


# ---------------------------------------------------------------- COCO-QA (types.txt)
COCOQA_TYPES = {0: 'object', 1: 'number', 2: 'color', 3: 'location'}


def cocoqa_task(candidate: dict) -> str | None:
    return COCOQA_TYPES.get(candidate['cocoqa_type'])


# ---------------------------------------------------------------- GQA (types in the question files)
YES_NO = ('yes', 'no')
GQA_SEMANTIC_YES_NO = {'attr': 'attribute', 'rel': 'relation', 'obj': 'object', 'global': 'global'}
GQA_SEMANTIC_CHOICE = {'attr': 'attribute', 'rel': 'relation', 'cat': 'category', 'global': 'global'}
GQA_TWO_CHOICE_STRUCTURES = ('choose', 'compare')   # the question names the two options


def gqa_form(candidate: dict) -> str | None:
    """'yes_no', 'two_choice' or 'four_choice' (open 'query' questions; prepare.py adds their
    four options); None for anything else."""
    if normalise_text(candidate['answer']).strip() in YES_NO:
        return 'yes_no'
    structural = candidate['gqa_types'].get('structural')
    if structural in GQA_TWO_CHOICE_STRUCTURES:
        return 'two_choice'
    return 'four_choice' if structural == 'query' else None


def gqa_rule(form: str, semantic_tasks: dict):
    def task_of(candidate: dict) -> str | None:
        if gqa_form(candidate) != form:
            return None
        return semantic_tasks.get(candidate['gqa_types'].get('semantic'))
    return task_of


# ---------------------------------------------------------------- one rule per client of Table 13
TASK_RULES = {
    'c01_gqa_yes_no': gqa_rule('yes_no', GQA_SEMANTIC_YES_NO),
    'c02_gqa_four_choice': gqa_rule('four_choice', GQA_SEMANTIC_CHOICE),
    'c03_gqa_two_choice': gqa_rule('two_choice', GQA_SEMANTIC_CHOICE),
    'c04_abstract': abstract_task,
    'c05_snli_ve': lambda c: SNLI_VE_RULE(c['hypothesis']),
    'c06_cocoqa': cocoqa_task,
    'c07_nlvr2': lambda c: nlvr2_task(c['sentence']),
    'c08_vizwiz': lambda c: VIZWIZ_RULE(c['question']),
    'c09_aqua': lambda c: AQUA_RULE(c['question']),
}
