#!/usr/bin/env bash
# Issue 35 item 1 on one GPU: `dlo run` with no offload flags against the old defaults
# (every block streamed through 2 slots) and against no offload, on the medium preset, then
# a tiny FLUX folder with no flags and --check. Usage: bash launch/defaults_probe.sh OUT
set -uo pipefail
out=${1:?usage: defaults_probe.sh OUT}
mkdir -p "$out"
run() {  # name, args...
  local name=$1; shift
  python3 -m dlo run --preset medium --tokens 4096 --steps 6 --json "$@" \
    > "$out/$name.json" 2> "$out/$name.err" || echo "$name failed: $(tail -3 "$out/$name.err")"
}
run defaults
run old-defaults --resident-layers 0 --num-slots 2
run resident --mode none
python3 -m dlo save-pipeline --like tiny-flux --out "$out/tiny-flux" > /dev/null 2>&1 \
  && python3 -m dlo run --pipeline "$out/tiny-flux" --steps 2 --check --explain \
    > "$out/folder.txt" 2>&1; echo "folder rc=$?" >> "$out/folder.txt"
rm -rf "$out/tiny-flux"
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("| run | step ms (median) | first step ms | resident blocks | slots | HBM peak GiB |")
print("|---|---|---|---|---|---|")
for name in ("defaults", "old-defaults", "resident"):
    p = out / f"{name}.json"
    if not p.exists() or not p.read_text().strip():
        print(f"| {name} | failed | | | | |"); continue
    r = json.loads(p.read_text())[0]
    print(f"| {name} | {r['step_ms_median']:.1f} | {r['first_step_ms']:.1f} | "
          f"{r.get('num_resident_blocks', '-')} | {r.get('num_slots', '-')} | "
          f"{r['hbm_peak_nbytes'] / 2**30:.2f} |")
PY
