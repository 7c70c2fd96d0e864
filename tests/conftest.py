"""Session hooks shared by every test."""

from __future__ import annotations

import sys

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    # When a selected test uses the gloo ranks of tests/dist.py, start the fork server's ~3 s import
    # of torch now so that it overlaps the tests that run before the first distributed one.
    dist_harness = sys.modules.get("tests.dist")
    if dist_harness is None or session.config.option.collectonly:
        return
    modules = {item.module for item in session.items if isinstance(item, pytest.Function)}
    if any(getattr(value, "__module__", None) == "tests.dist" for module in modules for value in vars(module).values()):
        dist_harness.prestart_fork_server()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Stop the pooled gloo ranks (Note [persistent rank pools] in tests/dist.py) so pytest exits at
    # once and leaves no processes behind. Look the module up rather than import it: a planner-only
    # run never imports torch and should not start now.
    dist_harness = sys.modules.get("tests.dist")
    if dist_harness is not None:
        dist_harness.shutdown_pools()
