"""Another local user, for the tests of files they could plant (issue 39): commands run as
uid and gid 65534 (``nobody``) where the tests run as root, and skipped otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

OTHER_UID = 65534
IS_ROOT = os.geteuid() == 0
ROOT_ONLY = pytest.mark.skipif(
    not IS_ROOT, reason="a file of another uid can be made only by root (CI runs as root)"
)


def as_other_user(
    cwd: Path, code: str, *args: str, stdin: bytes = b"", before: str = "", check: bool = True
) -> subprocess.CompletedProcess[bytes]:
    """Run the Python ``code`` (``os`` and ``sys`` imported, ``args`` as ``sys.argv[1:]``)
    in directory ``cwd`` as uid and gid :data:`OTHER_UID`. The interpreter starts as root and drops to that user before
    ``code``, so ``code`` uses only what is loaded and names paths relative to ``cwd``
    (the test's temporary directories are not open to others); ``before`` runs as root
    first (the imports ``code`` needs: the interpreter's own files are root's). With
    ``check=False`` a failure is not raised and the output is captured, both returned."""
    assert IS_ROOT
    prog = f"import os, sys\n{before}\n"
    prog += f"os.setgroups([])\nos.setgid({OTHER_UID})\nos.setuid({OTHER_UID})\n"
    return subprocess.run(
        [sys.executable, "-c", prog + code, *args],
        cwd=cwd,
        input=stdin,
        check=check,
        capture_output=not check,
        timeout=60,
    )


def team_directory(path: Path) -> Path:
    """A directory every local user can write, without the sticky bit (a team's model
    folder: the kernel's protected-symlink rules of ``/tmp`` do not apply)."""
    path.mkdir()
    path.chmod(0o777)
    return path
