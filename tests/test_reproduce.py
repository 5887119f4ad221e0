"""`fs-plugins reproduce`: a paper's table as commands, resumed, printed beside the paper's numbers."""
import json
import os

import pytest

from fs_plugins.commands import reproduce
from fs_plugins.commands.cli import main

# one complete table per paper, and a row of it the dry run must print a command for
DRY_RUN_TABLES = [('fedmole', 'Table 1'), ('fedmosaic', 'Table 7'), ('uniflow', 'Table 12'),
                  ('flame', 'Table 2'), ('smartfed', 'Table 3')]


def _table(paper, name):
    return reproduce.find_table(reproduce.load_tables(), paper, name)


@pytest.mark.parametrize('paper,name', DRY_RUN_TABLES)
def test_dry_run_prints_every_rows_command(paper, name, tmp_path, capsys):
    assert main(['reproduce', paper, name, '--dry-run', '--scale', 'tiny', '--out',
                 str(tmp_path), '--seeds', '1', '2']) == 0
    printed = capsys.readouterr().out
    assert "tiny stand-in, not the paper's setting" in printed
    table = _table(paper, name)
    for row in table['rows']:
        plan = reproduce.RowRun(table, row, 'tiny')
        if plan.why_not:
            assert f"# {row['row']}: {plan.why_not}" in printed
            continue
        for seed in (1, 2):
            line = next((line for line in printed.splitlines()
                         if line.endswith(reproduce.row_dir(str(tmp_path), table, row, seed))),
                        None)
            if line is None:   # its command is an earlier row's: printed as that run
                assert f"# {row['row']} seed {seed}: the same run as " in printed
                continue
            assert line.startswith(f'fs-plugins run --cfg {plan.yaml}')
            assert f"fsplug.method {row['method']}" in line and f'seed {seed}' in line
    assert not os.listdir(tmp_path), 'a dry run must not run anything'


def test_paper_scale_uses_the_rows_own_yaml_and_keys(tmp_path, capsys):
    assert main(['reproduce', 'fedmole', '1', '--dry-run', '--scale', 'paper', '--rows', 'FedProx',
                 '--out', str(tmp_path), '--set', 'federate.total_round_num', '3']) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert command.startswith('fs-plugins run --cfg yamls/fedmole/fedvqa_llava15_7b.yaml '
                              'fsplug.method fedprox federate.total_round_num 3 seed 1')


def test_unknown_table_and_row_are_named(capsys):
    assert main(['reproduce', 'fedmole', '6', '--dry-run']) == 2
    assert "fedmole has no 'Table 6'" in capsys.readouterr().err
    assert main(['reproduce', 'fedmole', '8', '--rows', 'FedNope', '--dry-run', '--scale', 'tiny']) == 2
    assert "has no row 'FedNope'" in capsys.readouterr().err


def test_numbers_problems_name_the_row_and_column():
    table = {'paper': 'p', 'table': 'Table 1', 'columns': [{'name': 'A', 'metric': 'm'}, {'name': 'B', 'metric': 'm'}],
             'rows': [{'row': 'x', 'paper_numbers': {'A': 1.0}}, {'row': 'y'},
                      {'row': 'z', 'numbers_reason': 'a label row'}]}
    assert reproduce.numbers_problems(table) == [
        "p Table 1, row 'x': missing: ['B']",
        "p Table 1, row 'y': no paper_numbers and no numbers_reason"]
    assert reproduce.numbers_problems({'paper': 'p', 'table': 'Table 2', 'rows': []}) == [
        'p Table 2: no columns and no numbers_pending reason']


def _fake_run(path, evals, names):
    os.makedirs(path)
    with open(os.path.join(path, 'results.jsonl'), 'w') as handle:
        handle.writelines(json.dumps({'kind': 'eval', 'round': r, 'client': c, 'test_token_acc': v}) + '\n'
                          for r, c, v in evals)
    with open(os.path.join(path, 'run_info.json'), 'w') as handle:
        json.dump({'client_names': names, 'completed': True}, handle)
    open(os.path.join(path, 'summary.md'), 'w').close()


def test_column_values_average_name_budget_and_auc(tmp_path):
    run = str(tmp_path / 'run')
    _fake_run(run, [(0, 1, 0.2), (0, 2, 0.4), (1, 1, 0.6), (1, 2, 0.8), (1, 3, 1.0)],
              {'1': 'AQUA', '2': 'GQA', '3': 'VizWiz'})
    value = reproduce.column_value
    assert value(run, {'client': 'average', 'percent': True}, 'test_token_acc') == pytest.approx(80.0)
    assert value(run, {'client': 'GQA'}, 'test_token_acc') == pytest.approx(0.8)
    assert value(run, {'client': 3}, 'test_token_acc') == pytest.approx(1.0)
    assert value(run, {'client': 'β1'}, 'test_token_acc', levels=2) == pytest.approx(0.8)  # clients 1, 3
    assert value(run, {'client': 'AQUA'}, 'test_token_acc_auc') == pytest.approx(0.4)
    assert value(run, {'client': 'COCO-QA'}, 'test_token_acc') is None
    assert value(run, {'client': 'average'}, 'test_vqa_exact') is None


def test_a_column_of_another_panel_is_not_compared():
    table = {'tiny_panel': 'AlpaGasus (α = 5)'}
    ours = {'name': 'x', 'metric': 'test_rougeL', 'tiny_metric': 'test_token_acc', 'panel': 'AlpaGasus (α = 5)'}
    assert reproduce.compared_metric(table, {}, ours, 'tiny') == 'test_token_acc'
    assert reproduce.compared_metric(table, {}, dict(ours, panel='Dolly (α = 5)'), 'tiny') is None
    assert reproduce.compared_metric(table, {'panel': 'AlpaGasus (α = 5)'}, ours, 'paper') == 'test_rougeL'


@pytest.fixture(scope='module')
def tiny_flame_table(tmp_path_factory):
    """Two rows of FLAME's Table 5 (no rescaler, learnable), one round of one local step each."""
    out = str(tmp_path_factory.mktemp('reproduce'))
    argv = ['reproduce', 'flame', 'Table 5', '--rows', '1', '3', '--scale', 'tiny', '--out', out,
            '--set', 'federate.total_round_num', '1', '--set', 'train.local_update_steps', '1']
    return out, argv


@pytest.mark.slow
def test_tiny_reproduce_prints_ours_beside_the_papers_and_resumes(tiny_flame_table, capsys,
                                                                 monkeypatch):
    out, argv = tiny_flame_table
    assert main(argv) == 0
    printed = capsys.readouterr().out
    lines = {line.split(' | ')[0].strip('| '): line.split(' | ') for line in printed.splitlines()
             if line.startswith('| ') and not line.startswith('| row')}
    assert set(lines) == {'No rescaler', 's_i (FLAME)'}
    header = next(line for line in printed.splitlines() if line.startswith('| row')).split(' | ')
    first = header.index('AlpaGasus (α = 5) β_4 paper')
    paper, ours, delta = lines['No rescaler'][first:first + 3]
    assert paper == '24.12'
    assert float(delta) == pytest.approx(float(ours) - 24.12, abs=0.011)
    dolly = header.index('Dolly (α = 5) β_4 paper')
    assert lines['s_i (FLAME)'][dolly:dolly + 3] == ['26.74', 'n/a', 'n/a']
    # again: both rows are finished, so nothing runs and the same table is printed
    monkeypatch.setattr(reproduce, 'run_row', lambda *a: pytest.fail('a finished row ran again'))
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert again.count('finished earlier') == 2
    def numbers(text):   # the row's cells but its status
        return [line.split(' | ')[:-1] for line in text.splitlines() if line.startswith('| No rescaler')]
    assert numbers(again) == numbers(printed)
    assert again.count('| done earlier |') == 2


def test_rows_with_the_same_command_run_once_and_share_the_folder(tmp_path, monkeypatch):
    """SmartFed Table 1's three FedAdapter rows differ only in the LLM, which the tiny stand-in
    does not set: one run, the other rows' folders link to it; a second call runs nothing."""
    table = _table('smartfed', 'Table 1')
    rows = reproduce.select_rows(table, ['FedAdapter'])
    assert len(rows) == 3
    ran = []

    def fake_run(command, log_path):
        ran.append(command)
        os.makedirs(log_path[:-len('.log')], exist_ok=True)
        with open(os.path.join(log_path[:-len('.log')], 'run_info.json'), 'w') as handle:
            json.dump({'completed': True}, handle)
        return 0
    monkeypatch.setattr(reproduce, 'run_row', fake_run)
    for attempt in range(2):
        same_runs = {}
        statuses = [reproduce.run_row_seeds(table, row, 'tiny', str(tmp_path), [1], [], False,
                                            same_runs) for row in rows]
        assert statuses == [['ran', 'done earlier'][attempt]] + ['same run as an earlier row'] * 2
    assert len(ran) == 1
    first = reproduce.row_dir(str(tmp_path), table, rows[0], 1)
    for row in rows[1:]:
        linked = reproduce.row_dir(str(tmp_path), table, row, 1)
        assert os.path.islink(linked) and os.path.realpath(linked) == os.path.realpath(first)
        assert reproduce.finished(linked)


def test_tiny_scale_drops_the_placeholder_paths_the_gpu_user_supplies():
    table = _table('fedmosaic', 'Table 31')
    row = next(r for r in table['rows'] if r['row'] == 'LLaVA-Qwen-0.5B (4bit)')
    assert str(row['options']['fsplug.fedmosaic.small_model_type']).startswith('/path/to/')
    tiny = reproduce.RowRun(table, row, 'tiny').opts
    assert 'fsplug.fedmosaic.small_model_type' not in tiny
    assert tiny[tiny.index('fsplug.fedmosaic.small_quantization') + 1] == '4bit'
    paper = reproduce.RowRun(table, row, 'paper').opts
    assert 'fsplug.fedmosaic.small_model_type' in paper
