"""Print the commands of README.md's quick-start block, one per line (for .ci/run)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for tests/
from tests.doc_blocks import marked  # stdlib only: it runs before the install

try:
    block = marked(Path(sys.argv[1]), "quick-start")
except ValueError as e:
    sys.exit(str(e))
for line in block.code.splitlines():
    line = line.strip()
    if line and not line.startswith("#"):
        print(line)
