"""Scores saved report-generation predictions with a local LLM judge, per client.

    python scripts/judge_reports.py PREDICTIONS.jsonl --judge-model /path/to/Qwen3-8B
        [--clients report] [--batch-size 8] [--max-new-tokens 160] [--template FILE]
        [--out judge_scores.json] [--details judge_outputs.jsonl]

PREDICTIONS.jsonl: one object per line with client, id, question, prediction, reference (the
files the evaluation writes into a results directory). --clients keeps only those clients
(default: every client in the file). For each client the judge score is the mean 1..5 score × 100
(Fed-MoLE Table 2 scale, 100..500); outputs without a parseable score are counted as missing.
Prints one line per client; --out writes the same as JSON, --details every judge output.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

from fs_plugins.metrics.judge import ReportJudge, parse_score, summarise_scores

REQUIRED_FIELDS = ('client', 'id', 'prediction', 'reference')


def read_predictions(path: str, clients: list[str] | None) -> dict[str, list[dict]]:
    by_client = defaultdict(list)
    with open(path, encoding='utf-8') as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [f for f in REQUIRED_FIELDS if f not in row]
            if missing:
                raise SystemExit(f'{path}:{line_no}: missing field(s) {missing}')
            if clients is None or str(row['client']) in clients:
                by_client[str(row['client'])].append(row)
    if clients:
        absent = sorted(set(clients) - set(by_client))
        if absent:
            raise SystemExit(f'{path}: no predictions for client(s) {absent}')
    if not by_client:
        raise SystemExit(f'{path}: no predictions')
    return dict(by_client)


def judge_clients(judge, by_client: dict[str, list[dict]]) -> tuple[dict, list[dict]]:
    """(summary per client, one detail row per prediction); judge.outputs does the generation."""
    summary, details = {}, []
    for client, rows in by_client.items():
        outputs = judge.outputs([r['prediction'] for r in rows], [r['reference'] for r in rows])
        scores = [parse_score(text) for text in outputs]
        summary[client] = summarise_scores(scores)
        details += [{'client': client, 'id': r['id'], 'judge_output': text, 'score': score}
                    for r, text, score in zip(rows, outputs, scores)]
    return summary, details


def json_safe(summary: dict) -> dict:
    """nan (no parseable score) becomes null, so the file is strict JSON."""
    return {client: {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in result.items()}
            for client, result in summary.items()}


def format_line(client: str, result: dict) -> str:
    return (f"client {client}: judge score {result['score']:.2f} (mean 1-5 score {result['mean']:.3f}, × 100) "
            f"over {result['n_scored']}/{result['n']} reports, {result['n_missing']} without a parseable score")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('predictions')
    parser.add_argument('--judge-model', required=True, help='local folder of a causal LM')
    parser.add_argument('--clients', help='comma-separated client names (default: all)')
    parser.add_argument('--template', help='judge prompt template (default: the shipped rubric)')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--max-new-tokens', type=int, default=160)
    parser.add_argument('--device', default=None)
    parser.add_argument('--out', help='write the per-client summary as JSON')
    parser.add_argument('--details', help='write every judge output and parsed score as JSONL')
    args = parser.parse_args(argv)
    clients = args.clients.split(',') if args.clients else None
    by_client = read_predictions(args.predictions, clients)
    judge = ReportJudge(args.judge_model, template_path=args.template, batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens, device=args.device)
    summary, details = judge_clients(judge, by_client)
    for client, result in summary.items():
        print(format_line(client, result))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, 'w', encoding='utf-8') as handle:
            json.dump({'judge_model': args.judge_model, 'clients': json_safe(summary)}, handle, indent=2)
    if args.details:
        with open(args.details, 'w', encoding='utf-8') as handle:
            handle.writelines(json.dumps(row) + '\n' for row in details)
    return summary


if __name__ == '__main__':
    main(sys.argv[1:])
