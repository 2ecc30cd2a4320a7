#!/usr/bin/env bash
# Issue 35 on one GPU: dlo with no offload flags against every block streamed (the old
# defaults: --resident-layers 0 --num-slots 2) and against resident, each in its own process.
#   bash launch/defaults_probe.sh OUT medium            the medium preset, 4096 tokens, 6 steps
#   bash launch/defaults_probe.sh OUT folder LIKE DIR   a `save-pipeline --like LIKE` folder
#                                                       (written to DIR when missing), SIZES
#                                                       its call (default 1024 x 1024), 4 steps
# Reports land in OUT as JSON with a markdown table (OUT/table.md) of every row.
set -uo pipefail
out=${1:?usage: defaults_probe.sh OUT medium|folder LIKE DIR}
what=${2:-medium}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
row() {  # name, command...: one report per row; a failure is shown and the probe goes on
  local name=$1; shift
  "$@" > "$out/$name.json" 2> "$out/$name.err" || echo "$name failed: $(tail -3 "$out/$name.err")"
}
if [ "$what" = medium ]; then
  run=(python3 -m dlo run --preset medium --tokens 4096 --steps 6 --json)
  row defaults "${run[@]}"
  row streamed "${run[@]}" --resident-layers 0 --num-slots 2
  row resident "${run[@]}" --mode none
else
  like=${3:?folder needs LIKE}; dir=${4:?folder needs DIR}
  [ -f "$dir/model_index.json" ] || python3 -m dlo save-pipeline --like "$like" "$dir" \
    > "$out/save.log" 2>&1 || { tail -20 "$out/save.log"; exit 1; }
  read -r -a sizes <<< "${SIZES:---height 1024 --width 1024}"
  call=("$dir" "${sizes[@]}" --steps 4)
  row defaults python3 -m dlo run --pipeline "${call[@]}" --json
  row streamed python3 -m dlo run --pipeline "${call[@]}" --json --resident-layers 0 --num-slots 2
  [ -n "${BUDGETS:-}" ] && for b in ${BUDGETS//,/ }; do
    row "defaults_budget$b" python3 -m dlo run --pipeline "${call[@]}" --json \
      --device-budget-gb "$b"
  done
  row resident python3 -m dlo.bench.pipeline_peers "${call[@]}" --method resident
fi
python3 - "$out" <<'PY' | tee "$out/table.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| row | steady step ms (median) | first step ms | resident blocks | streamed blocks | slots | HBM peak GiB |")
print("|---|---|---|---|---|---|---|")
for p in sorted(out.glob("*.json")):
    try:
        r = json.loads(p.read_text())
    except ValueError:
        print(f"| {p.stem} | failed | | | | | |")
        continue
    r = r[0] if isinstance(r, list) else r
    print(f"| {p.stem} | {r['step_ms_median']:.1f} | {r['first_step_ms']:.1f} | "
          f"{r.get('num_resident_blocks', '-')} | {r.get('num_streamed_blocks', '-')} | "
          f"{r.get('num_slots', '-')} | "
          f"{r['hbm_peak_nbytes'] / 2**30:.2f} |")
PY
