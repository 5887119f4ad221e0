#!/usr/bin/env bash
# The smoke of the five papers' main tables: every row of FedMosaic Table 2, Fed-MoLE Table 1,
# UniFLoW Table 1, FLAME Table 2 and SmartFed Table 1 from its paper-scale YAML, one round of two
# local steps (`fs-plugins reproduce P T --scale paper --smoke`). Each table's time, status and
# peak memory per row land in OUT/<paper>/<Table_N>/paper-smoke[-tiny]/table.md; this prints
# each table's wall time.
#   bash scripts/smoke_main_tables.sh            # on a GPU: the paper's models (fill in the
#                                                # /path/to/ placeholders first: --set KEY VALUE)
#   TINY=1 bash scripts/smoke_main_tables.sh     # on a CPU: each model swapped for a tiny one
set -u
OUT=${OUT:-exp/smoke}
EXTRA=()
[ "${TINY:-0}" = 1 ] && EXTRA=(--tiny)
status=0
for table in "fedmosaic 2" "fedmole 1" "uniflow 1" "flame 2" "smartfed 1"; do
  start=$(date +%s)
  # shellcheck disable=SC2086
  fs-plugins reproduce $table --scale paper --smoke "${EXTRA[@]}" --out "$OUT" "$@" || status=1
  echo "== $table: $(( $(date +%s) - start )) s"
done
exit $status
