"""GLUE classification tasks (MNLI, RTE, SST-2, QQP) read from local files, as UniFLoW §4.2 /
Table 4 uses them: each task's training file is the training data and its validation file
(MNLI: the matched one) the test data, since GLUE's test labels are not public.

`data.type` selects a task (nothing is downloaded):

- `glue:<task>@fsplug`: the folder GLUE ships the task in (`MNLI`, `RTE`, `SST-2`, `QQP`) under
  `data.root`;
- `glue:<task>:<folder>@fsplug`: another folder (absolute, or relative to `data.root`);
- `glue_tiny:<task>@fsplug`: a small generated fixture in GLUE's TSV layout, written once to
  `<data.root>/glue_tiny/<GLUE folder>/` (offline tests and the tiny YAML).

A folder holds the two splits as files in GLUE's own TSV layout (`train.tsv`, `dev.tsv`;
MNLI `dev_matched.tsv`), or as `.jsonl` / `.json` / `.csv` / `.parquet` files with the same
stems or Hugging Face's split names (`validation`, `validation_matched`), with GLUE's or
Hugging Face's column names; or it is a Hugging Face `save_to_disk` folder of the task's
`DatasetDict`. Records come out normalised: `sentence` (single-sentence tasks) or `sentence1`
and `sentence2`, `label` (the class id: the index of its name in the task's `labels`, the ids
Hugging Face's `glue` uses), `split` (`train` / `test`) and `id`.
"""
from __future__ import annotations

import csv
import io
import logging
import os
from dataclasses import dataclass

import numpy as np

from fs_plugins.core.errors import ConfigError, DataFileError
from fs_plugins.data.record_files import decoded_text, file_bytes, read_record_file
from fs_plugins.schema.specs import DataSource

logger = logging.getLogger(__name__)

SPLITS = ('train', 'test')
FILE_TYPES = ('.tsv', '.jsonl', '.json', '.csv', '.parquet')
HF_DATASET_DICT = 'dataset_dict.json'   # the marker file of a `DatasetDict.save_to_disk` folder
TINY_FOLDER = 'glue_tiny'


@dataclass(frozen=True)
class GlueTask:
    """One GLUE classification task: its folder, the columns holding its text and label (each
    as the accepted names: GLUE's TSV header first, then Hugging Face's), its label names in
    id order, the file stems of its splits, and the header of GLUE's TSV files (fixtures)."""
    folder: str
    text: tuple[tuple[str, ...], ...]
    label: tuple[str, ...]
    labels: tuple[str, ...]
    test: tuple[str, ...]
    tsv_header: tuple[str, ...]
    tsv_label_ids: bool = False     # GLUE's TSV writes the label as its id (SST-2, QQP)
    train: tuple[str, ...] = ('train',)

    def stems(self, split: str) -> tuple[str, ...]:
        return self.train if split == 'train' else self.test

    @property
    def text_fields(self) -> tuple[str, ...]:
        """The normalised records' text fields."""
        return ('sentence',) if len(self.text) == 1 else ('sentence1', 'sentence2')


_MNLI_HEADER = ('index', 'promptID', 'pairID', 'genre', 'sentence1_binary_parse',
                'sentence2_binary_parse', 'sentence1_parse', 'sentence2_parse', 'sentence1',
                'sentence2', 'label1', 'gold_label')
_MNLI = dict(folder='MNLI', text=(('sentence1', 'premise'), ('sentence2', 'hypothesis')),
             label=('gold_label', 'label'), labels=('entailment', 'neutral', 'contradiction'),
             tsv_header=_MNLI_HEADER)

# task name (data.type) -> definition; register_task adds more
GLUE_TASKS: dict[str, GlueTask] = {
    'mnli': GlueTask(test=('dev_matched', 'validation_matched'), **_MNLI),
    'mnli_mm': GlueTask(test=('dev_mismatched', 'validation_mismatched'), **_MNLI),
    'rte': GlueTask('RTE', (('sentence1',), ('sentence2',)), ('label',),
                    ('entailment', 'not_entailment'), ('dev', 'validation'),
                    ('index', 'sentence1', 'sentence2', 'label')),
    'sst2': GlueTask('SST-2', (('sentence',),), ('label',), ('negative', 'positive'),
                     ('dev', 'validation'), ('sentence', 'label'), tsv_label_ids=True),
    'qqp': GlueTask('QQP', (('question1',), ('question2',)), ('is_duplicate', 'label'),
                    ('not_duplicate', 'duplicate'), ('dev', 'validation'),
                    ('id', 'qid1', 'qid2', 'question1', 'question2', 'is_duplicate'),
                    tsv_label_ids=True),
}




# ------------------------------------------------------------------ data.type
@dataclass(frozen=True)
class GlueSource:
    """What a GLUE data.type names: the task and where its files are."""
    name: str
    task: GlueTask
    folder: str
    tiny: bool = False


def parse_data_type(name: str, root: str) -> GlueSource | None:
    """The GLUE source named by data.type's name part (before '@'), None when it is no GLUE
    one (a record file or builtin dataset)."""
    kind, _, rest = name.partition(':')
    if kind not in ('glue', TINY_FOLDER) or not rest:
        return None
    task_name, _, folder = rest.partition(':')
    if task_name not in GLUE_TASKS:
        raise ConfigError(f"data.type = '{name}': unknown GLUE task '{task_name}'; known: "
                          f"{', '.join(sorted(GLUE_TASKS))}")
    task = GLUE_TASKS[task_name]
    if kind == TINY_FOLDER:
        if folder:
            raise ConfigError(f"data.type = '{name}': {TINY_FOLDER}:<task> takes no folder")
        return GlueSource(task_name, task, os.path.join(root, TINY_FOLDER, task.folder), tiny=True)
    folder = os.path.expanduser(folder or task.folder)
    return GlueSource(task_name, task, folder if os.path.isabs(folder) else os.path.join(root, folder))


def task_of(data: DataSource) -> GlueTask | None:
    """The GLUE task of a run's data, None when its data is not a GLUE task."""
    source = parse_data_type(data.name, data.root)
    return source.task if source else None


# -------------------------------------------------------------------- reading
def load_glue(source: GlueSource, max_train: int = 0) -> list[dict]:
    """The normalised train then test records of a GLUE source (`max_train` > 0: only the
    first that many training records); writes the tiny fixture first if needed."""
    if source.tiny:
        write_tiny_glue(source.folder, source.name)
    records = []
    for split in SPLITS:
        rows, where = read_split(source, split)
        if split == 'train' and max_train:
            rows = rows[:max_train]
        records += normalise(rows, source, split, where)
    logger.info(f"GLUE {source.name} from {source.folder}: "
                + ', '.join(f"{sum(r['split'] == s for r in records)} {s}" for s in SPLITS))
    return records


def read_split(source: GlueSource, split: str) -> tuple[list[dict], str]:
    """(rows as dicts, where they came from) of one split of a task folder."""
    if not os.path.isdir(source.folder):
        raise FileNotFoundError(f"GLUE {source.name}: folder not found: {source.folder} (from "
                                f"data.root and data.type)")
    stems = source.task.stems(split)
    if os.path.isfile(os.path.join(source.folder, HF_DATASET_DICT)):
        return _read_saved_dataset(source.folder, stems, source.name)
    for stem in stems:
        for ext in FILE_TYPES:
            path = os.path.join(source.folder, stem + ext)
            if os.path.isfile(path):
                return READERS[ext](path), path
    raise FileNotFoundError(f"GLUE {source.name}: no {split} file in {source.folder}; looked for "
                            f"{', '.join(s + e for s in stems for e in FILE_TYPES)} or a "
                            f"save_to_disk folder ({HF_DATASET_DICT})")


def _text_lines(path: str) -> io.StringIO:
    """The file's UTF-8 text, to read line by line (csv's newline handling)."""
    return io.StringIO(decoded_text(file_bytes(path), path), newline='')


def _read_tsv(path: str) -> list[dict]:
    """GLUE's TSV layout: a header line, tab-separated fields, no quoting. Lines with fewer
    fields than the header are skipped with a warning, as transformers' GLUE reader does
    for QQP."""
    csv.field_size_limit(1 << 24)
    reader = csv.reader(_text_lines(path), delimiter='\t', quoting=csv.QUOTE_NONE)
    try:
        header = next(reader, None)
        if header is None:
            raise DataFileError(f"Data file {path} is empty: GLUE's TSV layout starts with a "
                                'header line naming the columns')
        rows, short = [], []
        for line_no, fields in enumerate(reader, start=2):
            if len(fields) < len(header):
                short.append(line_no)
                continue
            rows.append(dict(zip(header, fields)))
    except csv.Error as exc:
        raise DataFileError(f'Data file {path}, line {reader.line_num}: {exc}') from None
    if short:
        logger.warning(f"{path}: skipped {len(short)} line(s) with fewer fields than the "
                       f"header (first: line {short[0]})")
    return rows


def _read_csv(path: str) -> list[dict]:
    reader = csv.DictReader(_text_lines(path))
    try:
        return list(reader)
    except csv.Error as exc:
        raise DataFileError(f'Data file {path}, line {reader.line_num}: {exc}') from None


def _read_json(path: str) -> list[dict]:
    return read_record_file(path)


def _read_parquet(path: str) -> list[dict]:
    import pyarrow
    import pyarrow.parquet as pq
    try:
        return pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as exc:
        raise DataFileError(f'Data file {path}: not a readable Parquet file ({exc}); replace '
                            'it, or give the split as .tsv / .jsonl / .json / .csv') from None


READERS = {'.tsv': _read_tsv, '.csv': _read_csv, '.jsonl': _read_json, '.json': _read_json,
           '.parquet': _read_parquet}


def _read_saved_dataset(folder: str, stems: tuple[str, ...], name: str) -> tuple[list[dict], str]:
    from datasets import load_from_disk
    splits = load_from_disk(folder)
    for stem in stems:
        if stem in splits:
            return splits[stem].to_list(), f'{folder} [{stem}]'
    raise FileNotFoundError(f"GLUE {name}: the save_to_disk folder {folder} has no split "
                            f"{' or '.join(stems)} (it has {', '.join(splits)})")


# ---------------------------------------------------------------- normalising
def find_column(columns, accepted: tuple[str, ...], what: str, where: str) -> str:
    """The first of the `accepted` column names present, or an error naming file and column."""
    for name in accepted:
        if name in columns:
            return name
    raise DataFileError(f"{where}: no column {' or '.join(repr(a) for a in accepted)} ({what}); "
                        f"its columns: {', '.join(map(str, columns))}: rename the column")


def normalise(rows: list[dict], source: GlueSource, split: str, where: str) -> list[dict]:
    """GLUE rows -> records {sentence | sentence1, sentence2, label (id), split, id}."""
    if not rows:
        raise DataFileError(f'{where}: no records; add them, or point data.type at another '
                            'folder')
    task, columns = source.task, list(rows[0])
    text = [find_column(columns, accepted, f"{source.name}'s {field}", where)
            for accepted, field in zip(task.text, task.text_fields)]
    label = find_column(columns, task.label, f"{source.name}'s label", where)
    records = []
    for i, row in enumerate(rows):
        place = f'{where}, record {i}'
        record = {field: str(_value(row, column, place))
                  for field, column in zip(task.text_fields, text)}
        record['label'] = label_id(_value(row, label, place), task.labels, place)
        records.append({**record, 'split': split, 'id': f'{source.name}-{split}-{i}'})
    return records


def _value(row: dict, column: str, place: str):
    if column not in row:
        raise DataFileError(f"{place}: no field '{column}' (the first record has it): add it")
    return row[column]


def label_id(value, labels: tuple[str, ...], where: str) -> int:
    """A label's class id: its index in the task's `labels` when given by name, else the id
    itself (an int or a digit string) when in range. Ids come from the task definition, so
    every client maps the same name to the same id whatever order the data comes in."""
    if isinstance(value, str) and value.strip() in labels:
        return labels.index(value.strip())
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or not number.is_integer() \
            or not 0 <= number < len(labels):
        raise DataFileError(f"{where}: label {value!r} is neither one of {list(labels)} nor an "
                            f"id 0..{len(labels) - 1}: correct the record's label")
    return int(number)


# ------------------------------------------------------------------- fixture
_NEUTRAL = ['river', 'stone', 'cloud', 'paper', 'light', 'ocean', 'window', 'garden', 'planet', 'forest',
            'candle', 'bridge', 'winter', 'music', 'table', 'road', 'city', 'valley', 'tower', 'market']
_CUES = ('good great happy bright warm', 'bad awful sad dark cold', 'maybe perhaps often some')


def tiny_corpus() -> list[str]:
    """Every word the fixture uses (the tiny tokenizer's training text)."""
    return [' '.join(_NEUTRAL), *_CUES, 'not the a is was']


def _tiny_texts(rng, n_texts: int, label: int) -> list[str]:
    """Text of one example: mostly the label's cue words in the first sentence (single) or the
    second (pairs, whose second sentence also repeats a word of the first)."""
    cues = _CUES[label % len(_CUES)].split()
    first = [str(w) for w in rng.choice(_NEUTRAL, size=int(rng.integers(2, 5)))]
    marked = [str(w) for w in rng.choice(cues, size=int(rng.integers(2, 4)))]
    if n_texts == 1:
        return [' '.join(rng.permutation(first[:2] + marked).tolist())]
    return [' '.join(first), ' '.join(rng.permutation(marked + first[:1]).tolist())]


def _tiny_row(task: GlueTask, rng, i: int, test: bool) -> list[str]:
    label = int(rng.integers(0, len(task.labels)))
    texts = dict(zip((names[0] for names in task.text), _tiny_texts(rng, len(task.text), label)))
    label_text = str(label) if task.tsv_label_ids else task.labels[label]

    def value(column: str) -> str:   # text, label (MNLI: label1..5 too) or a running number
        if column in texts:
            return texts[column]
        return label_text if column == task.label[0] or column.startswith('label') else str(i)
    return [value(column) for column in _tsv_header(task, test)]


def _tsv_header(task: GlueTask, test: bool) -> tuple[str, ...]:
    """GLUE's header: MNLI's validation files carry label1..label5 before gold_label."""
    if test and 'label1' in task.tsv_header:
        head = task.tsv_header[:task.tsv_header.index('label1')]
        return head + tuple(f'label{k}' for k in range(1, 6)) + task.tsv_header[-1:]
    return task.tsv_header


def write_tiny_glue(folder: str, name: str, n_train: int = 300, n_test: int = 60,
                    seed: int = 0) -> str:
    """Writes task `name`'s train and validation files in GLUE's TSV layout into `folder`
    (kept if already there); labels drawn uniformly, each class with its own cue words."""
    task = GLUE_TASKS[name]
    for split, count in (('train', n_train), ('test', n_test)):
        rng = np.random.default_rng([seed, SPLITS.index(split)])
        path = os.path.join(folder, task.stems(split)[0] + '.tsv')
        if os.path.isfile(path):
            continue
        os.makedirs(folder, exist_ok=True)
        lines = ['\t'.join(_tsv_header(task, split == 'test'))]
        lines += ['\t'.join(_tiny_row(task, rng, i, split == 'test')) for i in range(count)]
        with open(path + '.tmp', 'w', encoding='utf-8') as handle:
            handle.write('\n'.join(lines) + '\n')
        os.replace(path + '.tmp', path)
    return folder
