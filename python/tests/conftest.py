"""No skip counts as a pass on the GPU machine: with
TP_ALLREDUCE_REQUIRE_GPU=1, a test that skipped for any reason other than
``_gate.not_applicable`` is reported as failed (``pytest -rs`` lists the
skips of ordinary runs)."""

import pytest
from _gate import NOT_APPLICABLE, REQUIRE_GPU


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (REQUIRE_GPU and report.skipped) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    if NOT_APPLICABLE not in reason:
        report.outcome = "failed"
        report.longrepr = f"TP_ALLREDUCE_REQUIRE_GPU=1: this test skipped, which counts as a failure here ({reason})"
