#!/usr/bin/env bash
# Installs the declared minimum versions into a fresh virtual environment and runs the quick
# tests (`pytest -m quick`, tests/conftest.py) there: the floors in setup.py's install_requires
# are true when this passes.
#
#   bash scripts/check_min_versions.sh            # venv in /tmp/fsplug-minvenv (recreated)
#   MINVENV=/path/to/venv bash scripts/check_min_versions.sh
#
# Every install_requires entry with a floor ('name>=X') is installed as 'name==X'; the others
# resolve as pip resolves them. torch is installed first as TORCH_SPEC (default the repo's
# constraints.txt pin, torch==2.13.0, so that pip does not pull a CUDA build; its declared floor
# is not installed here). The `test` extra is installed too (pytest collects every test module).
# Not wired into .ci/run.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MINVENV:-/tmp/fsplug-minvenv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-$(grep -E '^torch==' "$REPO/constraints.txt" || echo 'torch==2.13.0')}

# 'name==floor' for every floored requirement of setup.py (torch excepted: TORCH_SPEC)
FLOORS=$("$PYTHON" - "$REPO/setup.py" <<'EOF'
import ast
import sys

tree = ast.parse(open(sys.argv[1], encoding='utf-8').read())
call = next(node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, 'id', '') == 'setup')
requires = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == 'install_requires')
for requirement in requires:
    name, sep, floor = requirement.partition('>=')
    if sep and name.strip() != 'torch':
        print(f'{name.strip()}=={floor.split(",")[0].strip()}')
EOF
)

start=$(date +%s)
echo "check_min_versions: $TORCH_SPEC, then:" $FLOORS
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $FLOORS -e "$REPO[test]"
installed=$(date +%s)
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|peft|accelerate|datasets|tokenizers|safetensors|huggingface.hub|numpy|pyarrow) '
echo "check_min_versions: installed in $((installed - start)) s"

cd "$REPO"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/python" -m pytest -q -m quick -p no:cacheprovider tests
echo "check_min_versions: quick tests passed under the floors in $(( $(date +%s) - installed )) s" \
     "($(( $(date +%s) - start )) s in all)"
