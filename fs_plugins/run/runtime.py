"""Pieces of a run both runners need: the device, the results directory, run metadata,
torch's thread count, the server's initial shared state."""
from __future__ import annotations

import datetime
import logging
import os

import torch

from fs_plugins.core.errors import ConfigError
from fs_plugins.core.threads import thread_count, usable_cores
from fs_plugins.data.federated import FederatedRecords, split_records
from fs_plugins.data.public import PUBLIC_OPTIONS, public_source
from fs_plugins.methods.base import Method
from fs_plugins.methods.building import build_model
from fs_plugins.methods.specs import data_source, public_holdout_count, split_spec
from fs_plugins.run.artifacts import model_layout
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import Cfg, client_config, data_name, merge, model_path, to_plain

logger = logging.getLogger(__name__)


def build_federated_records(cfg) -> FederatedRecords:
    """The run's records split into clients (train / val / test each)."""
    return split_records(split_spec(cfg))


def results_dir(cfg, outdir_is_final: bool = False) -> str:
    """fsplug.results_dir, else FS's outdir (which FS has already joined with expname)."""
    if cfg.fsplug.results_dir:
        return str(cfg.fsplug.results_dir)
    if outdir_is_final:
        return str(cfg.outdir)
    expname = cfg.expname or f'{cfg.fsplug.method}_{os.path.basename(data_name(cfg))}_seed{cfg.seed}'
    path = os.path.join(str(cfg.outdir), expname)
    if os.path.exists(os.path.join(path, 'results.jsonl')):
        path += '_' + datetime.datetime.now().strftime('%Y%m%d%H%M%S')
    return path


def predictions_path(out_dir: str, client_id: int) -> str:
    """Where a client's latest generated answers go (scripts/judge_reports.py reads them)."""
    return os.path.join(out_dir, 'predictions', f'client_{client_id}.jsonl')


def public_data_summary(cfg) -> str:
    """'<key>: where the method's public set comes from' ('' when it reads none)."""
    method = str(cfg.fsplug.method)
    node = getattr(cfg.fsplug, method, None)
    for source_key, _ in PUBLIC_OPTIONS:
        if node is not None and source_key in node:
            where = public_source(str(node[source_key]), data_source(cfg), public_holdout_count(cfg))
            return f'fsplug.{method}.{source_key}: {where}'
    return ''


def run_info(cfg, runner: str, client_names: dict, client_cfgs: dict | None = None) -> dict:
    """run_info.json: the run's config and each client's `--client_cfg` entry (what
    `fs_plugins.load_trained` rebuilds the models from)."""
    return {'runner': runner, 'method': cfg.fsplug.method, 'seed': cfg.seed,
            'model': model_path(cfg), 'data': str(cfg.data.type),
            'public_data': public_data_summary(cfg),
            'client_names': {str(k): v for k, v in client_names.items()},
            'config': to_plain(cfg),
            'client_cfgs': {str(k): to_plain(v) for k, v in (client_cfgs or {}).items()}}


def use_thread_setting(cfg) -> int:
    """Sets torch's CPU threads in this process from fsplug.threads (core.threads.thread_count)
    and returns the number. FS standalone has set 1 by then (its runner's choice); the setting
    replaces it, so both runners of one YAML use the same count."""
    threads = thread_count(int(cfg.fsplug.threads))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    logger.info(f'fs-plugins: torch uses {threads} CPU thread(s) (fsplug.threads = '
                f'{cfg.fsplug.threads})')
    if not int(cfg.fsplug.threads) and threads < usable_cores():
        # a float sum's order follows the thread count: the numbers are reproducible at a fixed one
        logger.warning(f'fs-plugins: the machine is busy, so torch uses {threads} of '
                       f'{usable_cores()} cores; set fsplug.threads to fix the count (the same '
                       f'YAML and seed give identical numbers at the same thread count)')
    return threads


def initial_global(cfg, method: Method):
    """The server's starting point, from a freshly built global model (then dropped): its
    shared parameters and the layout the global state is saved with (artifacts.ModelLayout).
    Both runners call it first, so it also sets the run's thread count (`use_thread_setting`)."""
    use_thread_setting(cfg)
    built = build_model(cfg, method)
    return (method.shared_tensors(built.model, built.trainable_names),
            model_layout(built.model, built.trainable_names))


def build_clients(cfg, method_cls, records, overrides, device, client_ids=None) -> dict[int, ClientProcedure]:
    """Each client's procedure (its config with its --client_cfg entry, its method instance and
    model); `client_ids`: only these (default: all of `records`)."""
    clients = {}
    for cid in client_ids or range(1, records.client_num + 1):
        ccfg = resolved_client_config(cfg, overrides.get(cid), method_cls, records.clients[cid])
        method = method_cls(ccfg)
        try:
            built = build_model(ccfg, method)
        except ConfigError as exc:
            raise ConfigError([f'client {cid}: {p}' for p in exc.problems]) from None
        clients[cid] = ClientProcedure(cid, ccfg, method, built, records.clients[cid], device)
    return clients


def resolved_client_config(cfg, override, method_cls, records: dict):
    """One client's config: the run's, its --client_cfg entry merged on top, then the keys its
    method derives from the client's own records (`Method.resolve_client_config`)."""
    ccfg = client_config(cfg, override)
    method_cls.resolve_client_config(ccfg, records)
    return ccfg


def resolved_override(cfg, override, method_cls, records: dict) -> dict | None:
    """A client's --client_cfg entry (already checked: `client_overrides`) with the keys its
    method derives from its records added (what a server that knows only the entries needs to
    expect that client's upload). `cfg` may be FederatedScope's whole config."""
    merged = Cfg.wrap(merge(to_plain(cfg), override or {}))
    before = to_plain(merged)
    method_cls.resolve_client_config(merged, records)
    derived = changed_leaves(before, to_plain(merged))
    if not derived:
        return override
    return merge(dict(override or {}), derived)


def changed_leaves(before: dict, after: dict) -> dict:
    """The nested keys whose values differ between two plain configs (after's values)."""
    out = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            inner = changed_leaves(old, value)
            if inner:
                out[key] = inner
        elif value != old:
            out[key] = value
    return out
