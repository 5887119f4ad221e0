"""`fs-plugins audit --cfg X.yaml [--client_cfg C.yaml] [--tiny] [key value ...]`: runs a short
federation of two clients and prints what trains and what travels, per group of tensors, with
the verdict against the method's declared contract (see fs_plugins.run.audit). Exit status 1
when the verdict lists a problem."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict

import yaml

from fs_plugins.run.audit import AuditReport, audit, format_report, tiny_config
from fs_plugins.run.config import load_config
from fs_plugins.schema.loading import read_yaml


def audit_yaml(cfg_path: str, client_cfg: str | None = None, opts: list[str] | None = None,
               tiny: bool = False, clients: int = 2, steps: int = 4) -> AuditReport:
    """The audit of a YAML (and its --client_cfg file); `tiny`: of its tiny variant, the same
    method, options and LoRA targets on a random-weight model of the same family."""
    client_cfgs = read_yaml(client_cfg) if client_cfg else None
    if not tiny:
        return audit(load_config(cfg_path, list(opts or [])), client_cfgs, clients, steps)
    plain, client_cfgs = tiny_config(read_yaml(cfg_path), client_cfgs)
    with tempfile.TemporaryDirectory(prefix='fsplug-audit-cfg-') as folder:
        path = os.path.join(folder, 'tiny_' + os.path.basename(cfg_path))
        with open(path, 'w', encoding='utf-8') as handle:
            yaml.safe_dump(plain, handle)
        return audit(load_config(path, list(opts or [])), client_cfgs, clients, steps)


def run_audit(args) -> int:
    report = audit_yaml(args.cfg, args.client_cfg, args.opts, args.tiny, args.clients, args.steps)
    print(format_report(report))
    if args.json:
        with open(args.json, 'w', encoding='utf-8') as handle:
            json.dump(asdict(report), handle, indent=2, default=sorted)
    return 1 if report.problems else 0
