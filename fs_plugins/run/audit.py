"""`fs-plugins audit`: what trains and what travels in a short federation of two clients, set
beside what the method declares (`Method.contract`).

Two clients run a few local steps per round through the same step-level calls the FS trainer
makes, the server aggregates through the method, and each client's download is taken; the
rounds run from 0 to the first round of the method's last stage (where its phases change, e.g.
UniFLoW's two stages, SmartFed's and FedLEASE's warm-up), so every stage is seen. Per
group of tensors (names with layer and expert indices folded to '*') the audit records: the
phases it trained in, the largest |gradient| it received, whether local training changed it,
what was uploaded (tensors, bytes), what the server made of it (averaged / per-client /
method-specific / kept on the server) and what came back (bytes). Totals per client and round
are set beside FedAvg-LoRA's on the same model and LoRA targets. The verdict lists every
breach of the contract: a trainable tensor without a gradient, an uploaded tensor training did
not change, a declared-local tensor leaving the client, a declared upload or extra payload
missing or undeclared.
"""
from __future__ import annotations

import copy
import fnmatch
import re
import tempfile
from dataclasses import dataclass, field

import torch

from fs_plugins.methods.base import Contract, PaperClaim, weights_of
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.models.builders import architecture_only
from fs_plugins.run.client import ClientProcedure
from fs_plugins.run.config import client_overrides, resolve_derived, to_plain
from fs_plugins.run.results import ResultsLog
from fs_plugins.run.runtime import build_clients, build_federated_records, initial_global
from fs_plugins.run.server import ServerProcedure
from fs_plugins.schema.options import Cfg
from fs_plugins.schema.placeholders import without_placeholders

_INDEX = re.compile(r'(?<=[./])\d+(?=[./]|$)')
_PREFIXES = ('base_model.model.',)
MAX_STAGE_ROUNDS = 1000   # rounds scanned for changes of the method's phases
MAX_AUDIT_ROUNDS = 12     # consecutive rounds the audit runs to reach the method's last stage


def group_of(name: str) -> str:
    """A tensor's group: its name with numeric path parts (layers, experts, blocks) as '*'."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    name = re.sub(r'block\d+', 'block*', name)
    return _INDEX.sub('*', name)


def matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


@dataclass
class GroupRow:
    group: str
    tensors: int = 0            # tensors of the group in one client's model or upload
    numel: int = 0
    trainable_in: set = field(default_factory=set)   # 'round r: phase' labels
    grad_max: float | None = None                    # None: no gradient was ever computed
    changed: bool | None = None                      # None: not a model parameter
    up_tensors: int = 0
    up_bytes: int = 0           # per client per round
    server: set = field(default_factory=set)
    down_bytes: int = 0         # per client per round

    def cells(self) -> list[str]:
        grad = '-' if self.grad_max is None else ('0' if not self.grad_max else f'{self.grad_max:.1e}')
        return [self.group, f'{self.tensors} ({self.numel:,})',
                ', '.join(sorted(self.trainable_in)) or '-', grad,
                {None: '-', True: 'yes', False: 'no'}[self.changed],
                f'{self.up_tensors} / {fmt_bytes(self.up_bytes)}' if self.up_tensors else '-',
                '/'.join(sorted(self.server)) or '-',
                fmt_bytes(self.down_bytes) if self.down_bytes else '-']


@dataclass
class AuditReport:
    method: str
    model: str
    rounds: list[int]                       # the audited rounds: 0 .. the first round of the last stage
    rows: list[GroupRow]
    extra_bytes: dict[str, int]             # extra payload key -> bytes per client per round
    totals: dict[str, float]
    fedavg: dict[str, float]
    claim: PaperClaim | None
    problems: list[str]

    @property
    def up_ratio(self) -> float | None:
        base = self.fedavg.get('up_bytes')
        return (self.totals['up_bytes'] + self.totals['extra_bytes']) / base if base else None


def fmt_bytes(n: float) -> str:
    for unit, size in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
        if n >= size:
            return f'{n / size:.2f} {unit}'
    return f'{int(n)} B'


# ------------------------------------------------------------------------------ stages
def phase_signature(method, steps: int, cfg, trainable_names) -> tuple:
    return tuple((p.name, p.steps, p.adapters,
                  frozenset(n for n in trainable_names if p.trainable is None or p.trainable(n)))
                 for p in method.phases(steps, cfg))


def stage_rounds(client: ClientProcedure, total_rounds: int) -> list[int]:
    """The first round of each distinct set of phases over the run (in round order)."""
    method, seen, rounds = client.method, set(), []
    saved = method.round_idx
    try:
        for r in range(min(total_rounds, MAX_STAGE_ROUNDS)):
            method.round_idx = r
            signature = phase_signature(method, client.steps_per_round(), client.cfg,
                                        client.trainable_names)
            if signature not in seen:
                seen.add(signature)
                rounds.append(r)
    finally:
        method.round_idx = saved
    return rounds


# ------------------------------------------------------------------------ client round
@dataclass
class ClientObservation:
    trainable_in: dict[str, set] = field(default_factory=dict)
    grad_max: dict[str, float] = field(default_factory=dict)
    changed: dict[str, bool] = field(default_factory=dict)
    upload_changed: dict[str, bool] = field(default_factory=dict)
    flops: int = 0
    steps: int = 0   # optimiser steps over the audited rounds


def observed_round(client: ClientProcedure, round_idx: int, seen: ClientObservation):
    """One local round through the FS trainer's step calls, watching every trainable tensor;
    its FLOPs are the client's own count (`local_flops`, fs_plugins.run.flops)."""
    params, names = client.params, client.trainable_names
    before = {n: params[n].detach().clone() for n in names}
    shared_before = client.method.shared_tensors(client.model, names)
    client.round_idx = round_idx
    for _ in range(client.begin_round()):
        batch = client.next_batch()
        for n in names:
            if params[n].requires_grad:
                seen.trainable_in.setdefault(n, set()).add(f'r{round_idx}:{client.current_phase.name}')
        loss = client.compute_loss(batch)
        client.optimise(loss)
        client.record(float(loss.detach()), batch['input_ids'].shape[0])
        for n in names:
            grad = params[n].grad
            if grad is not None:
                seen.grad_max[n] = max(seen.grad_max.get(n, 0.0), float(grad.detach().abs().max()))
    update = client.end_round()
    seen.flops += int(update.metrics.get('local_flops', 0))
    seen.steps += int(update.metrics.get('local_steps', 0))
    for n in names:
        seen.changed[n] = seen.changed.get(n, False) or not torch.equal(before[n], params[n].detach())
    for n, value in update.shared.items():
        old = shared_before.get(n)
        unchanged = old is not None and old.shape == value.shape and torch.equal(old, value)
        seen.upload_changed[n] = seen.upload_changed.get(n, False) or not unchanged
    return update


# ------------------------------------------------------------------------ server side
def server_treatment(name: str, uploads, contents, weights) -> str:
    """What the server made of uploaded tensor `name`, from what each client gets back."""
    back = [c.get(name) for c in contents]
    if all(b is None for b in back):
        return 'kept on server'
    if any(b is None for b in back) or any(b.shape != back[0].shape or not torch.equal(b, back[0])
                                           for b in back[1:]):
        return 'per-client'
    sent = [u.get(name) for u in uploads]
    if all(s is not None and s.shape == back[0].shape for s in sent):
        total = sum(weights)
        mean = sum(s.float() * (w / total) for s, w in zip(sent, weights))
        if torch.allclose(mean, back[0].float(), rtol=1e-4, atol=1e-6):
            return 'averaged'
    return 'method-specific'


# --------------------------------------------------------------------------- the audit
MIN_PHASE_STEPS = 2   # a LoRA A has no gradient in its first step (B = 0): two steps show both


def audit_steps(method, cfg, steps: int) -> int:
    """At least `steps` local steps per pass, and enough that every phase of every round runs
    MIN_PHASE_STEPS steps (e.g. UniFLoW's encoder stage is τ = 25 % of them)."""
    total_rounds = min(int(cfg.federate.total_round_num), MAX_STAGE_ROUNDS)
    n = steps
    while n < 64:
        phases = []
        for r in range(total_rounds):
            method.round_idx = r
            phases += method.phases(n, cfg)
        if all(p.steps >= MIN_PHASE_STEPS for p in phases if p.steps > 0):
            break
        n *= 2
    method.round_idx = 0
    return n


def audit(cfg, client_cfgs=None, clients: int = 2, steps: int = 4) -> AuditReport:
    """Audits the method of `cfg` (a loaded Cfg) on its first `clients` clients with at least
    `steps` local steps per local pass, in one process (see the module docstring)."""
    records = build_federated_records(cfg)
    cfg.federate.client_num = records.client_num
    resolve_derived(cfg)
    overrides = client_overrides(client_cfgs, cfg)
    method_cls = get_method_class(cfg.fsplug.method)
    ids = list(range(1, min(max(clients, method_cls.contract.audit_clients), records.client_num) + 1))
    method = method_cls(cfg)
    cfg.train.local_update_steps = audit_steps(method, cfg, int(steps))
    cfg.train.batch_or_epoch = 'batch'
    with tempfile.TemporaryDirectory(prefix='fsplug-audit-') as out_dir:
        results = ResultsLog(out_dir, {'runner': 'audit', 'client_names': {}})
        try:
            shared, layout = initial_global(cfg, method)
            server = ServerProcedure(cfg, method, shared, results, layout)
            procs = build_clients(cfg, method_cls, records, overrides, 'cpu', ids)
            method.client_configs = {cid: p.cfg for cid, p in procs.items()}
            return _observe(cfg, method, server, procs)
        finally:
            results.close()


def _observe(cfg, method, server, procs) -> AuditReport:
    ids = sorted(procs)
    stages = stage_rounds(procs[ids[0]], int(cfg.federate.total_round_num))
    if stages[-1] >= MAX_AUDIT_ROUNDS:
        raise ValueError(f'{cfg.fsplug.method}: its phases change at round {stages[-1]}; the audit runs at '
                         f'most {MAX_AUDIT_ROUNDS} rounds (lower the stage switch in an override)')
    rounds = list(range(stages[-1] + 1))   # consecutive: the server's state follows the rounds
    seen = {cid: ClientObservation() for cid in ids}
    ups, extras, downs = {c: {} for c in ids}, {c: {} for c in ids}, {c: {} for c in ids}
    treatment: dict[str, set] = {}
    problems: list[str] = []
    for r in rounds:
        updates = []
        for cid in ids:
            procs[cid].receive(server.content_for(cid))
            updates.append(observed_round(procs[cid], r, seen[cid]))
        uploads = [dict(u.shared) for u in updates]
        server.aggregate(r, updates)
        problems += [f"round {x['round']}: the server rejected client {x['client']}'s update: "
                     f"{x['reason']}" for x in server.rejections]
        server.rejections.clear()
        contents = [server.content_for(cid, for_training=False) for cid in ids]
        weights = weights_of(updates)
        for cid, update, content in zip(ids, updates, contents):
            _add(ups[cid], update.shared)
            _add(extras[cid], update.extra)
            _add(downs[cid], content)
        for name in set().union(*uploads):
            treatment.setdefault(group_of(name), set()).add(
                server_treatment(name, uploads, contents, weights))
    report = _report(cfg, method, procs, rounds, seen, ups, extras, downs, treatment)
    report.problems = problems + contract_problems(method.contract, method.gradient_free, procs,
                                                   seen, ups, extras)
    return report


def _add(into: dict, tensors: dict) -> None:
    """Accumulates name -> (tensors seen, bytes) over the audited rounds."""
    for name, t in tensors.items():
        if torch.is_tensor(t):
            count, size = into.get(name, (0, 0))
            into[name] = (count + 1, size + t.numel() * t.element_size())


def _report(cfg, method, procs, rounds, seen, ups, extras, downs, treatment) -> AuditReport:
    ids, n_rounds = sorted(procs), len(rounds)
    rows: dict[str, GroupRow] = {}

    def row(name: str) -> GroupRow:
        return rows.setdefault(group_of(name), GroupRow(group_of(name)))

    first = procs[ids[0]]
    counted = set()   # trainable on any audited client (clients may train different modules)
    for cid in ids:
        for name in procs[cid].trainable_names:
            if name not in counted:
                counted.add(name)
                g = row(name)
                g.tensors += 1
                g.numel += procs[cid].params[name].numel()
    for cid in ids:
        obs = seen[cid]
        for name in procs[cid].trainable_names:
            g = row(name)
            g.trainable_in |= obs.trainable_in.get(name, set())
            if name in obs.grad_max:
                g.grad_max = max(g.grad_max or 0.0, obs.grad_max[name])
            g.changed = bool(g.changed) or obs.changed.get(name, False)
    per_client = len(ids) * n_rounds
    for cid in ids:
        for name, (_count, size) in ups[cid].items():
            g = row(name)
            if name not in procs[cid].params:
                g.changed = None
            g.up_bytes += size / per_client
        for name, (_count, size) in downs[cid].items():
            row(name).down_bytes += size / per_client
    for g in rows.values():
        g.server = treatment.get(g.group, set())
        upload_names = {n for cid in ids for n in ups[cid] if group_of(n) == g.group}
        g.up_tensors = len(upload_names)
    extra_bytes: dict[str, int] = {}
    for cid in ids:
        for name, (_, size) in extras[cid].items():
            extra_bytes[name] = extra_bytes.get(name, 0) + size / per_client
    totals = {'trainable_params': sum(first.params[n].numel() for n in first.trainable_names),
              'up_bytes': sum(g.up_bytes for g in rows.values()),
              'extra_bytes': sum(extra_bytes.values()),
              'down_bytes': sum(g.down_bytes for g in rows.values()),
              'local_flops': sum(seen[c].flops for c in ids) / per_client,
              'local_steps': sum(seen[c].steps for c in ids) / per_client}
    return AuditReport(method=method.name, model=str(cfg.model.type), rounds=rounds,
                       rows=sorted(rows.values(), key=lambda g: g.group), extra_bytes=extra_bytes,
                       totals=totals, fedavg=_fedavg_totals(cfg), claim=method.contract.claim,
                       problems=[])


def _fedavg_totals(cfg) -> dict[str, float]:
    size = fedavg_lora_up_bytes(cfg) or 0
    return {'up_bytes': size, 'down_bytes': size}   # FedAvg-LoRA gets back what it sends


def contract_problems(contract: Contract, gradient_free: bool, procs, seen, ups, extras) -> list[str]:
    """The breaches of the method's declared contract, one line each (grouped by tensor group)."""
    found: dict[str, set] = {}

    def note(what: str, name: str, cid: int) -> None:
        found.setdefault(f'{group_of(name)}: {what}', set()).add(cid)

    def gated(name: str, obs: ClientObservation) -> bool:
        # frozen in every phase by a configuration the server chose (Contract.gated_trains)
        return name not in obs.trainable_in and matches(name, contract.gated_trains)

    for cid, proc in procs.items():
        obs, names = seen[cid], proc.trainable_names
        if not gradient_free:
            for name in names:
                if not obs.grad_max.get(name) and not gated(name, obs):
                    note('trainable but received no gradient in any phase', name, cid)
        for name in ups[cid]:
            # a parameter that received a gradient was trained, even where an update below the
            # float resolution left it unchanged (a small SGD step on a LoRA A whose B is ~0)
            trained = obs.upload_changed.get(name, True) or bool(obs.grad_max.get(name))
            if not trained and not gated(name, obs) and not matches(name, contract.unchanged_uploads):
                note('uploaded but not changed by local training (undeclared)', name, cid)
            if matches(name, contract.stays_local):
                note('declared local (Contract.stays_local) but uploaded', name, cid)
        for name in extras[cid]:
            if not matches(name, contract.extra):
                note('extra payload not declared (Contract.extra)', name, cid)
        for pattern in contract.trains:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                found.setdefault(f'{pattern}: declared to train (Contract.trains) but no trainable '
                                 f'tensor matches', set()).add(cid)
        for pattern in contract.uploads:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in ups[cid]):
                found.setdefault(f'{pattern}: declared upload (Contract.uploads) never sent',
                                 set()).add(cid)
        for pattern in contract.extra:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in extras[cid]):
                found.setdefault(f'{pattern}: declared extra payload (Contract.extra) never sent',
                                 set()).add(cid)
    return [f'{what} (client {", ".join(map(str, sorted(cids)))})' for what, cids in sorted(found.items())]


def fedavg_lora_up_bytes(cfg) -> int | None:
    """Bytes FedAvg-LoRA uploads per client and round on the same builder, model.type and
    fsplug.model.lora (its shared tensors are its trainable LoRA factors, plus any module the
    builder or fsplug.model.vision trains), from the model built on the meta device; None when
    the model gets no LoRA tensor. The audit and `fs-plugins estimate` set methods beside it."""
    plain = to_plain(cfg)
    plain['fsplug']['method'] = 'fedavg'
    plain['fsplug'].pop('fedavg', None)   # LoRA, not fsplug.fedavg.full_finetune
    plain['fsplug']['model']['adapter'] = 'lora'
    plain['fsplug']['model']['quantization'] = 'none'
    fedavg_cfg = Cfg.wrap(plain)
    method = get_method_class('fedavg')(fedavg_cfg)
    with architecture_only(device='meta'):
        built = build_model(fedavg_cfg, method, share_frozen=False)
    params = dict(built.model.named_parameters())
    return sum(params[n].numel() * params[n].element_size()
               for n in built.trainable_names if method.is_shared(n)) or None


# ---------------------------------------------------------------------------- output
HEADER = ['tensor group', 'tensors (params)', 'trainable in', 'max |grad|', 'changed', 'up / client',
          'server', 'down / client']


def format_report(report: AuditReport) -> str:
    lines = [f'Audit of {report.method} on {report.model} (rounds {report.rounds}, per client and '
             f'round)', '', '| ' + ' | '.join(HEADER) + ' |', '|' + '---|' * len(HEADER)]
    lines += ['| ' + ' | '.join(g.cells()) + ' |' for g in report.rows]
    t, f = report.totals, report.fedavg
    lines += ['', f"trainable parameters: {int(t['trainable_params']):,}; local steps per round: "
                  f"{int(t['local_steps'])}; local FLOPs per round: {t['local_flops']:.3g}",
              f"uploaded: {fmt_bytes(t['up_bytes'])} tensors + {fmt_bytes(t['extra_bytes'])} extra "
              f"payload ({', '.join(f'{k} {fmt_bytes(v)}' for k, v in report.extra_bytes.items()) or 'none'}); "
              f"downloaded: {fmt_bytes(t['down_bytes'])}",
              f"FedAvg-LoRA on the same model and targets: {fmt_bytes(f['up_bytes'])} up, "
              f"{fmt_bytes(f['down_bytes'])} down; ratio up (incl. extra) {report.up_ratio:.3f}, "
              f"down {t['down_bytes'] / f['down_bytes']:.3f}" if f.get('up_bytes') else
              'FedAvg-LoRA: no LoRA tensor on this model']
    if report.claim:
        claimed = f'{report.claim.up_ratio:.3f}' if report.claim.up_ratio is not None else 'no ratio'
        where = report.claim.source.split(':')[0]
        lines.append(f"paper's up ratio: {claimed} ({where}; the method's Contract.claim); the paper's "
                     f"sizes: `fs-plugins estimate`")
    lines += ['', 'verdict: ' + ('OK, the wiring matches the contract' if not report.problems else
                                 f'{len(report.problems)} problem(s)')]
    lines += [f'  - {p}' for p in report.problems]
    return '\n'.join(lines)


# ------------------------------------------------------------------------ tiny variants
def _base(builder: str, model_type: str, data: dict, fsplug_data: dict, tok_len: int, batch: int,
          clients: int, **model) -> dict:
    return {'model': {'type': f'{model_type}@fsplug_llm'}, 'data': data, 'llm': {'tok_len': tok_len},
            'dataloader': {'batch_size': batch},
            'federate': {'client_num': clients, 'sample_client_num': clients},
            'fsplug': {'model': {'builder': builder, **model}, 'data': fsplug_data}}


_TEXT = _base('tiny_llama', 'tiny-llama', {'type': 'tiny_tasks@fsplug', 'splitter': 'by_source'},
              {'split_field': 'category', 'test_fraction': 0.2, 'prompt': 'plain'}, 96, 8, 4)
_CHAMP = ({'type': 'champ_math@fsplug', 'splitter': 'dirichlet'},
          {'split_field': 'category', 'dirichlet_alpha': 0.5, 'test_fraction': 0.2, 'prompt': 'plain'})
_VQA = ({'type': 'easyvqa@fsplug', 'splitter': 'by_source'},
        {'split_field': 'task', 'split_from_records': True})
_MEDIA = {'llm_builder': 'tiny_llama',
          'image': {'backend': 'tiny_clip', 'lora_targets': ['q_proj', 'v_proj'], 'pool_tokens': 4},
          'audio': {'backend': 'tiny_whisper', 'lora_targets': ['q_proj', 'v_proj'], 'pool_tokens': 4,
                    'max_seconds': 1.0}}
TINY_DEPTH = 2   # decoder layers of the smallest tiny model below
TINY_MAX_RANK = 16   # LoRA ranks above it are capped (the tiny models are 64 wide)
# model.builder -> the config of a random-weight model of the same family on offline data
TINY_BASES = {
    'tiny_llama': _TEXT, 'smollm2': _TEXT, 'causal_lm': _TEXT,
    'tiny_olmo': _base('tiny_olmo', 'tiny-olmo', *_CHAMP, 256, 4, 4),
    'tiny_olmoe': _base('tiny_olmoe', 'tiny-olmoe', *_CHAMP, 256, 4, 4),
    'tiny_llava': _base('tiny_llava', 'tiny-llava', *_VQA, 128, 4, 3),
    'tiny_qwen2_vl': _base('tiny_qwen2_vl', 'tiny-qwen2-vl', *_VQA, 128, 4, 3),
    'tiny_roberta_classifier': _base('tiny_roberta_classifier', 'tiny-roberta',
                                     {'type': 'glue_tiny:sst2@fsplug', 'splitter': 'dirichlet'},
                                     {'split_field': 'label', 'dirichlet_alpha': 0.5,
                                      'min_client_size': 10}, 64, 16, 3),
    'imagebind_vicuna': _base('imagebind_vicuna', 'tiny-llama',
                              {'type': 'tiny_media@fsplug', 'splitter': 'by_source'},
                              {'split_field': 'client_group'}, 256, 4, 3, multimodal=_MEDIA),
}
TINY_OF = {'olmoe': 'tiny_olmoe', 'llava': 'tiny_llava', 'easyvqa_llava': 'tiny_llava',
           'easyvqa_llava_small': 'tiny_llava', 'qwen2_vl': 'tiny_qwen2_vl',
           'roberta_classifier': 'tiny_roberta_classifier'}
# the parts of fsplug.model that belong to the model, not to the method's wiring
_MODEL_OWN = ('builder', 'multimodal', 'local_files_only', 'dtype', 'quantization')
_RUN_ONLY = ('data', 'results_dir', 'eval', 'save', 'checkpoint', 'overwrite')


def tiny_family(builder: str, model_type: str) -> str:
    """The tiny builder of a builder's model family (OLMo checkpoints through causal_lm: tiny_olmo)."""
    if builder == 'causal_lm' and 'olmo' in model_type.lower() and 'olmoe' not in model_type.lower():
        return 'tiny_olmo'
    return TINY_OF.get(builder, builder)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def is_tiny(plain: dict) -> bool:
    """Whether a config's model is already a tiny random-weight one (built locally)."""
    model = (plain.get('fsplug') or {}).get('model') or {}
    builder = str(model.get('builder', 'tiny_llama'))
    if builder == 'imagebind_vicuna':
        builder = str((model.get('multimodal') or {}).get('llm_builder', 'tiny_llama'))
    return builder.startswith('tiny_')


def standalone(plain: dict) -> dict:
    """The config as one process runs it (a distributed party's keys dropped)."""
    out = {k: v for k, v in plain.items() if k != 'distribute'}
    out['federate'] = {**(out.get('federate') or {}), 'mode': 'standalone'}
    return out


def tiny_variant(plain: dict) -> dict:
    """The config in one process on a tiny model: as it is when its model is already tiny,
    else with its model and data replaced by a random-weight model of the same family on
    offline data; the method, its options, the adapter and its targets stay the YAML's."""
    plain = copy.deepcopy(plain)
    if is_tiny(plain):
        return standalone(plain)
    fsplug = plain.get('fsplug') or {}
    model = fsplug.get('model') or {}
    family = tiny_family(str(model.get('builder', 'tiny_llama')), str((plain.get('model') or {}).get('type', '')))
    if 'library' in model:   # a LoRA library trained on the real model: the tiny library exists
        family = 'tiny_llama'   # for the tiny Llama only (its module paths are the library's)
    if family not in TINY_BASES:
        raise ValueError(f"fsplug.model.builder '{model.get('builder')}': no tiny model of its family "
                         f"for the audit (known: {sorted(TINY_BASES)})")
    base = copy.deepcopy(TINY_BASES[family])
    out = {k: v for k, v in standalone(plain).items() if k not in ('model', 'data', 'llm', 'dataloader')}
    out = _merge(out, {k: base[k] for k in ('model', 'data', 'llm', 'dataloader', 'federate')})
    kept = {k: v for k, v in fsplug.items() if k not in _RUN_ONLY and k != 'model'}
    kept_model = {k: v for k, v in model.items() if k not in _MODEL_OWN and k != 'library'}
    if family not in ('tiny_llava', 'tiny_qwen2_vl'):
        kept_model.pop('vision', None)
    out['fsplug'] = _merge(_merge(base['fsplug'], kept), {'model': kept_model})
    if 'library' in model:
        out['fsplug']['model']['library'] = {'adapters': ['builtin:tiny-a', 'builtin:tiny-b']}
    if family == 'imagebind_vicuna':
        out['fsplug']['model']['multimodal'] = tiny_multimodal(model.get('multimodal') or {})
    for key in ('pivot_builder', 'pivot_model_type'):
        out['fsplug'].get('fedmosaic', {}).pop(key, None)
    _cap_rank(out)
    method = str(out['fsplug'].get('method', 'fedavg'))
    options = out['fsplug'].get(method) or {}
    contract = get_method_class(method).contract
    for key in contract.depth_options:
        if key in options:
            options[key] = min(int(options[key]), TINY_DEPTH)
    rank = int(((out['fsplug'].get('model') or {}).get('lora') or {}).get('r', TINY_MAX_RANK))
    for key in contract.rank_options:
        if key in options:
            options[key] = min(int(options[key]), rank)
    clients = int(out['federate']['client_num'])
    for key in contract.per_client_options:
        values = options.get(key)
        if isinstance(values, list) and len(values) > clients:   # evenly spaced entries
            options[key] = [values[i * len(values) // clients] for i in range(clients)]
    return out


def tiny_config(plain: dict, client_cfgs: dict | None = None) -> tuple[dict, dict | None]:
    """A config (and its --client_cfg entries) swapped for the tiny model of each family on
    offline data (`tiny_variant`, `tiny_client_variant`; the entries of clients beyond the tiny
    data's dropped), without the `/path/to/` placeholders left in it (their defaults apply):
    the paper-scale YAML runs here as the audit and `reproduce --smoke --tiny` run it."""
    swapped = without_placeholders(tiny_variant(plain))
    if client_cfgs and not is_tiny(plain):
        run_builder = swapped['fsplug']['model']['builder']
        clients_there = int(swapped['federate']['client_num'])
        client_cfgs = {k: without_placeholders(tiny_client_variant(v, run_builder))
                       for k, v in client_cfgs.items()
                       if int(str(k).removeprefix('client_')) <= clients_there}
    return swapped, client_cfgs


def tiny_multimodal(multimodal: dict) -> dict:
    """The tiny encoders of an encoder + LLM config: an ImageBind (or UniBind: ImageBind's
    architecture) encoder becomes the random tiny model of ImageBind's layout
    (`path: tiny-imagebind`) with the YAML's own LoRA targets, so the audit sees the paper's
    target names; any other encoder, and a modality the YAML does not configure (the tiny data
    has both), the tiny CLIP / Whisper."""
    out = copy.deepcopy(_MEDIA)
    for modality, tiny in list(out.items()):
        own = multimodal.get(modality)
        if isinstance(tiny, dict) and isinstance(own, dict) and own.get('backend') in ('imagebind', 'unibind'):
            out[modality] = {'backend': 'imagebind', 'path': 'tiny-imagebind', 'pool_tokens': 1,
                             'lora_targets': list(own.get('lora_targets') or [])}
    return out


def _cap_rank(plain: dict) -> None:
    lora = ((plain.get('fsplug') or {}).get('model') or {}).get('lora') or {}
    if 'r' in lora:
        lora['r'] = min(int(lora['r']), TINY_MAX_RANK)


def tiny_client_variant(entry: dict, run_builder: str) -> dict:
    """A --client_cfg entry's model swapped for the tiny model of its family and its rank
    capped (other keys kept; `run_builder`: the tiny variant's builder, for an entry that
    changes only model.type)."""
    out = copy.deepcopy(entry)
    model = (entry.get('fsplug') or {}).get('model') or {}
    if 'builder' in model or 'model' in entry:
        family = tiny_family(str(model.get('builder', run_builder)), str((entry.get('model') or {}).get('type', '')))
        base = TINY_BASES.get(family, TINY_BASES[run_builder])
        builder = base['fsplug']['model']['builder']
        out = _merge(out, {'model': base['model'], 'fsplug': {'model': {'builder': builder}}})
    _cap_rank(out)
    return out
