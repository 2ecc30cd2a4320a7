#!/usr/bin/env bash
# session 2026-12-07: issue 37 on one GPU: the disk tier's GPU tests, a Wan 14B folder on
# the root disk (not tmpfs), the disk probe and the bench at 8 GiB host budget, 480p x 1
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
[ -d /tmp/site/diffusers ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
df -hT /tmp /dev/shm >> $OUT/gpu.txt; free -g >> $OUT/gpu.txt
(timeout 250 python3 -m dlo save-pipeline --like wan2.1-t2v-14b /tmp/wan > $OUT/save_wan.log 2>&1; echo "rc=$?" >> $OUT/save_wan.log) &
savepid=$!
timeout 200 python3 -m pytest -v -p no:cacheprovider -rs tests/gpu/test_disk_tier_gpu.py > $OUT/disk_tests.log 2>&1; echo "rc=$?" >> $OUT/disk_tests.log
tail -12 $OUT/disk_tests.log
wait $savepid; tail -2 $OUT/save_wan.log; du -sh /tmp/wan >> $OUT/gpu.txt
timeout 330 python3 -m dlo.bench.pipeline_disk /tmp/wan --host-budgets 8 --size 480x832x1 --steps 3 \
  --probe-gb 4 --json $OUT/wan_disk_1.json --markdown $OUT/wan_disk_1.md > $OUT/wan_disk_1.log 2>&1
echo "rc=$?" >> $OUT/wan_disk_1.log; tail -20 $OUT/wan_disk_1.log
