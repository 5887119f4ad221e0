"""fsplug.train.local_compute: 'matched' gives every method SFT's compute per round (FedMosaic
A.6, Table 15), with the steps set in the client procedure from the method's relative cost
(configured, declared or measured with torch's FLOP counter); every train row carries its
local_steps, local_flops and relative_cost."""
import pytest
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml

from fs_plugins.methods.base import Phase
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import get_method_class
from fs_plugins.run.client import ClientProcedure, matched_phases
from fs_plugins.run.config import load_config
from fs_plugins.run.flops import active_adapters, measured_relative_cost, reference_batches, step_flops
from fs_plugins.run.runtime import build_federated_records

STEPS = 4
PUBLIC_SETS = ('perada', 'fedmkt', 'takfl')   # 8 public records held apart, not 256


def config(tmp_path, method, steps=STEPS, **train):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return load_config(write_yaml(tmp_path / f'{method}.yaml', tiny_config(
        tmp_path / method, method, rounds=1, steps=steps,
        fsplug={'train': train, method: {'public_samples': 8}} if method in PUBLIC_SETS
        else {'train': train})))


def train_rows(results):
    return [r for r in results.rows if r['kind'] == 'train']


def one_client(tmp_path, method, **train) -> ClientProcedure:
    cfg = config(tmp_path, method, **train)
    method_obj = get_method_class(method)(cfg)
    return ClientProcedure(1, cfg, method_obj, build_model(cfg, method_obj),
                           build_federated_records(cfg).clients[1])


def test_matched_phases_apportion_the_budget():
    two = [Phase('global', 10), Phase('personal', 10)]
    assert [p.steps for p in matched_phases(two, 2.0)] == [5, 5]      # 20 / 2: S in all
    assert [p.steps for p in matched_phases(two, 2.294)] == [5, 4]    # round(8.72) = 9
    assert [p.steps for p in matched_phases(two, 1.0)] == [10, 10]
    assert [p.steps for p in matched_phases([Phase('train', 3)], 0.5)] == [6]
    # FedDAT's alternating one-step phases: the first round(2S / cost) of them run
    alternating = [Phase('shared', 1), Phase('dat', 1)] * 4
    assert [p.steps for p in matched_phases(alternating, 2.564)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert sum(p.steps for p in matched_phases([Phase('a', 1), Phase('b', 1)], 100.0)) == 1
    with pytest.raises(ValueError, match='relative_cost'):
        matched_phases(two, 0.0)


@pytest.mark.slow
def test_ditto_matched_runs_sft_steps_half_per_phase(tmp_path):
    sft, _ = run_embedded_keeping_clients(config(tmp_path, 'fedavg'))
    equal, _ = run_embedded_keeping_clients(config(tmp_path / 'equal', 'ditto'))
    matched, clients = run_embedded_keeping_clients(
        config(tmp_path / 'matched', 'ditto', local_compute='matched'))
    assert {r['local_steps'] for r in train_rows(sft)} == {STEPS}
    assert {r['local_steps'] for r in train_rows(equal)} == {2 * STEPS}
    assert {r['local_steps'] for r in train_rows(matched)} == {STEPS}
    assert {r['train_steps'] for r in train_rows(matched)} == {STEPS}
    phases = [p.name for p in clients[1].step_phases]
    assert phases == ['global'] * (STEPS // 2) + ['personal'] * (STEPS // 2)   # half of SFT's each
    assert {r['relative_cost'] for r in train_rows(matched)} == {2.0}   # DITTO's Table 15 ratio
    assert 'relative_cost' not in train_rows(sft)[0]   # equal_steps: nothing declared, not measured


@pytest.mark.slow
def test_a_configured_relative_cost_overrides_the_declared_one(tmp_path):
    results, _ = run_embedded_keeping_clients(
        config(tmp_path, 'ditto', steps=8, local_compute='matched', relative_cost=4.0))
    assert {r['local_steps'] for r in train_rows(results)} == {4}   # 2 × 8 / 4
    assert {r['relative_cost'] for r in train_rows(results)} == {4.0}


def test_perada_uses_its_table_15_ratio(tmp_path):
    proc = one_client(tmp_path, 'perada', local_compute='matched')
    assert proc.relative_cost() == 2.294
    proc.begin_round()
    assert len(proc.step_phases) == round(2 * STEPS / 2.294)


def test_ditto_measures_twice_fedavgs_flops(tmp_path):
    """A DITTO step of either phase is one FedAvg-LoRA step on the same batch (one adapter
    active, its LoRA trained): the round at equal steps costs exactly 2 × SFT's."""
    ditto, fedavg = one_client(tmp_path, 'ditto'), one_client(tmp_path / 'f', 'fedavg')
    batches = reference_batches(ditto)
    sft = step_flops(fedavg, batches=batches)
    assert sft > 0
    flags = {n: p.requires_grad for n, p in ditto.model.named_parameters()}
    active = active_adapters(ditto.model)
    global_phase, personal_phase = ditto.method.phases(STEPS, ditto.cfg)
    assert step_flops(ditto, global_phase, batches) == sft
    assert step_flops(ditto, personal_phase, batches) == sft
    assert step_flops(ditto, batches=batches, sft=True) == sft   # the same-model SFT reference
    assert measured_relative_cost(ditto) == 2.0
    # counting left the client as it was
    assert {n: p.requires_grad for n, p in ditto.model.named_parameters()} == flags
    assert active_adapters(ditto.model) == active
    assert all(p.grad is None for p in ditto.model.parameters())


def test_an_undeclared_method_is_measured_under_matched(tmp_path):
    proc = one_client(tmp_path, 'fedavg', local_compute='matched')
    assert proc.relative_cost() == 1.0   # FedAvg's step is the SFT step
    proc.begin_round()
    assert len(proc.step_phases) == STEPS


@pytest.mark.slow
def test_rows_carry_the_rounds_flops(tmp_path):
    """local_flops = each phase's first step, counted as it ran, × the phase's steps."""
    results, clients = run_embedded_keeping_clients(config(tmp_path, 'ditto'))
    proc = clients[1]
    row = next(r for r in train_rows(results) if r['client'] == 1)
    assert row['local_steps'] == 2 * STEPS
    counted = list(proc.phase_flops.values())
    assert len(counted) == 2 and all(f > 0 for f in counted)
    assert row['local_flops'] == STEPS * sum(counted)
    # the count is of the real step: a DITTO step on its batch costs what step_flops says
    first = step_flops(proc, proc.step_phases[0], reference_batches(proc))
    assert first > 0


def fedmosaic_client(tmp_path, **fedmosaic) -> ClientProcedure:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(write_yaml(tmp_path / 'fedmosaic.yaml', tiny_config(
        tmp_path, 'fedmosaic', rounds=1, steps=STEPS,
        fsplug={'fedmosaic': {'num_blocks': 1, **fedmosaic}})))
    method_obj = get_method_class('fedmosaic')(cfg)
    return ClientProcedure(1, cfg, method_obj, build_model(cfg, method_obj),
                           build_federated_records(cfg).clients[1])


def test_fedmosaic_cost_is_measured_over_relas_interval(tmp_path):
    """RELA's W_s gradient runs every f steps, so the measured cost is the mean of f steps, one
    with it: (F_due + (f − 1)·F_other) / f over SFT's (Table 15's 1.098 counts it so); the
    method declares no constant of its own (the paper's stays for display)."""
    from fs_plugins.methods.fedmosaic import FedMosaic
    assert FedMosaic.relative_cost is None and FedMosaic.paper_relative_cost == 1.098
    client = fedmosaic_client(tmp_path, gradient_every=5)
    assert client.method.cost_period(client.cfg) == 5
    batches = reference_batches(client)
    phase = client.method.phases(STEPS, client.cfg)[0]
    sft = step_flops(client, batches=batches, sft=True)
    due = step_flops(client, phase, batches)              # step 0: RELA's gradient is taken
    client.state['rela'].steps = 1
    other = step_flops(client, phase, batches)
    client.state['rela'].steps = 0
    assert due > other > 0
    cost = measured_relative_cost(client)
    assert cost == pytest.approx((due + 4 * other) / 5 / sft, rel=1e-6)
    assert cost < due / sft
    # counting left the client's RELA state where it was
    assert client.state['rela'].steps == 0 and client.state['rela'].ema is None


def test_fedsim_and_feddpa_are_measured_not_table_15(tmp_path):
    """FedSim shares one forward between its adapters and FedDPA splits one pass: below Table
    15's double-pass figures, which stay beside them for display."""
    fedsim = one_client(tmp_path / 's', 'fedsim')
    feddpa = one_client(tmp_path / 'd', 'feddpa')
    assert fedsim.method.relative_cost is None and fedsim.method.paper_relative_cost == 1.487
    assert feddpa.method.relative_cost is None and feddpa.method.paper_relative_cost == 2.051
    assert measured_relative_cost(fedsim) < 1.487
    assert measured_relative_cost(feddpa) < 2.051
