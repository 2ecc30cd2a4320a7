"""Where the node-shared copy lives, and what the automatic policy may count on."""

from __future__ import annotations

import pytest

from dlo.platform import env as platform


def test_shared_memory_dir_prefers_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLO_SHM_DIR", "/some/where")
    assert platform.shared_memory_dir() == "/some/where"


def test_free_shared_memory_is_unknown_without_a_shared_memory_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    # the temporary directory is only a fallback (maybe on disk): "auto" must not count on it
    monkeypatch.delenv("DLO_SHM_DIR", raising=False)
    monkeypatch.setattr(platform.os.path, "isdir", lambda p: False)
    assert platform.shared_memory_free_nbytes() is None
    monkeypatch.setenv("DLO_SHM_DIR", str(tmp_path))
    free = platform.shared_memory_free_nbytes()
    assert free is not None and free > 0
