"""`fs-plugins reproduce`: a paper's table as commands (one per row, panel and seed), resumed,
printed beside the paper's numbers and written as table.md / table.csv."""
import csv
import json
import os

import pytest

from fs_plugins.commands import paper_tables, reproduce
from fs_plugins.commands.cli import main

TABLES = reproduce.load_tables()
TABLE_IDS = [f"{t['paper']}-{t['table']}" for t in TABLES]
# one complete table per paper for the tiny dry run
DRY_RUN_TABLES = [('fedmole', 'Table 1'), ('fedmosaic', 'Table 7'), ('uniflow', 'Table 12'),
                  ('flame', 'Table 2'), ('smartfed', 'Table 3')]
BY_HAND = ("no YAML sets the paper's setting", 'one YAML per dataset', 'run by hand')


def _table(paper, name):
    return reproduce.find_table(TABLES, paper, name)


def _commands(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if line.startswith('fs-plugins run ')]


@pytest.mark.parametrize('table', TABLES, ids=TABLE_IDS)
def test_paper_scale_prints_a_command_for_every_method_row_and_panel(table, tmp_path, capsys):
    """No row is left to run by hand: every method row prints one command per panel; a
    difference row says which rows it is computed from."""
    assert main(['reproduce', table['paper'], table['table'], '--dry-run', '--scale', 'paper',
                 '--out', str(tmp_path), '--seeds', '1']) == 0
    printed = capsys.readouterr().out
    assert not any(phrase in printed for phrase in BY_HAND), printed
    mode = reproduce.Mode('paper')
    expected = set()
    for row in table['rows']:
        for plan in reproduce.plan_runs(table, row, mode):
            if row.get('method') is None:
                assert plan.why_not and f"# {row['row']}: {plan.why_not}" in printed
                if row.get('difference'):
                    assert 'difference row' in plan.why_not
                continue
            expected.add(reproduce.row_dir(str(tmp_path), table, row, 1, mode.tag, plan.panel))
    commands = _commands(printed)
    ran_here = {c.rsplit(' fsplug.results_dir ', 1)[1] for c in commands}
    linked = printed.count(': the same run as ')
    assert ran_here <= expected and len(ran_here) + linked == len(expected)
    assert not os.listdir(tmp_path), 'a dry run must not run anything'


@pytest.mark.parametrize('paper,name', DRY_RUN_TABLES)
def test_tiny_dry_run_prints_every_rows_command(paper, name, tmp_path, capsys):
    assert main(['reproduce', paper, name, '--dry-run', '--scale', 'tiny', '--out',
                 str(tmp_path), '--seeds', '1', '2']) == 0
    printed = capsys.readouterr().out
    assert "tiny stand-in, not the paper's setting" in printed
    table = _table(paper, name)
    for row in table['rows']:
        for plan in reproduce.plan_runs(table, row, reproduce.Mode('tiny')):
            if plan.why_not:
                assert f"# {row['row']}: {plan.why_not}" in printed
                continue
            for seed in (1, 2):
                folder = reproduce.row_dir(str(tmp_path), table, row, seed, 'tiny', plan.panel)
                line = next((line for line in printed.splitlines() if line.endswith(folder)), None)
                if line is None:   # its command is an earlier row's: printed as that run
                    assert ': the same run as ' in printed
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


def test_panels_fill_the_rows_yaml_and_add_their_keys():
    """FLAME Table 2: each row runs on both datasets at both Dirichlet α, one run per panel;
    SmartFed Table 1: each task's YAML and the row's LLM, the library of that LLM's skills."""
    flame = _table('flame', 'Table 2')
    plans = reproduce.plan_runs(flame, flame['rows'][-1], reproduce.Mode('paper'))
    assert [(p.yaml, p.keys['fsplug.data.dirichlet_alpha']) for p in plans] == [
        ('yamls/flame/alpagasus_flame.yaml', 5.0), ('yamls/flame/alpagasus_flame.yaml', 0.5),
        ('yamls/flame/dolly_flame.yaml', 5.0), ('yamls/flame/dolly_flame.yaml', 0.5)]
    smartfed = _table('smartfed', 'Table 1')
    row = [r for r in smartfed['rows'] if r['row'] == 'SMARTFED'][1]   # LLaMA2-13B's
    doit = reproduce.plan_runs(smartfed, row, reproduce.Mode('paper'))[1]
    assert doit.panel == 'DoIT' and doit.yaml == 'yamls/smartfed/paper_doit.yaml'
    assert doit.keys['model.type'] == 'meta-llama/Llama-2-13b-hf@fsplug_llm'
    assert doit.keys['fsplug.model.library.adapters'] == [
        '/path/to/llama2-13b_lora_chinese_r32', '/path/to/llama2-13b_lora_code_r32']
    # at the tiny scale the stand-in runs every panel, without the paper's data and model keys
    tiny = reproduce.plan_runs(smartfed, row, reproduce.Mode('tiny'))
    assert {p.yaml for p in tiny} == {'yamls/smartfed/tiny.yaml'} and len(tiny) == 3
    assert 'model.type' not in tiny[0].keys and 'fsplug.model.library.adapters' not in tiny[0].keys


def test_a_panel_var_the_panel_does_not_set_is_named():
    table = {'paper': 'p', 'table': 'Table 1', 'panels': [{'name': 'A', 'vars': {'task': 'a'}}],
             'rows': [{'row': 'x', 'method': 'fedavg', 'options': {'yaml': 'yamls/{dataset}.yaml'}}]}
    with pytest.raises(reproduce.ReproduceError, match=r"row 'x'.*'yamls/\{dataset\}.yaml' names "
                                                       r"'dataset'.*\['task'\]"):
        reproduce.plan_runs(table, table['rows'][0], reproduce.Mode('paper'))


def test_unknown_table_and_row_are_named(capsys):
    assert main(['reproduce', 'fedmole', '6', '--dry-run']) == 2
    assert "fedmole has no 'Table 6'" in capsys.readouterr().err
    assert main(['reproduce', 'fedmole', '8', '--rows', 'FedNope', '--dry-run', '--scale', 'tiny']) == 2
    assert "has no row 'FedNope'" in capsys.readouterr().err


def test_tiny_swap_needs_smoke_and_the_paper_scale(capsys):
    assert main(['reproduce', 'flame', '2', '--tiny', '--scale', 'paper', '--dry-run']) == 2
    assert 'give --smoke too' in capsys.readouterr().err
    assert main(['reproduce', 'flame', '2', '--tiny', '--smoke', '--scale', 'tiny', '--dry-run']) == 2
    assert 'give --scale paper' in capsys.readouterr().err


def test_smoke_runs_one_round_of_two_steps_and_one_seed(tmp_path, capsys):
    assert main(['reproduce', 'fedmosaic', '2', '--rows', 'SFT', '--dry-run', '--scale', 'paper',
                 '--smoke', '--out', str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    commands = _commands(printed)
    assert len(commands) == 2 and 'Seeds: 1.' in printed and 'smoke check' in printed
    for command in commands:
        assert 'federate.total_round_num 1 train.local_update_steps 2' in command
        assert '/paper-smoke/' in command
    assert main(['reproduce', 'fedmosaic', '2', '--rows', 'SFT', '--dry-run', '--scale', 'paper',
                 '--smoke', '--tiny', '--out', str(tmp_path)]) == 0
    swapped = _commands(capsys.readouterr().out)
    assert all('.config.yaml --client_cfg ' in c and '/paper-smoke-tiny/' in c for c in swapped)


def test_smoke_caps_the_options_that_count_rounds_at_its_one_round(tmp_path, capsys):
    """FedLEASE's warm-up (5 rounds by default) must fit in the run: the smoke sets it to 1."""
    table = _table('fedmole', 'Table 1')
    row = next(r for r in table['rows'] if r['method'] == 'fedlease')
    [plan] = reproduce.plan_runs(table, row, reproduce.Mode('paper', smoke=True))
    assert plan.keys['fsplug.fedlease.warmup_rounds'] == 1
    assert 'fsplug.fedlease.warmup_rounds' not in reproduce.plan_runs(
        table, row, reproduce.Mode('paper'))[0].keys


def test_default_seeds_are_the_papers():
    assert reproduce.default_seeds(_table('fedmosaic', 'Table 2')) == [1, 2, 3]     # mean ± std
    assert reproduce.default_seeds(_table('fedmosaic', 'Table 8')) == [1, 2, 3]     # §5: all runs
    assert reproduce.default_seeds(_table('uniflow', 'Table 4')) == [1, 2, 3]
    assert reproduce.default_seeds(_table('flame', 'Table 2')) == [1]               # no std printed


def test_numbers_problems_name_the_row_and_column():
    table = {'paper': 'p', 'table': 'Table 1', 'columns': [{'name': 'A', 'metric': 'm'}, {'name': 'B', 'metric': 'm'}],
             'rows': [{'row': 'x', 'paper_numbers': {'A': 1.0}}, {'row': 'y'},
                      {'row': 'z', 'numbers_reason': 'a label row'}]}
    assert reproduce.numbers_problems(table) == [
        "p Table 1, row 'x': missing: ['B']",
        "p Table 1, row 'y': no paper_numbers and no numbers_reason"]
    assert reproduce.numbers_problems({'paper': 'p', 'table': 'Table 2', 'rows': []}) == [
        'p Table 2: no columns and no numbers_pending reason']
    broken = {'paper': 'p', 'table': 'Table 3', 'panels': [{'name': 'P'}],
              'columns': [{'name': 'A', 'metric': 'm', 'panel': 'Q'}, {'name': 'M', 'mean_of': ['A', 'Z']}],
              'rows': [{'row': 'd', 'difference': ['x', 'y'], 'numbers_reason': 'r'}]}
    assert reproduce.numbers_problems(broken) == [
        "p Table 3: column 'A' is of panel 'Q', not one of the table's panels ['P']",
        "p Table 3: column 'M' is the mean of unknown columns ['Z']",
        "p Table 3, row 'd': no row 'x' above it to take the difference of"]


def _fake_run(path, evals, names, metric='test_token_acc'):
    os.makedirs(path)
    with open(os.path.join(path, 'results.jsonl'), 'w') as handle:
        handle.writelines(json.dumps({'kind': 'eval', 'round': r, 'client': c, metric: v}) + '\n'
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


DIFF_TABLE = {
    'paper': 'p', 'table': 'Table 9', 'caption': 'c',
    'panels': [{'name': 'A', 'keys': {'fsplug.data.dirichlet_alpha': 5.0}},
               {'name': 'B', 'keys': {'fsplug.data.dirichlet_alpha': 0.5}}],
    'columns': [{'name': 'A acc', 'metric': 'test_acc', 'panel': 'A'},
                {'name': 'B acc', 'metric': 'test_acc', 'panel': 'B'},
                {'name': 'Avg', 'metric': None, 'mean_of': ['A acc', 'B acc']}],
    'rows': [{'row': 'SFT', 'method': 'standalone', 'paper_numbers': {'A acc': 10, 'B acc': 20, 'Avg': 15},
              'paper_std': {'A acc': 1.0}},
             {'row': 'Ours', 'method': 'fedavg', 'paper_numbers': {'A acc': 12, 'B acc': 25, 'Avg': 18.5}},
             {'row': 'Gain', 'method': None, 'difference': ['Ours', 'SFT'], 'reason': 'not a method',
              'paper_numbers': {'A acc': 2, 'B acc': 5, 'Avg': 3.5}}]}


def _fill_diff_runs(out):
    """SFT and Ours, each on panels A and B and seeds 1, 2 (one client; Ours = SFT + 3 on A)."""
    table = DIFF_TABLE
    for seed in (1, 2):
        for row, add in ((table['rows'][0], 0.0), (table['rows'][1], 3.0)):
            for panel, base in (('A', 10.0), ('B', 20.0)):
                value = base + add + seed   # seed 1, 2: std 0.71
                _fake_run(reproduce.row_dir(out, table, row, seed, 'tiny', panel), [(0, 1, value)],
                          {}, metric='test_acc')


def test_difference_rows_and_derived_columns_from_the_rows_they_name(tmp_path):
    out = str(tmp_path)
    _fill_diff_runs(out)
    reading = paper_tables.Reading(out, 'tiny', 'paper', [1, 2])
    sft, ours, gain = DIFF_TABLE['rows']
    a, b, avg = DIFF_TABLE['columns']
    assert reading.row_values(DIFF_TABLE, sft, a) == {1: 11.0, 2: 12.0}
    assert reading.row_values(DIFF_TABLE, sft, avg) == {1: 16.0, 2: 17.0}     # mean of A and B
    assert reading.row_values(DIFF_TABLE, gain, a) == {1: 3.0, 2: 3.0}        # seed by seed
    assert reading.row_values(DIFF_TABLE, gain, avg) == {1: 3.0, 2: 3.0}
    report = paper_tables.TableReport(DIFF_TABLE, DIFF_TABLE['rows'], reading, {})
    lines = {line.split(' | ')[0].strip('| '): line.split(' | ') for line in report.markdown().splitlines()[2:]}
    # SFT on A: ours 11.50 ± 0.71 vs the paper's 10 ± 1: +1.50 > √(1 + 0.5) = 1.22, no mark
    assert lines['SFT'][1:4] == ['10 ± 1', '11.50 ± 0.71', '+1.50']
    # Ours on A: 14.50 vs 12 (no paper std): 2.5 > 0.71, no mark; the gain 3.00 vs 2: σ = 0
    assert lines['Gain'][1:4] == ['2', '3.00 ± 0.00', '+1.00']
    assert paper_tables.difference([11.0, 12.0], 11.2, 0.5) == '+0.30 (< σ)'
    assert paper_tables.difference([11.0], 11.2) == '-0.20'      # no std anywhere: no mark


def test_reproduce_writes_the_table_as_markdown_and_csv(tmp_path, monkeypatch, capsys):
    """A run of a table (here the runs already finished) prints it and writes table.md and
    table.csv beside the runs, every panel and seed read back."""
    out = str(tmp_path)
    _fill_diff_runs(out)
    monkeypatch.setattr(reproduce, 'load_tables', lambda: [DIFF_TABLE])
    monkeypatch.setattr(reproduce, 'run_row', lambda *a: pytest.fail('a finished run ran again'))
    assert main(['reproduce', 'p', '9', '--scale', 'tiny', '--out', out, '--seeds', '1', '2']) == 0
    printed = capsys.readouterr().out
    assert printed.count('finished earlier') == 8 and 'Panels (one run per row and panel): A, B' in printed
    folder = os.path.join(out, 'p', 'Table_9', 'tiny')
    with open(os.path.join(folder, 'table.md')) as handle:
        markdown = handle.read()
    assert '| Gain | 2 | 3.00 ± 0.00 | +1.00 |' in markdown and markdown.startswith('p Table 9: c')
    with open(os.path.join(folder, 'table.csv')) as handle:
        rows = list(csv.DictReader(handle))
    avg = next(r for r in rows if r['row'] == 'Ours' and r['column'] == 'Avg')
    assert (avg['paper'], avg['ours_mean'], avg['seeds']) == ('18.5', '19.5', '2')


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
    # Dolly's panels are the same tiny runs as AlpaGasus' (linked), α = 0.5 its own run
    dolly = header.index('Dolly (α = 5) β_4 paper')
    assert lines['s_i (FLAME)'][dolly + 1] == lines['s_i (FLAME)'][first + 1] != 'n/a'
    # again: every run is finished, so nothing runs and the same table is printed
    monkeypatch.setattr(reproduce, 'run_row', lambda *a: pytest.fail('a finished row ran again'))
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert again.count('finished earlier') == 4

    def numbers(text):   # the row's cells but its status and cost
        return [line.split(' | ')[:-3] for line in text.splitlines() if line.startswith('| No rescaler')]
    assert numbers(again) == numbers(printed)
    assert again.count('| done earlier, same run as an earlier row |') == 2


def test_rows_with_the_same_command_run_once_and_share_the_folder(tmp_path, monkeypatch):
    """SmartFed Table 1's three FedAdapter rows differ only in the LLM and its three panels
    only in the task, which the tiny stand-in does not set: one run, the other folders link to
    it; a second call runs nothing."""
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
        runner = reproduce.Runner(table, reproduce.Mode('tiny'), str(tmp_path), [1], [])
        statuses = [runner.row(row) for row in rows]
        first = ['ran', 'done earlier'][attempt] + ', same run as an earlier row'
        assert statuses == [first] + ['same run as an earlier row'] * 2
    assert len(ran) == 1
    origin = reproduce.row_dir(str(tmp_path), table, rows[0], 1, 'tiny', 'MGSM')
    for row in rows:
        for panel in ('MGSM', 'DoIT', 'GSM-Hard'):
            linked = reproduce.row_dir(str(tmp_path), table, row, 1, 'tiny', panel)
            if linked != origin:
                assert os.path.islink(linked) and os.path.realpath(linked) == os.path.realpath(origin)
            assert reproduce.finished(linked)


def test_tiny_scale_drops_the_placeholder_paths_the_gpu_user_supplies():
    table = _table('fedmosaic', 'Table 31')
    row = next(r for r in table['rows'] if r['row'] == 'LLaVA-Qwen-0.5B (4bit)')
    assert str(row['options']['fsplug.fedmosaic.small_model_type']).startswith('/path/to/')
    [tiny] = reproduce.plan_runs(table, row, reproduce.Mode('tiny'))
    assert 'fsplug.fedmosaic.small_model_type' not in tiny.keys
    assert tiny.keys['fsplug.fedmosaic.small_quantization'] == '4bit'
    [paper] = reproduce.plan_runs(table, row, reproduce.Mode('paper'))
    assert 'fsplug.fedmosaic.small_model_type' in paper.keys


def _table_lines(printed: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in printed.splitlines() if line.startswith('| ')]
    header = lines[0].strip('| ').split(' | ')
    return header, [line.strip('| ').split(' | ') for line in lines[1:]]


def _ours(header: list[str], row: list[str], column: str) -> str:
    return row[header.index(f'{column} ours')]


@pytest.mark.slow
def test_tiny_reproduce_of_flame_table_2_fills_every_panel(tmp_path, capsys):
    """All seven rows, each on both datasets at both α (the tiny stand-in's datasets are one:
    those runs are linked), one round of one step; every column of every row read back."""
    table = _table('flame', 'Table 2')
    assert main(['reproduce', 'flame', '2', '--scale', 'tiny', '--out', str(tmp_path),
                 '--set', 'federate.total_round_num', '1', '--set', 'train.local_update_steps', '1']) == 0
    header, rows = _table_lines(capsys.readouterr().out)
    assert [r[0] for r in rows] == [r['row'] for r in table['rows']]
    for row in rows:
        assert 'failed' not in row[-3]
        assert all(_ours(header, row, c['name']) != 'n/a' for c in table['columns']), row
    assert os.path.isfile(os.path.join(str(tmp_path), 'flame', 'Table_2', 'tiny', 'table.csv'))


@pytest.mark.slow
def test_tiny_reproduce_of_smartfed_table_1_fills_every_panel_and_seed(tmp_path, capsys):
    """Thirty rows (three LLMs) × three tasks × two seeds: the ten methods run once per seed,
    every other folder links to those runs; each task column and their Average per row."""
    assert main(['reproduce', 'smartfed', '1', '--scale', 'tiny', '--out', str(tmp_path),
                 '--seeds', '1', '2', '--set', 'federate.total_round_num', '1',
                 '--set', 'train.local_update_steps', '1']) == 0
    printed = capsys.readouterr().out
    assert len(_commands(printed)) == 0 and printed.count('# ') >= 180
    header, rows = _table_lines(printed)
    assert len(rows) == 30
    for row in rows:
        for column in ('MGSM', 'DoIT', 'GSM-Hard', 'Average'):
            assert ' ± ' in _ours(header, row, column), (row[0], column)   # two seeds
    with open(os.path.join(str(tmp_path), 'smartfed', 'Table_1', 'tiny', 'table.csv')) as handle:
        seeds = {r['seeds'] for r in csv.DictReader(handle) if r['column'] != 'Activated Rank'}
    assert seeds == {'2'}


@pytest.mark.slow
def test_smoke_with_the_tiny_swap_runs_the_paper_yamls_on_a_cpu(tmp_path, capsys):
    """FedMosaic Table 2's own row from its paper YAMLs (DRAKE and HFLB, heterogeneous
    clients), each model swapped for a tiny one of its family: one round of two steps."""
    assert main(['reproduce', 'fedmosaic', '2', '--rows', 'FedMosaic (Ours)', '--scale', 'paper',
                 '--smoke', '--tiny', '--out', str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.count('.config.yaml --client_cfg ') == 2
    header, [row] = _table_lines(printed)
    assert row[header.index('status')] == 'ran' and row[header.index('time')].endswith(' s')
    assert row[header.index('DRAKE-Dynamic Self A_last Δ')] == '—'   # a smoke check compares nothing
    assert _ours(header, row, 'HFLB-Dynamic Self A_last') != 'n/a'
    swapped = os.path.join(str(tmp_path), 'fedmosaic', 'Table_2', 'paper-smoke-tiny',
                           '10_FedMosaic_Ours', 'DRAKE-Dynamic', 'seed1.config.yaml')
    with open(swapped) as handle:
        assert '/path/to/' not in handle.read()


def test_fedmosaics_perada_rows_distil_across_model_types():
    """A.6: the distillation baselines share knowledge between heterogeneous models via logits,
    so no PerAda row of FedMosaic's tables keeps its model types apart."""
    rows = [(t['table'], r) for t in TABLES if t['paper'] == 'fedmosaic' for r in t['rows']
            if r.get('method') == 'perada']
    assert len(rows) >= 6
    assert not [name for name, r in rows
                if (r.get('options') or {}).get('fsplug.aggregation.per_architecture')]


def test_the_ablation_scripts_vanilla_is_fedit():
    """Table 7's 'Vanilla' is FedIT (its numbers are Table 2's FedIT row), not FedMosaic's
    gated modules without RELA and PQ-LoRA."""
    import subprocess
    script = os.path.join(os.path.dirname(__file__), '..', 'scripts', 'fedmosaic_ablations.sh')
    done = subprocess.run(['bash', script, 'tiny', '1'], capture_output=True, text=True,
                          env={**os.environ, 'DRY': '1', 'CELLS': 'vanilla'})
    [command] = [line for line in done.stdout.splitlines() if line.startswith('fs-plugins run')]
    assert command.endswith('fsplug.method fedavg fsplug.aggregation.per_architecture True '
                            'fsplug.aggregation.weights uniform fsplug.results_dir '
                            'exp/fedmosaic_ablations/tiny/seed1/vanilla')
