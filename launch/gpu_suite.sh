#!/usr/bin/env bash
# GPU evidence for dlo on the machine at hand: GPU and multi-GPU tests, `dlo run --check`
# on one GPU and under torchrun on all GPUs, and `dlo bench` on one GPU and on all GPUs.
# The `dlo run` rows that exercise a transfer pass --resident-layers 0 (on a GPU the defaults
# keep a model that fits resident, and nothing would stream); run_1gpu_defaults runs those.
# Usage: launch/gpu_suite.sh OUTDIR [tests|failtests|nstests|runns|codec|compile2|pipeline2|cp|lane|lanetests|lanefail|lanerun|lanecp|cetests|run|bench1|bench2|profile|ctas|ckpt|encdisk|latecodec|auto|cesweep|sweep]...
#        (default: tests failtests run bench1 bench2; more than one device call's limit)
# Env: DLO_SUITE_PRESET (medium), DLO_SUITE_TOKENS (4096,16384), DLO_SUITE_METHODS (bench2's
#      --methods; default all), DLO_SUITE_METHODS1 (bench1's), DLO_SUITE_CTAS (1 2 4 8),
#      DLO_SUITE_BENCH_ARGS (more bench2 flags, e.g. "--num-slots 2,3")
set -uo pipefail
out=${1:?usage: launch/gpu_suite.sh OUTDIR [steps...]}
shift
steps=${*:-"tests failtests run bench1 bench2"}
# everything is written under $out/work and packed into $out/suite.tgz after every step, so a
# run stopped at its time limit still returns what finished (device tools return few files)
mkdir -p "$out/work"
final=$out
out=$out/work
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 \
  TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # see launch/fetch_wheels.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
preset=${DLO_SUITE_PRESET:-medium}
tokens=${DLO_SUITE_TOKENS:-4096,16384}
status=0
# SM clock and power beside every step: at the 700 W limit a clock drop shows up as slower
# compute (docs/benchmarks.md, fourth session)
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu --format=csv \
    -lms 250 > "$out/nvidia_smi.csv" 2>&1 &
  smi_pid=$!
  trap 'kill $smi_pid 2>/dev/null' EXIT
fi
step() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $(date +%T) $name: $*" | tee -a "$out/suite.log"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $(date +%T) $name: exit $rc" | tee -a "$out/suite.log"
  tail -n 30 "$out/$name.log"
  [ "$rc" -eq 0 ] || status=1
  tar czf "$final/suite.tgz" -C "$out" .
}
for s in $steps; do
  case $s in
    tests)  # about 7-8 minutes on 2 x H200 (the 100-cycle test and 15 two-rank tests)
      step gpu_tests 540 python3 -m pytest -v -p no:cacheprovider -rs --durations=0 \
        tests/gpu tests/multigpu -k "not one_rank_failing" ;;
    failtests)  # the one-rank-failure cases wait for NCCL's watchdog: three at a time (~2.5 min)
      [ "$ngpu" -ge 2 ] && step gpu_fail_tests 200 python3 -m pytest -q -p no:cacheprovider -rs \
        -n 3 tests/multigpu/test_dlo_nccl.py -k one_rank_failing ;;
    nstests) [ "$ngpu" -ge 2 ] && step ns_tests 200 python3 -m pytest -v -p no:cacheprovider -rs \
        tests/multigpu/test_node_shared_gpu.py "tests/multigpu/test_dlo_nccl.py::test_nccl_parity_half_bytes_no_alloc" ;;
    runns) [ "$ngpu" -ge 2 ] && step run_node_shared 300 torchrun --nproc-per-node="$ngpu" -m dlo \
        run --preset "$preset" --steps 4 --tokens 4096 --transfer node-shared --check \
        --resident-layers 0 ;;
    codec)  # issue 22 on issue 24's machine: the codec under AllGather and node-shared, torchao under AllGather
      [ "$ngpu" -ge 2 ] && step codec_tests 300 python3 -m pytest -v -p no:cacheprovider -rs \
        tests/multigpu/test_codec_multigpu.py
      [ "$ngpu" -ge 2 ] && step bench_codec 420 torchrun --nproc-per-node="$ngpu" -m dlo bench \
        --preset "$preset" --tokens 4096 --codec none,ans \
        --methods resident,dlo-allgather,dlo-allgather-copy,dlo-node-shared \
        --json "$out/bench_codec.json" --markdown "$out/bench_codec.md" ;;
    compile2)  # issue 24: compile under AllGather and node-shared against compiled resident and FSDP2
      [ "$ngpu" -ge 2 ] && step bench_compile 540 torchrun --nproc-per-node="$ngpu" -m dlo bench \
        --preset "$preset" --compile --tokens "$tokens" \
        --methods resident,dlo-allgather-copy,dlo-node-shared,dlo-auto,fsdp2-offload \
        --json "$out/bench_compile.json" --markdown "$out/bench_compile.md" ;;
    pipeline2)  # issue 24: a saved Wan 14B-like folder, one GPU against N (peak RSS, cold start)
      step wan_save 300 python3 -m dlo save-pipeline --like wan2.1-t2v-14b /dev/shm/dlo_wan
      wan_args="--pipeline /dev/shm/dlo_wan --height 480 --width 832 --frames 81 --steps 3 --json"
      wan_args="$wan_args --resident-layers 0"  # the rows measure streaming (not the defaults)
      step wan_1gpu 400 python3 -m dlo run $wan_args
      for t in auto allgather; do
        [ "$ngpu" -ge 2 ] && step "wan_ngpu_$t" 400 torchrun --nproc-per-node="$ngpu" -m dlo run \
          $wan_args --transfer "$t"
      done ;;
    cp)  # issue 38: context parallelism with DLO on N GPUs (Wan 14B-like folder, 480p x 81
      # frames: 32760 tokens and 40 heads split N = 2, 4 or 8 ways), the same split resident
      [ -d /dev/shm/dlo_wan ] || step wan_save 300 python3 -m dlo save-pipeline \
        --like wan2.1-t2v-14b /dev/shm/dlo_wan
      cp_args="--pipeline /dev/shm/dlo_wan --height 480 --width 832 --frames 81 --steps 3 --json"
      for kind in ulysses ring; do
        [ "$ngpu" -ge 2 ] && step "cp_${kind}_resident" 400 torchrun --nproc-per-node="$ngpu" \
          -m dlo run $cp_args --context-parallel "$kind" --mode none
        [ "$ngpu" -ge 2 ] && step "cp_${kind}_dlo" 500 torchrun --nproc-per-node="$ngpu" \
          -m dlo run $cp_args --context-parallel "$kind" --transfer allgather --check \
          --resident-layers 0
      done ;;
    lane*)  # issue 38 on ONE GPU: every rank on GPU 0, gloo with CUDA tensors between them
      # (DLO_SHARE_GPU=1; dlo/platform/sharing.py). Correctness only: the ranks share one GPU,
      # so no timing here is a speed figure. lanetests, lanefail, lanerun, lanecp: one device
      # call each; "lane" runs all four
      lane=(env DLO_SHARE_GPU=1 CUDA_VISIBLE_DEVICES=0 PYTHONFAULTHANDLER=1)
      case $s in lane|lanetests)
        step lane_tests 560 "${lane[@]}" python3 -m pytest -v -p no:cacheprovider -rs \
          --durations=0 tests/multigpu -k "not one_rank_failing and not diverging" ;; esac
      case $s in lane|lanefail)  # the failure cases wait out their collective timeouts
        step lane_fail_tests 560 "${lane[@]}" python3 -m pytest -v -p no:cacheprovider -rs \
          --durations=0 tests/multigpu -k "one_rank_failing or diverging" ;; esac
      case $s in lane|lanerun)
        run2=("${lane[@]}" torchrun --nproc-per-node=2 -m dlo run --preset "$preset" --steps 3 \
          --tokens 4096 --check --resident-layers 0)
        step lane_run_allgather 150 "${run2[@]}" --transfer allgather
        step lane_run_node_shared 150 "${run2[@]}" --transfer node-shared
        step lane_run_codec 200 "${run2[@]}" --transfer allgather --codec ans
        step lane_run_compile 300 "${run2[@]}" --transfer allgather --compile
        step lane_run_3ranks 200 "${lane[@]}" torchrun --nproc-per-node=3 -m dlo run \
          --preset "$preset" --steps 3 --tokens 4096 --check --resident-layers 0 \
          --transfer allgather ;; esac
      case $s in lane|lanecp)  # context parallelism beside dlo's gathers (every block streams)
        for like in tiny-wan2.1 tiny-flux; do
          rm -rf "/tmp/lane_$like"
          step "lane_save_$like" 120 python3 -m dlo save-pipeline --like "$like" \
            --dtype bfloat16 "/tmp/lane_$like"
          kinds="ulysses"  # ring attention's cuDNN kernel needs a head size that 8 divides:
          [ "$like" = tiny-flux ] && kinds="ulysses ring"  # tiny-wan2.1's heads are 12 wide
          [ "$like" = tiny-flux ] && call=(--height 32 --width 32 --guidance 3.5) \
            || call=(--height 16 --width 16 --frames 5)
          for kind in $kinds; do  # resident context parallelism first, then under dlo
            cp=("${lane[@]}" torchrun --nproc-per-node=2 -m dlo run --pipeline "/tmp/lane_$like" \
              "${call[@]}" --max-sequence-length 16 --steps 2 --context-parallel "$kind" --json)
            step "lane_cp_${kind}_${like}_resident" 120 "${cp[@]}" --mode none
            step "lane_cp_${kind}_$like" 300 "${cp[@]}" --transfer allgather --resident-layers 0 \
              --check
          done
        done ;; esac ;;
    cetests) [ "$ngpu" -ge 2 ] && step ce_tests 200 python3 -m pytest -q -p no:cacheprovider -rs \
        tests/multigpu/test_dlo_nccl.py -k "copy and not one_rank_failing" ;;
    run)
      # every block streamed (--resident-layers 0), then the defaults (nothing streams where
      # the model fits)
      step run_1gpu 240 python3 -m dlo run --preset "$preset" --steps 4 --tokens 4096 --check \
        --resident-layers 0
      step run_1gpu_defaults 240 python3 -m dlo run --preset "$preset" --steps 4 --tokens 4096 \
        --check --explain
      [ "$ngpu" -ge 2 ] && step run_ngpu 300 torchrun --nproc-per-node="$ngpu" -m dlo run \
        --preset "$preset" --steps 4 --tokens 4096 --transfer allgather --check --resident-layers 0
      [ "$ngpu" -ge 2 ] && step run_hsdp 300 torchrun --nproc-per-node="$ngpu" -m dlo run \
        --preset "$preset" --steps 4 --tokens 4096 --transfer allgather --hsdp-shard "$ngpu" \
        --check --resident-layers 0 ;;
    bench1) step bench_1gpu 420 python3 -m dlo bench --preset "$preset" --tokens "$tokens" \
        --methods "${DLO_SUITE_METHODS1:-resident,dlo-ring,diffusers-group,dlo-swap}" \
        --json "$out/bench_1gpu.json" \
        --markdown "$out/bench_1gpu.md" --plot "$out/bench_1gpu.png" ;;
    bench2) [ "$ngpu" -ge 2 ] && step bench_ngpu 540 torchrun --nproc-per-node="$ngpu" -m dlo bench \
        --preset "$preset" --tokens "$tokens" ${DLO_SUITE_METHODS:+--methods "$DLO_SUITE_METHODS"} \
        ${DLO_SUITE_BENCH_ARGS:-} --json "$out/bench_ngpu.json" --markdown "$out/bench_ngpu.md" \
        --plot "$out/bench_ngpu.png" ;;
    profile)  # the AllGather gap: NCCL vs copy-engine gather vs rank-local, profiled
      [ "$ngpu" -ge 2 ] && step run_copy 200 torchrun --nproc-per-node="$ngpu" -m dlo run \
        --preset "$preset" --steps 3 --tokens 4096 --transfer allgather --gather-engine copy --check \
        --resident-layers 0
      [ "$ngpu" -ge 2 ] && step profile_ngpu 400 torchrun --nproc-per-node="$ngpu" -m dlo \
        bench --preset "$preset" \
        --methods dlo-allgather-copy,dlo-allgather-copy-kernel,dlo-allgather,dlo-rank-local \
        --tokens 4096,16384 --reps 5 --profile "$out/prof" --json "$out/profile_ngpu.json" ;;
    ctas) for c in ${DLO_SUITE_CTAS:-1 2 4 8}; do
        [ "$ngpu" -ge 2 ] && step "ctas$c" 200 torchrun --nproc-per-node="$ngpu" -m dlo bench \
          --preset "$preset" --methods dlo-allgather --tokens 4096,16384 --nccl-max-ctas "$c" \
          --json "$out/ctas$c.json"
      done ;;
    latecodec)  # issue 35: codec="auto" turning the codec on between forwards, by measurement
      step latecodec_tests 300 python3 -m pytest -v -p no:cacheprovider -rs \
        tests/gpu/test_late_codec_gpu.py ;;
    encdisk)  # issue 37 + 36: the disk tier read encoded, a LoRA fuse encoding blocks again
      step encdisk_tests 300 python3 -m pytest -v -p no:cacheprovider -rs \
        tests/gpu/test_disk_tier_gpu.py tests/gpu/test_adapters_gpu.py -k encoded
      # Wan2.1-14B (random bf16: a proxy for speed, never for the codec's ratio), 8 GiB host:
      # the first enable encodes the disk blocks into the folder's encoded checkpoint, then
      # the rows read them (DLO_SUITE_WAN: a folder saved already, else written to /tmp)
      wan=${DLO_SUITE_WAN:-/tmp/dlo_wan}
      [ -d "$wan" ] || step encdisk_save 200 python3 -m dlo save-pipeline --like wan2.1-t2v-14b \
        --dtype bfloat16 "$wan"
      step encdisk_bench 560 python3 -m dlo.bench.pipeline_disk "$wan" --host-budgets 8 \
        --size 480x832x1 --steps 2 --codec ans --probe-gb 1 \
        --json "$out/encdisk.json" --markdown "$out/encdisk.md" ;;
    ckpt)  # issue 10: checkpoint straight to per-rank shards vs the plain path (wan14b-like)
      ck=${DLO_SUITE_CKPT_PRESET:-wan14b-like}
      step ckpt_save 300 python3 -m dlo save-checkpoint --preset "$ck" --out /tmp/dlo_ckpt \
        --shard-gb 4
      for load in mapped copy; do
        [ "$ngpu" -ge 2 ] && step "ckpt_$load" 300 torchrun --nproc-per-node="$ngpu" -m dlo run \
          --preset "$ck" --checkpoint /tmp/dlo_ckpt --checkpoint-load "$load" \
          --transfer allgather --steps 2 --tokens 4096 --json --resident-layers 0
      done
      [ "$ngpu" -ge 2 ] && step ckpt_built 300 torchrun --nproc-per-node="$ngpu" -m dlo run \
        --preset "$ck" --transfer allgather --steps 2 --tokens 4096 --json --resident-layers 0
      # rank-local ranks sharing the page cache: host_backing="mapped" (bounded pinned staging)
      [ "$ngpu" -ge 2 ] && step ckpt_mapped_backing 300 torchrun --nproc-per-node="$ngpu" -m dlo \
        run --preset "$ck" --checkpoint /tmp/dlo_ckpt --host-backing mapped \
        --transfer rank-local --steps 2 --tokens 4096 --json --resident-layers 0 ;;
    auto)  # issue 11: dlo-auto against the manual settings on wan14b-like (N GPUs) and on one GPU
      [ "$ngpu" -ge 2 ] && step auto_wan 400 torchrun --nproc-per-node="$ngpu" -m dlo bench \
        --preset wan14b-like --tokens 4096,16384 --num-slots 2,3 \
        --methods dlo-rank-local,dlo-allgather-copy,dlo-auto --json "$out/auto_wan.json" \
        --markdown "$out/auto_wan.md"
      step auto_1gpu 240 python3 -m dlo bench --preset "$preset" --tokens "$tokens" \
        --num-slots 2,3 --methods dlo-ring,dlo-auto --json "$out/auto_1gpu.json" \
        --markdown "$out/auto_1gpu.md" ;;
    cesweep)  # chunk size with the copy-engine gather (the default engine on one node)
      [ "$ngpu" -ge 2 ] && step cesweep 300 torchrun --nproc-per-node="$ngpu" -m dlo bench \
        --preset "$preset" --methods dlo-allgather-copy --tokens "$tokens" --num-slots 3 \
        --chunk-mb 32,64,128 --reps 10 --json "$out/cesweep.json" --markdown "$out/cesweep.md" ;;
    sweep) for c in 16 32 128; do
        [ "$ngpu" -ge 2 ] && step "sweep_chunk$c" 300 torchrun --nproc-per-node="$ngpu" -m dlo bench \
          --preset "$preset" --methods dlo-allgather --tokens 4096 --chunk-mb "$c" \
          --json "$out/sweep_chunk$c.json"
      done ;;
  esac
done
exit $status
