"""Embedded runner: sample clients -> local rounds -> aggregate -> evaluate, in one process,
over the same core objects the FederatedScope binding uses."""
from __future__ import annotations

import logging

from tqdm import tqdm

from fs_plugins.methods.registry import get_method_class
from fs_plugins.methods.specs import device_for
from fs_plugins.run.artifacts import save_models
from fs_plugins.run.checkpoint import (
    latest_round,
    resume_federation,
    save_federation,
    server_checkpoint_info,
    should_checkpoint,
)
from fs_plugins.run.config import client_overrides, resolve_derived
from fs_plugins.run.results import ResultsLog
from fs_plugins.run.runtime import (
    build_clients,
    build_federated_records,
    initial_global,
    predictions_path,
    results_dir,
    run_info,
)
from fs_plugins.run.server import ServerProcedure

logger = logging.getLogger(__name__)


def run_embedded(cfg, client_cfgs=None) -> ResultsLog:
    """Runs the whole course for `cfg` (a loaded Cfg); returns the closed results log."""
    resume_from = str(cfg.fsplug.checkpoint.resume_from)
    if resume_from:
        latest_round(resume_from)   # a missing checkpoint is named before the data is read
    records = build_federated_records(cfg)
    cfg.federate.client_num = records.client_num
    resolve_derived(cfg)
    overrides = client_overrides(client_cfgs, cfg)
    method_cls = get_method_class(cfg.fsplug.method)
    method = method_cls(cfg)
    checkpoint = server_checkpoint_info(cfg, resume_from) if resume_from else None
    results = ResultsLog(resume_from or results_dir(cfg),
                         run_info(cfg, 'embedded', records.client_names, overrides),
                         overwrite=bool(cfg.fsplug.overwrite),
                         resume_rows=checkpoint['rows'] if checkpoint else None)
    logger.info(f'fs-plugins: results -> {results.out_dir}')
    completed = False
    try:
        shared, layout = initial_global(cfg, method)
        server = ServerProcedure(cfg, method, shared, results, layout)
        server.known_dataset_sizes = records.train_sizes()   # caps the sizes clients report
        clients = build_clients(cfg, method_cls, records, overrides, device_for(cfg))
        method.client_configs = {cid: client.cfg for cid, client in clients.items()}
        for cid, client in clients.items():
            client.predictions_path = predictions_path(results.out_dir, cid)
        start = 0
        if checkpoint:
            resume_federation(resume_from, checkpoint['round'], server, clients.values())
            start = checkpoint['round'] + 1
            logger.info(f'fs-plugins: resumed from the checkpoint of round {start - 1} in {resume_from}')
        total = cfg.federate.total_round_num
        progress = tqdm(range(start, total), desc=f'{cfg.fsplug.method} rounds', unit='round',
                        initial=start, total=total)
        for round_idx in progress:
            logger.info(f'Starting round #{round_idx}')
            updates = []
            for cid in server.sample(round_idx, clients):
                clients[cid].receive(server.content_for(cid))
                updates.append(clients[cid].run_round(round_idx))
            server.aggregate(round_idx, updates)
            progress.set_postfix(train_loss=_mean(u.metrics['train_avg_loss'] for u in updates))
            evaluate, save = server.should_evaluate(round_idx + 1), server.should_save(round_idx + 1)
            if evaluate or save:
                for cid, client in clients.items():
                    if server.evaluates_received_content:
                        client.receive(server.content_for(cid, for_training=False))
                    client.round_idx = round_idx
                    if evaluate:
                        results.log_eval(round_idx, cid, client.evaluate_splits())
            if save:
                save_models(results.out_dir, round_idx, server, clients.values())
            server.finish_round()   # its row is counted by the checkpoint
            if should_checkpoint(cfg, round_idx + 1):
                save_federation(results.out_dir, round_idx, server, clients.values(),
                                len(results.rows))
        completed = True
    finally:
        summary = results.close(completed)
    print(f'\nPer-client results ({cfg.fsplug.method}, embedded runner, seed {cfg.seed}):\n'
          f'{summary}\nFiles: {results.out_dir}/results.jsonl, results.csv, summary.md')
    return results


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float('nan')
