#!/usr/bin/env bash
# Issue 37 on one GPU: the disk tier's GPU tests, then a real-size pipeline folder saved on
# the root disk (not tmpfs: /dev/shm is memory) and python -m dlo.bench.pipeline_disk under
# an 8 GiB host budget (resident and dlo-disk in one process). Picks the Wan2.1-14B layout
# where /tmp has 46 GiB free, FLUX.1-dev where it has 36, else runs the tests only.
# Usage (from the repository root, wheels carried in .whl): launch/disk_gpu.sh OUTDIR [SIZE STEPS]
set -u
out=${1:?usage: launch/disk_gpu.sh OUTDIR [SIZE STEPS]}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # see launch/fetch_wheels.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$out/pip.log" 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi --query-gpu=name,memory.total --format=csv; df -hT /tmp /dev/shm; free -g; } \
  > "$out/machine.txt" 2>&1
free_gb=$(df -BG --output=avail /tmp | tail -1 | tr -dc 0-9)
like=wan2.1-t2v-14b; size=${2:-480x832x1}; steps=${3:-3}
if [ -f /tmp/dlo_disk_folder/model_index.json ]; then  # saved by an earlier call: kept
  grep -q Flux /tmp/dlo_disk_folder/model_index.json && like=flux.1-dev && size=${2:-1024x1024}
elif [ "$free_gb" -lt 46 ]; then
  like=flux.1-dev; size=${2:-1024x1024}
  [ "$free_gb" -lt 36 ] && like=none
fi
echo "/tmp has ${free_gb} GiB free: $like" | tee -a "$out/machine.txt"
if [ "$like" != none ] && [ ! -d /tmp/dlo_disk_folder ]; then
  (timeout 250 python3 -m dlo save-pipeline --like "$like" /tmp/dlo_disk_folder \
    > "$out/save.log" 2>&1; sync; echo "rc=$?" >> "$out/save.log") &
fi
timeout 150 python3 -m pytest -v -p no:cacheprovider -rs tests/gpu/test_disk_tier_gpu.py \
  > "$out/disk_tests.log" 2>&1; echo "rc=$?" >> "$out/disk_tests.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " "$out/disk_tests.log" | head -20
[ "$like" = none ] && exit 0
wait
tail -2 "$out/save.log" 2>/dev/null
timeout 400 python3 -m dlo.bench.pipeline_disk /tmp/dlo_disk_folder --host-budgets 8 \
  --size "$size" --steps "$steps" --probe-gb 4 --json "$out/disk_bench.json" \
  --markdown "$out/disk_bench.md" > "$out/disk_bench.log" 2>&1
echo "rc=$?" >> "$out/disk_bench.log"; grep -v "it/s\]" "$out/disk_bench.log" | tail -14
