"""SmartFed's skill-composition tasks (paper Table 4) from local downloads: for each task, its
training set split over N clients and its test set, written as one instruction-record JSONL.

    python -m benchmarks_ext.smartfed.prepare --raw RAW --out data/smartfed
        [--tasks mgsm,doit,gsmhard] [--clients 10] [--partition iid|dirichlet] [--alpha 0.5]
        [--seed 0] [--train-sizes mgsm=N,doit=N,gsmhard=N] [--test-sizes ...]
        [--test-split shard|copy] [--doit-tests RAW/doit/code_tests.jsonl]

| task (file)                       | skills        | train            | test            | metric |
| mgsm (smartfed_mgsm.jsonl)        | Chinese, Math | Math23K          | MGSM, zh subset | mgsm_accuracy |
| doit (smartfed_doit.jsonl)        | Chinese, Code | DoIT code (full) | DoIT code test  | pass_at_1 |
| gsmhard (smartfed_gsmhard.jsonl)  | Math, Code    | MathCodeInstruct | GSM-Hard        | execution_accuracy |

Raw layout, formats and where to get each file: benchmarks_ext/smartfed/README.md. A missing
file stops the script with one line naming it and where it comes from.

Records (fs_plugins/data/instruction.py's format, Alpaca prompt): {"id", "instruction",
"input", "output", "split": "train" | "test", "client": "client_01".."client_NN", "task",
"source", "group" (the non-IID label), plus what the metric needs: "answers" (the reference the
generation metrics read: the answer number as text for mgsm / gsmhard, the test spec
{"test", "entry_point"?, "test_list"?} for doit), "answer_number" (mgsm), "target" and "code"
(gsmhard, PAL's program), "test" / "entry_point" / "test_list" (doit)}. Use them with
`data.type: smartfed_<task>.jsonl@fsplug`, `data.splitter: by_source`,
`fsplug.data.split_field: client`, `fsplug.data.split_from_records: True` (yamls/smartfed/paper_*.yaml).

What the paper (a poster) does not give, and what this script does instead:
- the number of clients and how data is spread: --clients (10) and --partition: `iid` (seeded
  equal shares) or `dirichlet` (label skew, client shares of each `group` ~ Dirichlet(alpha),
  fs_plugins.data.splitters); `group` is our proxy for a problem's kind: Math23K the number of
  operators in its equation, DoIT the length of the reference solution, MathCodeInstruct the
  number of code blocks;
- how the test set meets the clients: `shard` (default) deals it out over the clients, seeded,
  so each question is asked once and the size-weighted mean over clients is the score on the
  whole test set; `copy` gives every client all of it (ids get a -client_NN suffix);
- DoIT's unit tests: DoIT's code test set has none (its own scorer picks among three choices by
  perplexity); pass@1 needs tests, taken from the record's own test / test_list / entry_point
  fields or from --doit-tests (JSON lines keyed by the record's index in code_test.json or its
  id). Test records without tests are left out (counted in the summary); none with tests stops
  the script.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from collections import Counter
from dataclasses import dataclass

if __package__ in (None, ''):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks_ext.common import PrepareError, parse_sizes, subsample, write_summary  # noqa: E402
from benchmarks_ext.smartfed import readers  # noqa: E402
from fs_plugins.core.errors import ConfigError  # noqa: E402
from fs_plugins.core.seeding import derive_seed  # noqa: E402
from fs_plugins.data.multimodal import write_jsonl  # noqa: E402
from fs_plugins.data.splitters import split_dirichlet, split_iid  # noqa: E402

BENCHMARK = 'smartfed'
PARTITIONS = ('iid', 'dirichlet')
TEST_SPLITS = ('shard', 'copy')
CLIENT_FIELD = 'client'


@dataclass(frozen=True)
class Task:
    name: str
    label: str
    skills: tuple[str, str]
    train_source: str
    test_source: str
    metric: str

    @property
    def file(self) -> str:
        return f'{BENCHMARK}_{self.name}.jsonl'


TASKS = {
    'mgsm': Task('mgsm', 'Chinese mathematical reasoning', ('Chinese', 'Math'), 'math23k', 'mgsm_zh',
                 'mgsm_accuracy'),
    'doit': Task('doit', 'Chinese code generation', ('Chinese', 'Code'), 'doit', 'doit', 'pass_at_1'),
    'gsmhard': Task('gsmhard', 'Hard math-word problems', ('Math', 'Code'), 'mathcodeinstruct', 'gsm_hard',
                    'execution_accuracy'),
}


def client_names(count: int) -> list[str]:
    """client_01 .. client_NN: sorted, they are the by_source client ids 1..N."""
    width = max(2, len(str(count)))
    return [f'client_{i:0{width}d}' for i in range(1, count + 1)]


def load_task(task: Task, raw: str, doit_tests: str | None) -> tuple[dict[str, list[dict]], dict]:
    """The task's train and test candidates, and raw counts for the summary."""
    if task.name == 'mgsm':
        train, raw_train = readers.read_math23k(os.path.join(raw, 'math23k'))
        test = readers.read_mgsm_zh(os.path.join(raw, 'mgsm', 'mgsm_zh.tsv'))
        return {'train': train, 'test': test}, {'train': raw_train, 'test': len(test)}
    if task.name == 'gsmhard':
        train, raw_train = readers.read_mathcodeinstruct(os.path.join(raw, 'mathcodeinstruct'))
        test = readers.read_gsm_hard(os.path.join(raw, 'gsm_hard', 'gsmhardv2.jsonl'))
        return {'train': train, 'test': test}, {'train': raw_train, 'test': len(test)}
    folder = os.path.join(raw, 'doit')
    train, raw_train = readers.read_doit(folder, 'train')
    test, raw_test = readers.read_doit(folder, 'test')
    test, untested = attach_doit_tests(test, doit_tests or os.path.join(folder, readers.DOIT_TESTS))
    return {'train': train, 'test': test}, {'train': raw_train, 'test': raw_test, 'test_without_tests': untested}


def attach_doit_tests(test: list[dict], tests_path: str) -> tuple[list[dict], int]:
    """DoIT test candidates with unit tests (their own fields, else --doit-tests), and how many
    had none (left out)."""
    sidecar = readers.read_doit_tests(tests_path) if os.path.isfile(tests_path) else {}
    kept = []
    for candidate in test:
        extra = sidecar.get(f'id:{candidate["raw_id"]}') or sidecar.get(f'index:{candidate["index"]}') or {}
        candidate.update({k: extra[k] for k in readers.TEST_FIELDS if extra.get(k)})
        if readers.doit_test_spec(candidate).keys() & {'test', 'test_list'}:
            kept.append(candidate)
    if not kept:
        if not sidecar:
            raise readers.missing(tests_path, 'doit_tests')
        raise PrepareError(f'doit_tests: {tests_path} matches no record of {readers.DOIT_TEST} '
                           f'(by "index" or "id"; layout: {readers.README})')
    return kept, len(test) - len(kept)


def partition(candidates: list[dict], clients: int, mode: str, alpha: float, seed: int,
              task: str) -> list[list[int]]:
    """Candidate indices per client (fs_plugins.data.splitters, seeded per task)."""
    if len(candidates) < clients:
        raise PrepareError(f'{task}: {len(candidates)} training records for {clients} clients; '
                           f'lower --clients')
    split_seed = derive_seed(seed, BENCHMARK, task, 'partition')
    if mode == 'iid':
        return split_iid(candidates, clients, split_seed)
    try:
        return split_dirichlet(candidates, clients, split_seed, field='group', alpha=alpha, min_size=1)
    except ConfigError as err:
        raise PrepareError(f'{task}: --partition dirichlet --alpha {alpha}: {err}') from err


def deal_test(count: int, clients: int, seed: int, task: str) -> list[int]:
    """The client index of each test candidate: a seeded shuffle dealt out in turn."""
    order = list(range(count))
    random.Random(derive_seed(seed, BENCHMARK, task, 'test')).shuffle(order)
    owner = [0] * count
    for position, index in enumerate(order):
        owner[index] = position % clients
    return owner


def reference(task: Task, candidate: dict) -> list:
    """What the generation metric compares with (the record's "answers")."""
    if task.name == 'doit':
        return [readers.doit_test_spec(candidate)]
    return list(candidate.get('answers') or [])


def to_record(task: Task, candidate: dict, split: str, client: str, suffix: str = '') -> dict:
    source = task.train_source if split == 'train' else task.test_source
    record = {'id': f'{task.name}-{split}-{candidate["raw_id"]}{suffix}',
              'instruction': candidate['instruction'], 'input': candidate.get('input', ''),
              'output': candidate['output'], 'split': split, CLIENT_FIELD: client, 'task': task.name,
              'source': source, 'group': candidate['group']}
    answers = reference(task, candidate) if split == 'test' or task.name != 'doit' else []
    if answers:
        record['answers'] = answers
    skip = {'raw_id', 'index', 'instruction', 'input', 'output', 'group', 'answers'}
    record.update({k: v for k, v in candidate.items() if k not in skip and v is not None})
    return record


def prepare_task(task: Task, raw: str, out: str, clients: int = 10, partition_mode: str = 'iid',
                 alpha: float = 0.5, seed: int = 0, train_size: int | None = None,
                 test_size: int | None = None, test_split: str = 'shard',
                 doit_tests: str | None = None) -> dict:
    """Writes <out>/smartfed_<task>.jsonl and its _summary.json; returns the summary."""
    if partition_mode not in PARTITIONS:
        raise PrepareError(f'--partition: {partition_mode!r} is not one of {PARTITIONS}')
    if test_split not in TEST_SPLITS:
        raise PrepareError(f'--test-split: {test_split!r} is not one of {TEST_SPLITS}')
    if clients < 1:
        raise PrepareError(f'--clients: {clients} (expected at least 1)')
    pools, raw_counts = load_task(task, raw, doit_tests)
    train = subsample(pools['train'], train_size, seed, (BENCHMARK, task.name, 'train'), '--train-sizes')
    test = subsample(pools['test'], test_size, seed, (BENCHMARK, task.name, 'test'), '--test-sizes')
    names = client_names(clients)
    records = []
    for cid, indices in enumerate(partition(train, clients, partition_mode, alpha, seed, task.name)):
        records += [to_record(task, train[i], 'train', names[cid]) for i in indices]
    if test_split == 'copy':
        records += [to_record(task, c, 'test', name, f'-{name}') for name in names for c in test]
    else:
        owners = deal_test(len(test), clients, seed, task.name)
        records += [to_record(task, c, 'test', names[o]) for c, o in zip(test, owners)]
    duplicates = sorted(k for k, n in Counter(r['id'] for r in records).items() if n > 1)
    if duplicates:
        raise PrepareError(f'{task.name}: duplicate record ids {duplicates[:5]} in the raw files')
    records.sort(key=lambda r: (r[CLIENT_FIELD], r['split'] != 'train'))
    path = os.path.join(out, task.file)
    write_jsonl(path, records)
    per_client = {name: {split: sum(r[CLIENT_FIELD] == name and r['split'] == split for r in records)
                         for split in ('train', 'test')} for name in names}
    summary = {'benchmark': BENCHMARK, 'task': task.name, 'label': task.label, 'skills': list(task.skills),
               'train_source': task.train_source, 'test_source': task.test_source, 'metric': task.metric,
               'seed': seed, 'clients': clients, 'partition': partition_mode,
               'alpha': alpha if partition_mode == 'dirichlet' else None, 'test_split': test_split,
               'raw_records': raw_counts, 'usable': {s: len(p) for s, p in pools.items()},
               'written': {'train': len(train), 'test': len(test)}, 'per_client': per_client,
               'groups': dict(sorted(Counter(c['group'] for c in train).items())), 'file': path}
    write_summary(os.path.join(out, f'{BENCHMARK}_{task.name}_summary.json'), summary)
    return summary


def prepare(raw: str, out: str, tasks: list[str] | None = None, **options) -> dict[str, dict]:
    """prepare_task for each task (all three by default); train_sizes / test_sizes: dicts task
    -> size (None = all)."""
    train_sizes = options.pop('train_sizes', None) or {}
    test_sizes = options.pop('test_sizes', None) or {}
    summaries = {}
    for name in tasks or list(TASKS):
        if name not in TASKS:
            raise PrepareError(f'--tasks: {name!r} is not one of {sorted(TASKS)}')
        summaries[name] = prepare_task(TASKS[name], raw, out, train_size=train_sizes.get(name),
                                       test_size=test_sizes.get(name), **options)
    return summaries


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
    parser.add_argument('--raw', required=True, help='folder of the raw downloads (README.md: layout)')
    parser.add_argument('--out', required=True, help='output folder (smartfed_<task>.jsonl)')
    parser.add_argument('--tasks', default=','.join(TASKS), help=f'comma-separated, of {", ".join(TASKS)}')
    parser.add_argument('--clients', type=int, default=10, help='clients the training set is split over (10)')
    parser.add_argument('--partition', default='iid', choices=PARTITIONS,
                        help="iid (default) or dirichlet: label skew over each record's group")
    parser.add_argument('--alpha', type=float, default=0.5, help='Dirichlet concentration (0.5)')
    parser.add_argument('--seed', type=int, default=0, help='seed of every draw (0)')
    defaults = ','.join(f'{t}=all' for t in TASKS)
    parser.add_argument('--train-sizes', help=f'TASK=N subsamples of the training sets (default {defaults})')
    parser.add_argument('--test-sizes', help=f'TASK=N subsamples of the test sets (default {defaults})')
    parser.add_argument('--test-split', default='shard', choices=TEST_SPLITS,
                        help='shard (default): deal the test set out over the clients; copy: every '
                             'client gets all of it')
    parser.add_argument('--doit-tests', help='unit tests of the DoIT test records (default '
                                             'RAW/doit/code_tests.jsonl)')
    return parser


def main(argv=None) -> dict[str, dict]:
    args = build_parser().parse_args(argv)
    try:
        tasks = [t.strip() for t in args.tasks.split(',') if t.strip()]
        everything = dict.fromkeys(TASKS)
        summaries = prepare(args.raw, args.out, tasks, clients=args.clients, partition_mode=args.partition,
                            alpha=args.alpha, seed=args.seed,
                            train_sizes=parse_sizes(args.train_sizes, everything, '--train-sizes'),
                            test_sizes=parse_sizes(args.test_sizes, everything, '--test-sizes'),
                            test_split=args.test_split, doit_tests=args.doit_tests)
    except PrepareError as err:
        raise SystemExit(f'{BENCHMARK}: {err}') from err
    for name, summary in summaries.items():
        print(f'{name}: train {summary["written"]["train"]} (usable {summary["usable"]["train"]}), '
              f'test {summary["written"]["test"]} (usable {summary["usable"]["test"]}) over '
              f'{summary["clients"]} clients -> {summary["file"]}')
    return summaries


if __name__ == '__main__':
    main(sys.argv[1:])
