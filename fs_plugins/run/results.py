"""Per-round, per-client results: JSON lines as they happen, CSV and a summary table.

Both runners write through this class, so their files have the same format. Every row is
flushed when logged: a run that stops mid-way keeps everything up to that point."""
from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from collections.abc import Callable

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.data.stream import last_and_auc
from fs_plugins.models.encoder_llm import modalities

SUMMARY_COLUMNS = ('samples', 'bytes_up', 'bytes_down')
# accuracy columns that also get <name>_auc in the summary: the mean over all evaluations, the
# A_AUC of Koh et al. 2022 beside the last evaluation's A_last (fs_plugins.data.stream)
AUC_OF = 'token_acc'
# a results row's seconds (train_s, extra_s, eval_s, aggregate_s, round_s, ...) and rates
# (tokens_per_s) end in this: they differ from run to run, so runner and resume comparisons
# leave them out (`without_times`)
TIME_SUFFIX = '_s'
SERVER_ID = 0   # the 'client' of a server row: the server's id in FS
TIME_PARTS = ('train', 'extra', 'eval', 'aggregation_wire', 'other')


def payload_bytes(tensors: dict) -> int:
    """Exact size of the tensors in a payload (numel x element size), independent of the
    transport's serialisation."""
    return sum(t.numel() * t.element_size() for t in tensors.values() if torch.is_tensor(t))


class ResultsLog:
    def __init__(self, out_dir: str, run_info: dict, overwrite: bool = False,
                 resume_rows: int | None = None):
        """A directory that already holds results is refused, unless `overwrite` (they are
        replaced) or `resume_rows` (the first that many rows are kept and appended to; later
        ones go to results.superseded.jsonl)."""
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.jsonl_path = os.path.join(out_dir, 'results.jsonl')
        self.csv_path = os.path.join(out_dir, 'results.csv')
        self.summary_path = os.path.join(out_dir, 'summary.md')
        self.rows: list[dict] = []
        if resume_rows is not None:
            self.rows = self._resumed_rows(resume_rows)
        elif not overwrite and os.path.isfile(self.jsonl_path) and os.path.getsize(self.jsonl_path):
            raise ConfigError([f"fsplug.results_dir: {out_dir} already holds a run's results "
                               f"(results.jsonl); choose another directory, replace them with "
                               f"--overwrite (fsplug.overwrite True) or continue that run with "
                               f"--resume {out_dir} (fsplug.checkpoint.resume_from)"])
        # kept open for the log's life: every row is appended and flushed as it comes
        self._jsonl = open(self.jsonl_path, 'a' if resume_rows is not None else 'w',  # noqa: SIM115
                           encoding='utf-8')
        self.run_info = dict(run_info)
        self._write_run_info()
        self.client_names: dict[int, str] = dict(run_info.get('client_names', {}))
        # FS distributed: clients train at the same time, so a round's critical path is its
        # slowest client's (time_split)
        self.clients_in_parallel = clients_in_parallel(run_info)
        self.run_label = run_label(run_info)
        # the method's `client_groups(client_ids) -> {label: [client ids]}` (e.g. FLAME's
        # budget levels): the summary gets one row per group, the mean over its clients
        self.client_groups: Callable[[list[int]], dict[str, list[int]]] | None = None

    def _resumed_rows(self, keep: int) -> list[dict]:
        """The rows up to a checkpoint; the interrupted run's later rows are moved (appended)
        to results.superseded.jsonl, and results.jsonl is rewritten with the kept ones."""
        with open(self.jsonl_path, encoding='utf-8') as handle:
            lines = [line for line in handle if line.strip()]
        if len(lines) < keep:
            raise ValueError(f'{self.jsonl_path} has {len(lines)} rows, fewer than the '
                             f'{keep} its checkpoint counted')
        if lines[keep:]:
            with open(os.path.join(self.out_dir, 'results.superseded.jsonl'), 'a',
                      encoding='utf-8') as handle:
                handle.writelines(lines[keep:])
        tmp = self.jsonl_path + '.tmp'
        with open(tmp, 'w', encoding='utf-8') as handle:
            handle.writelines(lines[:keep])
        os.replace(tmp, self.jsonl_path)
        return [json.loads(line) for line in lines[:keep]]

    def log(self, row: dict) -> None:
        row = {k: (float(v) if isinstance(v, float) else v) for k, v in row.items()}
        self.rows.append(row)
        self._jsonl.write(json.dumps(row) + '\n')
        self._jsonl.flush()

    def log_train(self, round_idx: int, client_id: int, samples: int, bytes_up: int,
                  bytes_down: int, metrics: dict) -> None:
        self.log({'round': round_idx, 'client': client_id, 'kind': 'train', 'samples': samples,
                  'bytes_up': bytes_up, 'bytes_down': bytes_down, **metrics})

    def log_server(self, round_idx: int, times: dict) -> None:
        """The server's row of a round (aggregate_s, encode_s, decode_s, round_s), its last:
        results.csv is rewritten here, once a round (results.jsonl has every row as it comes)."""
        self.log({'round': round_idx, 'client': SERVER_ID, 'kind': 'server', **times})
        self.write_csv()

    def log_rejection(self, round_idx: int, client_id: int, reason: str) -> None:
        self.log({'round': round_idx, 'client': client_id, 'kind': 'rejected', 'reason': reason})

    def log_eval(self, round_idx: int, client_id: int, metrics: dict) -> None:
        self.log({'round': round_idx, 'client': client_id, 'kind': 'eval', **metrics})

    def write_csv(self) -> None:
        columns = list(dict.fromkeys(k for row in self.rows for k in row))
        tmp = self.csv_path + '.tmp'
        with open(tmp, 'w', newline='', encoding='utf-8') as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.csv_path)

    # ------------------------------------------------------------------ summary
    def final_rows(self) -> tuple[list[str], list[dict]]:
        """One row per client: its last evaluation plus its totals; then one row per client
        group (`client_groups`, the mean over its clients); then the average over clients."""
        totals: dict[int, dict] = defaultdict(lambda: dict.fromkeys(SUMMARY_COLUMNS, 0))
        last_eval: dict[int, dict] = {}
        curves: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for row in self.rows:
            if row['kind'] == 'train':
                for key in SUMMARY_COLUMNS:
                    totals[row['client']][key] += row.get(key, 0)
            elif row['kind'] == 'eval':
                cid = row['client']
                last_eval[cid] = {k: v for k, v in row.items() if not is_time_column(k)}
                for key in row:
                    if key.endswith(AUC_OF):
                        curves[cid][key].append(row[key])
        for cid, by_metric in curves.items():   # A_AUC beside A_last (the last evaluation)
            for key, values in by_metric.items():
                last_eval[cid][key + '_auc'] = last_and_auc(values)[1]
        clients = sorted(set(totals) | set(last_eval))
        metric_cols = list(dict.fromkeys(
            k for r in last_eval.values() for k in r if k not in ('round', 'client', 'kind')))
        table = []
        for cid in clients:
            entry = {'client': self.client_label(cid),
                     'eval_round': last_eval.get(cid, {}).get('round', '')}
            entry.update({k: last_eval.get(cid, {}).get(k, float('nan')) for k in metric_cols})
            entry.update(totals[cid])
            table.append(entry)
        columns = metric_cols + list(SUMMARY_COLUMNS)
        groups = self.client_groups(clients) if self.client_groups is not None and clients else {}
        for label, members in groups.items():
            rows = [r for cid, r in zip(clients, table) if cid in set(members)]
            if rows:
                who = (f"clients {', '.join(map(str, members))}" if len(members) <= 6
                       else f'{len(members)} clients')
                table.append({'client': f'{label}: mean of {who}', 'eval_round': '',
                              **_column_means(rows, columns)})
        if table:
            per_client = table[:len(clients)]
            table.append({'client': 'average', 'eval_round': '', **_column_means(per_client, columns)})
        return ['client', 'eval_round'] + metric_cols + list(SUMMARY_COLUMNS), table

    def client_label(self, cid: int) -> str:
        name = self.client_names.get(cid) or self.client_names.get(str(cid))
        return f'{cid} ({name})' if name and name != f'client_{cid}' else str(cid)

    def summary_markdown(self) -> str:
        columns, table = self.final_rows()
        lines = _markdown(columns, table)
        by_modality = self.modality_table(columns, table)
        if by_modality:
            lines += ['', 'By test modality (the mean over clients of their last evaluation; '
                          "UniFLoW's Tables 1-3 layout):", *by_modality]
        split = time_split(self.rows, self.clients_in_parallel)
        if split['rounds']:
            lines += ['', *time_split_markdown(split, self.clients_in_parallel)]
        if self.run_info.get('public_data'):
            lines += ['', f"Public data: {self.run_info['public_data']}"]
        return '\n'.join(lines)

    def modality_table(self, columns: list[str], table: list[dict]) -> list[str]:
        """The 'average' row's per-modality test metrics (<split>_<modality>_<metric>, from
        run.evaluation.modality_groups) as one row, grouped by test modality: the layout of
        UniFLoW's Tables 1-3 (Image: Acc, P/R/F BERTScore, then Audio: the same)."""
        average = next((row for row in table if row['client'] == 'average'), None)
        labels = modality_labels(columns)
        if average is None or not labels:
            return []
        picked = {}
        for label in labels:
            prefix = f'test_{label}_'
            names = [c[len(prefix):] for c in columns if c.startswith(prefix)]
            for name in sorted((n for n in names if n != 'total' and not n.endswith('_auc')),
                               key=_paper_order):
                picked[f'{label} {name}'] = average[prefix + name]
        return _markdown(['method', *picked], [{'method': self.run_label, **picked}])

    def _write_run_info(self) -> None:
        with open(os.path.join(self.out_dir, 'run_info.json'), 'w', encoding='utf-8') as handle:
            json.dump(self.run_info, handle, indent=2, default=str)

    def close(self, completed: bool = True) -> str:
        """Writes the CSV and summary.md of the rows so far, and records in run_info.json
        whether the run went to its end (`completed`; False: it stopped on an error, its
        results so far kept)."""
        self.run_info['completed'] = completed
        peak = peak_cuda_memory()
        if peak:
            self.run_info['peak_cuda_memory_bytes'] = peak
        self._write_run_info()
        self.write_csv()
        summary = self.summary_markdown()
        with open(self.summary_path, 'w', encoding='utf-8') as handle:
            handle.write(summary + '\n')
        if not self._jsonl.closed:
            self._jsonl.close()
        return summary


def peak_cuda_memory() -> int | None:
    """The largest peak of memory allocated by torch on any CUDA device in this process (what
    `fs-plugins reproduce` reports per row), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))


def is_time_column(name: str) -> bool:
    return name.endswith(TIME_SUFFIX)


def without_times(rows: list[dict]) -> list[dict]:
    """The rows without their time columns and without the server rows (which hold only
    times): what two runs of the same config and seed must agree on."""
    return [{k: v for k, v in row.items() if not is_time_column(k)} for row in rows
            if row['kind'] != 'server']


def clients_in_parallel(run_info: dict) -> bool:
    """Whether the run's clients train at the same time: FS distributed (each in its own
    process); the embedded runner and FS standalone run them one after another."""
    mode = ((run_info.get('config') or {}).get('federate') or {}).get('mode', '')
    return run_info.get('runner') == 'federatedscope' and str(mode).lower() == 'distributed'


def _client_seconds(rows: list[dict]) -> dict:
    """{client: [train, extra, eval, wire]} seconds of one round's client rows (wire: the
    client's encode_s of its update)."""
    seconds: dict = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for row in rows:
        parts = seconds[row['client']]
        if row['kind'] == 'train':
            parts[0] += row.get('train_s', 0.0)
            parts[1] += row.get('extra_s', 0.0)
            parts[3] += row.get('encode_s', 0.0)
        elif row['kind'] == 'eval':
            parts[2] += row.get('eval_s', 0.0)
    return seconds


def time_split(rows: list[dict], parallel: bool = False) -> dict:
    """Where the rounds' time went, over the rounds that have a server row: seconds and
    shares (%) of training (train_s), the method's extra work (extra_s), evaluation (eval_s),
    aggregation and wire (the server's aggregate_s, encode_s, decode_s, and the clients'
    encode_s) and other (the rest of Σ round_s: sampling, content, saving, FS's own work).

    Clients one after another (`parallel` False: the embedded runner, FS standalone) add up.
    Clients at the same time (FS distributed) count as the round's critical path: per round,
    the parts of the client whose train + extra + eval + encode is largest. Where the parts
    exceed Σ round_s (clocks of different processes), they are the total and other is 0, so
    the shares always sum to 100.

    Keys: train_s, extra_s, eval_s, aggregation_wire_s, other_s, total_s, the same with _pct
    for the shares, and rounds (how many rounds were counted; 0: no share is meaningful)."""
    by_round: dict = defaultdict(list)
    servers = {}
    for row in rows:
        if row.get('kind') == 'server':
            servers[row['round']] = row
        elif row.get('kind') in ('train', 'eval'):
            by_round[row['round']].append(row)
    seconds = dict.fromkeys(TIME_PARTS, 0.0)
    round_total = 0.0
    for round_idx, server in servers.items():
        clients = list(_client_seconds(by_round[round_idx]).values())
        if parallel:
            clients = [max(clients, key=sum)] if clients else []
        for part, index in (('train', 0), ('extra', 1), ('eval', 2), ('aggregation_wire', 3)):
            seconds[part] += sum(parts[index] for parts in clients)
        seconds['aggregation_wire'] += sum(server.get(k, 0.0)
                                           for k in ('aggregate_s', 'encode_s', 'decode_s'))
        round_total += server.get('round_s', 0.0)
    measured = sum(seconds.values())
    total = max(round_total, measured)
    seconds['other'] = total - measured
    split = {f'{part}_s': value for part, value in seconds.items()}
    split.update({f'{part}_pct': 100.0 * value / total if total > 0 else 0.0
                  for part, value in seconds.items()})
    return {**split, 'total_s': total, 'rounds': len(servers)}


def time_split_markdown(split: dict, parallel: bool) -> list[str]:
    counted = ("per round, the slowest client's (clients in parallel)" if parallel
               else 'clients one after another')
    names = {'train': 'training', 'extra': 'method extra', 'eval': 'evaluation',
             'aggregation_wire': 'aggregation and wire', 'other': 'other'}
    header = (f"Where the rounds' time went (Σ round_s {split['total_s']:.2f} s over "
              f"{split['rounds']} rounds; {counted}):")
    row = {names[part]: f"{split[part + '_pct']:.1f}% ({split[part + '_s']:.2f} s)"
           for part in TIME_PARTS}
    return [header, *_markdown(list(row), [row])]


def run_label(run_info: dict) -> str:
    """The run's row label: its method, with the method's `aggregation` and `schedule`
    options when it has them (UniFLoW: 'uniflow (fed_a2, two_stage)')."""
    method = run_info.get('method') or 'run'
    options = ((run_info.get('config') or {}).get('fsplug') or {}).get(method) or {}
    details = [str(options[k]) for k in ('aggregation', 'schedule') if isinstance(options, dict)
               and options.get(k)]
    return f"{method} ({', '.join(details)})" if details else method


def modality_labels(columns) -> list[str]:
    """The test-modality labels ('image', 'audio', 'image+audio', 'text') that have
    test_<label>_total columns: single modalities first, in the encoders' order."""
    order = ['text', *modalities()]
    labels = []
    for column in columns:
        if column.startswith('test_') and column.endswith('_total'):
            label = column[len('test_'):-len('_total')]
            if label and set(label.split('+')) <= set(order):
                labels.append(label)
    return sorted(labels, key=lambda label: (label.count('+'),
                                             [order.index(m) for m in label.split('+')]))


def _paper_order(metric: str) -> int:
    """Accuracy first, then the generation metrics (as configured), the loss last: the
    column order of UniFLoW's tables (Acc, P/R/F BERTScore)."""
    return 0 if metric in ('token_acc', 'acc') else 2 if metric == 'avg_loss' else 1


def _markdown(columns: list[str], rows: list[dict]) -> list[str]:
    lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
    return lines + ['| ' + ' | '.join(_fmt(row[c]) for c in columns) + ' |' for row in rows]


def _column_means(rows: list[dict], columns) -> dict:
    """Mean of each column over `rows`, ignoring non-numbers and NaN."""
    means = {}
    for key in columns:
        values = [r[key] for r in rows if isinstance(r[key], (int, float))
                  and not (isinstance(r[key], float) and math.isnan(r[key]))]
        means[key] = sum(values) / len(values) if values else float('nan')
    return means


def _fmt(value) -> str:
    if isinstance(value, float):
        return 'nan' if math.isnan(value) else f'{value:.4f}'
    return str(value)
