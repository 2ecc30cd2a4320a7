#!/usr/bin/env bash
# Sweep DLO settings on all GPUs (slots, chunk size, NCCL CTAs, lock-step check).
# Usage: launch/sweep_dlo.sh OUTDIR
set -uo pipefail
out=${1:?usage: launch/sweep_dlo.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
i=0
while read -r slots chunk ctas verify; do
  i=$((i + 1))
  extra=()
  [ "$verify" = off ] && extra+=(--no-verify)
  name="s${slots}_c${chunk}_cta${ctas}_v${verify}"
  echo "== $name" | tee -a "$out/sweep.log"
  env ${ctas:+$( [ "$ctas" != - ] && echo NCCL_MAX_CTAS=$ctas)} timeout 150 \
    torchrun --nproc-per-node="$ngpu" -m dlo bench --preset medium --methods dlo-allgather \
    --tokens 4096,16384 --num-slots "$slots" --chunk-mb "$chunk" "${extra[@]}" \
    --json "$out/$name.json" > "$out/$name.log" 2>&1
  echo "   exit $?" | tee -a "$out/sweep.log"
  grep -E "^dlo-allgather" "$out/$name.log" | tee -a "$out/sweep.log"
done <<'CFG'
3 64 - on
2 64 - off
3 128 - on
3 64 8 on
3 400 - on
CFG
