#!/usr/bin/env bash
# Issue 21's GPU run on one H200: write a random-weight Wan 2.1 T2V 14B pipeline folder, run
# it with `dlo run --pipeline`, then through diffusers itself (group offloading, resident),
# one process per method so each cold start is its own. Reports land in OUT as JSON.
#   bash launch/pipeline_gpu.sh OUT [DIR] [extra flags for every method]
# LIKE (default wan2.1-t2v-14b) picks the folder save-pipeline writes when DIR is missing,
# SIZES its call sizes (default Wan's 480p x 81 frames; flux.1-dev: "--height 1024 --width 1024"),
# DLO_RUNS how many times dlo runs (dlo.json, dlo2.json, ...), ONLY_DLO=1 skips the peers.
# DLO_FLAGS are dlo's own (default "--resident-layers 0": the row measures streaming; give
# DLO_FLAGS= for dlo's defaults, which keep a model that fits on the device).
set -uo pipefail
out=${1:?usage: pipeline_gpu.sh OUT [DIR] [flags]}
shm_free_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
default_dir=/tmp/wan14b
[ "${shm_free_gb:-0}" -ge 60 ] && default_dir=/dev/shm/wan14b  # RAM: writing is not disk-bound
dir=${2:-$default_dir}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
# the carried wheels are installed with their bytecode, so no method pays its compilation
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=.:/tmp/site
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
read -r -a sizes <<< "${SIZES:---height 480 --width 832 --frames 81}"
flags=("${sizes[@]}" --steps 3 "$@")
df -h /dev/shm /tmp > "$out/disk.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, diffusers, transformers; print(torch.__version__, diffusers.__version__, transformers.__version__)" > "$out/versions.txt" 2>&1
if [ ! -f "$dir/model_index.json" ]; then
  /usr/bin/time -v python3 -m dlo save-pipeline --like "${LIKE:-wan2.1-t2v-14b}" "$dir" > "$out/save.log" 2>&1 || { tail -30 "$out/save.log"; exit 1; }
  tail -3 "$out/save.log"
fi
rc=0
run() {  # name, limit_s, command...
  local name=$1 limit=$2; shift 2
  timeout "$limit" /usr/bin/time -v "$@" > "$out/$name.json" 2> "$out/$name.err" || { rc=1; tail -25 "$out/$name.err"; }
  grep -E '"(step_ms_median|first_step_ms|cold_start_s|load_s|peak_rss_nbytes|hbm_peak_nbytes|parity)"' "$out/$name.json" | tr -d '\n '; echo " <- $name"
}
for i in $(seq 1 "${DLO_RUNS:-1}"); do  # dlo, dlo2, ...: run-to-run spread
  read -r -a dlo_flags <<< "${DLO_FLAGS---resident-layers 0}"
  run "dlo${i#1}" "${DLO_LIMIT_S:-170}" python3 -m dlo run --pipeline "$dir" "${flags[@]}" \
    "${dlo_flags[@]}" --json --output /tmp/frames
done
[ -n "${ONLY_DLO:-}" ] && exit $rc
run diffusers-group "${GROUP_LIMIT_S:-220}" python3 -m dlo.bench.pipeline_peers "$dir" --method diffusers-group "${flags[@]}"
run resident "${RESIDENT_LIMIT_S:-170}" python3 -m dlo.bench.pipeline_peers "$dir" --method resident "${flags[@]}"
exit $rc
