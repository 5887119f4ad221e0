#!/usr/bin/env bash
# Line coverage of fs_plugins over every test tier, subprocesses included (the CLI, FS runs,
# launched parties, benchmark scripts: coverage.py's `patch = subprocess`), on both cores.
# Install FederatedScope first (scripts/install_fs.sh) so that the fs tier runs too.
#   bash scripts/coverage_all_tiers.sh [pytest options]    -> prints the report's total
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d "${TMPDIR:-/tmp}/fs_plugins_coverage.XXXXXX")"
cat > "$work/coveragerc" <<RC
[run]
source = fs_plugins
parallel = true
patch = subprocess
data_file = $work/.coverage
RC
export COVERAGE_RCFILE="$work/coveragerc"
set +e
python -m coverage run -m pytest -q -n 2 --dist worksteal --tier all tests "$@"
status=$?
set -e
python -m coverage combine -q
python -m coverage report --precision=2 | tail -1
echo "coverage data: $work/.coverage (python -m coverage report --data-file=$work/.coverage)"
exit "$status"
