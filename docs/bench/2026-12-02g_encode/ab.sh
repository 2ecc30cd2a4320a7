#!/usr/bin/env bash
# One device call: the encode pass and the restore's decode, old tree (a copy in old_dlo/)
# against this one, then the GPU tests of the codec. Usage: ab.sh OUT (PYTHONPATH has /tmp/site)
out=$1
root=$(pwd)
site=/tmp/site
run() {  # tree name, command...
  local tree=$1; shift
  local dir=$root; [ "$tree" = old ] && dir=$root/old_dlo
  (cd "$dir" && PYTHONPATH=.:$site "$@")
}
echo "== $(date +%T) save-checkpoint"
run new python3 -m dlo save-checkpoint --preset medium --out /dev/shm/ckpt > "$out/save.log" 2>&1
for tree in old new; do
  for c in ${DLO_AB_CODECS:-none ans}; do
    echo "== $(date +%T) $tree ckpt $c"
    run $tree python3 -m dlo run --preset medium --checkpoint /dev/shm/ckpt --codec $c --steps 2 \
      --tokens 4096 --json > "$out/run_ckpt_${tree}_$c.json" 2> "$out/run_ckpt_${tree}_$c.err"
  done
  echo "== $(date +%T) $tree probe_enable"
  run $tree python3 "$root/docs/bench/2026-12-02g_encode/probe_enable.py" "$out/enable.jsonl" $tree \
    > "$out/probe_$tree.log" 2>&1
done
echo "== $(date +%T) gpu tests"
PYTHONPATH=$root:$site timeout 200 python3 -m pytest -q -p no:cacheprovider -rs \
  ${DLO_AB_TESTS:-tests/gpu/test_codec_gpu.py tests/gpu/test_subclasses_gpu.py tests/gpu/test_ring_gpu.py tests/gpu/test_pipelines_gpu.py} \
  > "$out/gpu_tests.log" 2>&1
tail -3 "$out/gpu_tests.log"
echo "== $(date +%T) flux"
run new timeout 120 python3 -m dlo save-pipeline --like flux.1-dev /dev/shm/flux > "$out/flux_save.log" 2>&1
for tree in old new; do
  echo "== $(date +%T) $tree flux"
  run $tree timeout 150 python3 -m dlo run --pipeline /dev/shm/flux --height 1024 --width 1024 \
    --guidance 3.5 --steps 2 --codec ans --json > "$out/flux_$tree.json" 2> "$out/flux_$tree.err"
done
echo "== $(date +%T) done"
