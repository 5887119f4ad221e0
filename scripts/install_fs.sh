#!/usr/bin/env bash
# Installs FederatedScope's llm branch from the unmodified copy beside the project
# (../shared/FederatedScope, or the folder given as $1) as developers and CI do: copied to a
# writable temporary folder (the shared copy is read-only in CI), installed editable without its
# pins, then the `fs` extra with what it imports on modern Python. Nothing of FS enters the
# project tree. Prints the folder it installed from.
set -euo pipefail
cd "$(dirname "$0")/.."
source_dir="${1:-../shared/FederatedScope}"
if [ ! -f "$source_dir/setup.py" ]; then
  echo "install_fs.sh: no FederatedScope copy at $source_dir (expected its setup.py)" >&2
  exit 2
fi
target="$(mktemp -d "${TMPDIR:-/tmp}/fs_plugins_fs.XXXXXX")/FederatedScope"
cp -r "$source_dir" "$target"
chmod -R u+w "$target"
python -m pip install -q --no-deps -e "$target"
python -m pip install -q -c constraints.txt -e '.[fs]'
python -c "import federatedscope, sys; print('FederatedScope', federatedscope.__version__, 'from', '$target')"
