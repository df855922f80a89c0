#!/usr/bin/env bash
# Runs the docs/results.md sweeps and writes their tables.
#   bash experiments/run_results.sh OUT_DIR [JOBS]
# Each sweep resumes where it stopped; finished runs are skipped.
set -uo pipefail
out=${1:?usage: run_results.sh OUT_DIR [JOBS]}
jobs=${2:-$(nproc)}
protofl=${PROTOFL:-protofl}
mkdir -p "$out"
# build the data and the 64 px feature cache once, before the workers start
$protofl run --quiet --out "$out/warmup" --set federation.rounds=1 --set run.save_releases=false >/dev/null
for sweep in nopriv_methods vpdr_table1 vpdr_ablation feddap_ablation label_skew vpdr_sensitivity; do
  $protofl sweep "experiments/$sweep.yaml" --jobs "$jobs" --out "$out/$sweep" --quiet --no-table
  $protofl table "$out/$sweep" --format md -o "$out/table_$sweep.md"
done
