"""``python -m dlo`` is the ``dlo`` command."""

import sys

from dlo.cli import main

sys.exit(main())
