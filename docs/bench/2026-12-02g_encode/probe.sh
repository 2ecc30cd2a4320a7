#!/usr/bin/env bash
# one device call: step rates, then cProfile of the medium preset's enable with and without
# the codec, from a checkpoint and from memory
set -x
out=$1
python3 docs/bench/2026-12-02g_encode/probe_rates.py $out/rates.json > $out/rates.log 2>&1
python3 -m dlo save-checkpoint --preset medium --out /dev/shm/ckpt > $out/save.log 2>&1
for c in none ans; do
  python3 -m cProfile -o $out/prof_ckpt_$c.out -m dlo run --preset medium --checkpoint /dev/shm/ckpt \
    --codec $c --steps 1 --tokens 4096 --json > $out/run_ckpt_$c.json 2> $out/run_ckpt_$c.err
done
python3 -m cProfile -o $out/prof_mem_ans.out -m dlo run --preset medium --codec ans --steps 1 \
  --tokens 4096 --json > $out/run_mem_ans.json 2> $out/run_mem_ans.err
python3 -m dlo run --preset medium --codec none --steps 1 --tokens 4096 --json > $out/run_mem_none.json 2> $out/run_mem_none.err
