#!/usr/bin/env bash
# Runs every docs/results.md sweep and writes its tables (Markdown) next to the sweep folders.
#   bash experiments/run_results.sh OUT_DIR [JOBS]
# Each sweep resumes where it stopped; finished runs are skipped. Runs keep no per-round
# checkpoints (federation.checkpoint=false: about a third of a digits4 round); a stopped run
# restarts from round 0.
set -uo pipefail
out=${1:?usage: run_results.sh OUT_DIR [JOBS]}
jobs=${2:-$(nproc)}
protofl=${PROTOFL:-protofl}
mkdir -p "$out"
# build the data and the 64 px feature cache once, before the workers start
$protofl run --quiet --out "$out/warmup" --set federation.rounds=1 --set run.save_releases=false >/dev/null
for sweep in nopriv_methods vpdr_table1 vpdr_table7 vpdr_ablation feddap_ablation feddap_fusion \
             vpdr_sensitivity vpdr_sensitivity_r privacy_utility label_skew text_rotten \
             vpdr_table1_preset vpdr_table7_preset vpdr_ablation_preset vpdr_sensitivity_preset \
             vpdr_sensitivity_r_preset vpp_variants_igpp vpp_variants label_skew_preset attack_preset \
             feddap_table1_preset feddap_table1_stabilised feddap_table1_fedrdn_scalar \
             feddap_ablation_preset feddap_moon_select feddap_moon_select_clipped \
             feddap_table1_fedplvm_code; do
  # the attacks use the exact release-time models: the attack sweep keeps its checkpoints
  keep=(--set federation.checkpoint=false)
  [ "$sweep" = attack_preset ] && keep=()
  $protofl sweep "experiments/$sweep.yaml" --jobs "$jobs" --out "$out/$sweep" --quiet --no-table \
    "${keep[@]}"
done
t() { $protofl table --format md "$@"; }
{
  t "$out/nopriv_methods" --by method
  t "$out/nopriv_methods" --by method --metric last5            # FedDAP's definition
  t "$out/vpdr_table1" --by method,mechanism
  t "$out/vpdr_table7" --by method,mechanism
  t "$out/vpdr_ablation" --by mechanism,privacy.dcr
  t "$out/feddap_ablation" --by method.params --metric last5
  t "$out/feddap_fusion" --by method.params.fusion --metric last5
  t "$out/vpdr_sensitivity" --by privacy.vpp_rho
  t "$out/vpdr_sensitivity_r" --by privacy.vpp_ratio
  t "$out/privacy_utility" "$out/vpdr_table1" "$out/vpdr_table7" "$out/nopriv_methods" \
    --where method=fedproto --by mechanism,epsilon
  t "$out/label_skew" --by data.dirichlet_alpha,mechanism
  t "$out/text_rotten" --by data.dirichlet_alpha,mechanism
  # under VPDR's protocol (preset: vpdr)
  t "$out/vpdr_table1_preset" --by method,mechanism
  t "$out/vpdr_table7_preset" --by method,mechanism
  t "$out/vpdr_ablation_preset" --by mechanism,privacy.dcr
  t "$out/vpdr_sensitivity_preset" --by privacy.vpp_rho
  t "$out/vpdr_sensitivity_r_preset" --by privacy.vpp_ratio
  t "$out/vpp_variants_igpp" "$out/vpp_variants" --by mechanism,privacy.vpp_variant,epsilon
  t "$out/label_skew_preset" --by method,data.dirichlet_alpha,mechanism
  # under FedDAP's protocol (preset: feddap)
  t "$out/feddap_table1_preset" --by method --metric last5
  t "$out/feddap_table1_stabilised" "$out/feddap_table1_fedrdn_scalar" --by method --metric last5
  t "$out/feddap_ablation_preset" "$out/feddap_table1_preset" --where method=feddap \
    --by method.params --metric last5
  t "$out/feddap_moon_select_clipped" --by method --metric last5   # mu chosen on validation
  t "$out/feddap_table1_fedplvm_code" --by method --metric last5   # FedDAP's code's FedPLVM
} > "$out/tables.md"
# the attack table under the vpdr preset (MIA on every run, FSH on seed 0 of each mechanism)
${PYTHON:-python} experiments/attack_table.py "$out/attack_preset" --fsh-per-row 1 >> "$out/tables.md"
echo "tables: $out/tables.md"
