#!/usr/bin/env bash
# The docs/results.md sweeps on a many-core machine with no network (the device machine):
# wheels and gzipped MNIST travel in .whl/; results come back as tables plus one tarball.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PROTOFL_HOME=/tmp/pfhome PROTOFL_MNIST_DIR=$PWD/.whl/mnist
export PROTOFL="python3 -m protofl.cli"
out=/tmp/results; mkdir -p "$out"
nproc; python3 -c "import torch, sys; print(sys.version, torch.__version__)"
budget=${BUDGET:-480}
start=$(date +%s)
$PROTOFL run --quiet --out "$out/warmup" --set federation.rounds=1 --set run.save_releases=false \
  > "$out/warmup.log" 2>&1 || { tail -20 "$out/warmup.log"; }
echo "warm-up done after $(( $(date +%s) - start )) s"
for sweep in nopriv_methods vpdr_table1 vpdr_ablation feddap_ablation vpdr_table7 label_skew vpdr_sensitivity; do
  left=$(( budget - ($(date +%s) - start) ))
  [ "$left" -gt 20 ] || break
  timeout "$left" $PROTOFL sweep "experiments/$sweep.yaml" --jobs "$(nproc)" --out "$out/$sweep" --quiet --no-table \
    > "$out/$sweep.log" 2>&1
  echo "$sweep: rc=$? after $(( $(date +%s) - start )) s"
done
for sweep in "$out"/*/; do
  name=$(basename "$sweep"); [ "$name" = warmup ] && continue
  { echo "## $name"; echo; $PROTOFL table "$sweep" --format md 2>&1; echo; } >> "$OUT/tables.md"
done
cd "$out" && tar czf "$OUT/runs.tgz" --exclude='checkpoint*' --exclude='artifacts.pt' --exclude='*.log' . 2>/dev/null
ls -la "$OUT"
