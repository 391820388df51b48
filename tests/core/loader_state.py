"""The loader tests' shared state: every test starts and ends with a loader that has compiled nothing."""

import pytest

from adaln_lab.core import loader


@pytest.fixture(autouse=True)
def fresh_loader(monkeypatch):
    """No import problem recorded, no in-memory-cache override, no compiled module held (before and after)."""
    monkeypatch.setattr(loader, "IMPORT_PROBLEM", None)
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    loader.clear_caches()
    yield
    loader.clear_caches()
