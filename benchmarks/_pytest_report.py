"""Outcomes and reasons from a ``pytest -v --tb=short`` report: what the campaign's ``tests`` part keeps of
``tests/gpu`` (``gpu_campaign.py``), since no one can rerun a lease."""

from __future__ import annotations


def outcomes(lines: list[str]) -> dict[str, str]:
    """Each test's outcome from ``pytest -v``'s lines (``path::name PASSED [ 5%]``), in the order they ended."""
    out = {}
    for ln in lines:
        test, _, rest = ln.partition(" ")
        word = rest.split(" ", 1)[0]
        if "::" in test and word in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"):
            out[test] = word
    return out


def failure_reasons(lines: list[str], most: int = 10, per_test: int = 8) -> dict[str, list[str]]:
    """Why each test failed, from pytest's ``--tb=short`` report: per test (its section's title), the line the error
    was raised at and the first ``E`` lines of the error. A lease's JSON must say why, since no one can rerun it."""
    reasons: dict[str, list[str]] = {}
    test, where = None, ""
    for ln in lines:
        title = ln.strip("_ ")
        if ln.startswith("____") and title:
            test, where = (title if len(reasons) < most else None), ""
            if test is not None:
                reasons[test] = []
        elif ln.startswith(("====", "FAILED", "ERROR")):
            test = None
        elif test is not None and ln.startswith("E "):
            if not reasons[test] and where:
                reasons[test].append(where)
            if len(reasons[test]) < per_test:
                reasons[test].append(ln[1:].strip())
        elif test is not None and not reasons[test] and ln and not ln.startswith(" "):
            where = ln.strip()  # ``path:line: in function``, the innermost frame before the error
    return reasons
