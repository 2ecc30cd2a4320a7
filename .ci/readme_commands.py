"""Print the commands of README.md's quick-start block, one per line (for .ci/run)."""

import sys

with open(sys.argv[1], encoding="utf-8") as fh:
    text = fh.read()
marker = "<!-- quick-start -->"
if marker not in text:
    sys.exit(f"{sys.argv[1]}: no {marker} block")
block = text.split(marker, 1)[1].split("```", 2)[1]
for line in block.splitlines()[1:]:
    line = line.strip()
    if line and not line.startswith("#"):
        print(line)
