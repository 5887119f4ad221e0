"""HFLB for FedMosaic's PFL-Dynamic (§5 line 183, A.6 line 687, Table 13): nine clients from
seven VQA datasets, four tasks each, written as one normalised multimodal JSONL.

    python -m benchmarks_ext.hflb.prepare --raw RAW --out OUT/hflb.jsonl [--per-task N|all]
        [--test-per-task N|all] [--seed 0] [--images symlink|copy|absolute]

RAW holds gqa/, abstract/, snli_ve/, cocoqa/, nlvr2/, vizwiz/, aqua/ as
benchmarks_ext/hflb/README.md describes. Clients and tasks: `table.py` (Table 13); how a sample
finds its task: `rules.py`.

What the paper does not say, and what is done here instead:
- Which samples each task keeps and how many: every sample its rule assigns (default), capped
  per task with --per-task / --test-per-task (a seeded draw). The paper's total is 314K
  questions for 217K images (Table 12).
- Train / test: each dataset's official splits (GQA train_balanced / testdev_balanced, SNLI-VE
  train / test, NLVR2 train / test1, VizWiz train / val, Abstract train2015 / val2015, COCO-QA
  train / test, AQUA train / test).
- GQA's "Four-choice" client: GQA has no four-option questions; its open ('query') questions
  get three distractors, drawn (seeded per question) from the answers of questions of the same
  GQA detailed type in the same split (then of the same semantic type, then any), listed after
  the question as "Options: a; b; c; d". The answer stays the GQA answer; `choices` lists the
  options. "Two-choice" = GQA 'choose' / 'compare' questions, whose text names both options.
- Task order within a client (PFL-Dynamic arrival order): Table 13's order, through the 't<k>_'
  prefix of pfl_task and fsplug.data.task_order: sorted.
- Prompts: the raw question; SNLI-VE and NLVR2 get a fixed question around their hypothesis /
  statement (readers.py). No single-word answer filter (that is Fed-MoLE's, not FedMosaic's).
"""
from __future__ import annotations

import os
import random
import sys
from collections import defaultdict

if __package__ in (None, ''):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks_ext.common import SPLITS  # noqa: E402
from benchmarks_ext.hflb.pfl_records import TaskPool, base_parser, run_cli, write_benchmark  # noqa: E402
from benchmarks_ext.hflb.readers import LOADERS, README  # noqa: E402
from benchmarks_ext.hflb.rules import TASK_RULES  # noqa: E402
from benchmarks_ext.hflb.table import TABLE_13, HflbClient  # noqa: E402
from fs_plugins.core.seeding import derive_seed  # noqa: E402

BENCHMARK = 'hflb'
KIND = 'vqa'                      # Table 12: HFLB's task type is VQA
FOUR_CHOICE_CLIENT = 'c02_gqa_four_choice'
NUM_OPTIONS = 4
PER_TASK = None                   # default: every assigned sample
TEST_PER_TASK = None


def slug(task_key: str) -> str:
    """'t1_attribute' -> 'attribute' (what the rules return)."""
    return task_key.split('_', 1)[1]


def client_pools(client: HflbClient, candidates: dict[str, list[dict]], seed: int) -> list[TaskPool]:
    """The client's four task pools, each sample placed by the client's rule (or left out)."""
    pools = {slug(task.key): TaskPool(client.name, task, KIND) for task in client.tasks}
    rule = TASK_RULES[client.name]
    for split in SPLITS:
        for c in candidates[split]:
            task = rule(c)
            if task is not None:
                pools[task].candidates[split].append(c)
    if client.name == FOUR_CHOICE_CLIENT:
        for split in SPLITS:
            add_four_choices([p.candidates[split] for p in pools.values()], seed, split)
    return list(pools.values())


def add_four_choices(lists: list[list[dict]], seed: int, split: str) -> None:
    """Replaces each candidate of `lists` by a copy whose question lists four options (see
    the module docstring); distractors come from the answers of all of `lists`."""
    everything = [c for candidates in lists for c in candidates]
    groups = defaultdict(set)
    for c in everything:
        types = c['gqa_types']
        for key in (('detailed', types.get('detailed')), ('semantic', types.get('semantic')), ('all',)):
            groups[key].add(c['answer'])
    ordered = {key: sorted(answers) for key, answers in groups.items()}
    for candidates in lists:
        candidates[:] = [with_options(c, ordered, seed, split) for c in candidates]


def with_options(c: dict, answer_groups: dict, seed: int, split: str) -> dict:
    rng = random.Random(derive_seed(seed, BENCHMARK, 'gqa-options', split, c['raw_id']))
    types = c['gqa_types']
    options = [c['answer']]
    for key in (('detailed', types.get('detailed')), ('semantic', types.get('semantic')), ('all',)):
        options += pick_new(answer_groups[key], NUM_OPTIONS - len(options), set(options), rng)
        if len(options) == NUM_OPTIONS:
            break
    rng.shuffle(options)
    return {**c, 'question': f'{c["question"]}\nOptions: {"; ".join(options)}', 'choices': options}


def pick_new(pool: list[str], count: int, taken: set, rng: random.Random) -> list[str]:
    """Up to `count` items of `pool` not in `taken`, uniformly at random."""
    drawn = rng.sample(pool, min(len(pool), count + len(taken)))
    return [a for a in drawn if a not in taken][:count]


def build_pools(raw: str, seed: int) -> list[TaskPool]:
    """Table 13's clients in order, four task pools each; each dataset is read once (GQA
    serves three clients)."""
    loaded, pools = {}, []
    for client in TABLE_13:
        if client.dataset not in loaded:
            loader = LOADERS[client.dataset]
            loaded[client.dataset] = {split: loader(os.path.join(raw, client.dataset), split) for split in SPLITS}
        pools += client_pools(client, loaded[client.dataset], seed)
    return pools


def prepare(raw: str, out_file: str, seed: int = 0, per_task: int | None = PER_TASK,
            test_per_task: int | None = TEST_PER_TASK, images: str = 'symlink') -> dict:
    """Writes out_file and <out_file stem>_summary.json; returns the summary."""
    return write_benchmark(BENCHMARK, build_pools(raw, seed), out_file, seed,
                           {'train': per_task, 'test': test_per_task}, images, README)


def main(argv=None) -> dict:
    parser = base_parser(' '.join(__doc__.split('\n\n')[0].split()), PER_TASK, TEST_PER_TASK)
    return run_cli(BENCHMARK, parser, argv, prepare, PER_TASK, TEST_PER_TASK)


if __name__ == '__main__':
    main(sys.argv[1:])
