"""Suite-wide guard: a test run leaves nothing in the temporary directory.

[Note: nothing left in the temp directory]
Each pytest process (each xdist worker) points ``tempfile`` and ``TMPDIR`` (inherited by
the ranks and commands tests start) at a directory of its own for the whole session. At the
end, whatever dlo or a test left there (a checkpoint saved with ``mkdtemp`` and never removed,
a writer's temporary file, a spill) fails the session with its names, and the directory is
removed either way. pytest's own ``tmp_path`` directories live outside it (pytest keeps the
last few runs' by design), and torch's compile cache keeps its usual home. What other
libraries leave by their own design (:data:`THIRD_PARTY`: multiprocessing's and torchrun's
per-process folders, removed at their exit or never) is not counted.
"""

from __future__ import annotations

import getpass
import multiprocessing.util
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

THIRD_PARTY = ("pymp-", "torchelastic_", "torchinductor_", "triton", ".ses", "mat-debug-")
"""Name prefixes of what multiprocessing, torchrun and torch's compilers leave in the temp
directory themselves, and the device machine's CUDA stack (``.ses`` and ``mat-debug-<pid>.log``,
written by no dlo code, seen on the H100 image on 2026-12-05)."""


@pytest.fixture(autouse=True, scope="session")
def nothing_left_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    tmp_path_factory.getbasetemp()  # pytest's own, before the temp directory moves
    # this process's multiprocessing folder too: it is removed at exit, after the session's
    multiprocessing.util.get_temp_dir()
    before_dir, before_env = tempfile.tempdir, os.environ.get("TMPDIR")
    home = tempfile.gettempdir()
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(home, f"torchinductor_{getpass.getuser()}")
    )
    session = tempfile.mkdtemp(prefix="dlo-tests-", dir=home)
    tempfile.tempdir, os.environ["TMPDIR"] = session, session
    try:
        yield
    finally:
        tempfile.tempdir = before_dir
        if before_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before_env
        left = sorted(n for n in os.listdir(session) if not n.startswith(THIRD_PARTY))
        shutil.rmtree(session, ignore_errors=True)
    assert not left, f"the tests left these in the temporary directory: {left}"
