#!/usr/bin/env bash
# session 2026-12-07: issue 37, Wan 14B folder at 480p x 81 frames, 8 GiB host budget
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
[ -d /tmp/site/diffusers ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1
export PYTHONPATH=.:/tmp/site
[ -d /tmp/wan ] || timeout 250 python3 -m dlo save-pipeline --like wan2.1-t2v-14b /tmp/wan > $OUT/save_wan.log 2>&1
timeout 560 python3 -m dlo.bench.pipeline_disk /tmp/wan --host-budgets 8 --size 480x832x81 --steps 2 \
  --probe-gb 4 --json $OUT/wan_disk_81.json --markdown $OUT/wan_disk_81.md > $OUT/wan_disk_81.log 2>&1
echo "rc=$?" >> $OUT/wan_disk_81.log; tail -20 $OUT/wan_disk_81.log
