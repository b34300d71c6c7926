"""The two-rank launches, once a session: each runs the cases the selected tests read (``cases.needed``), in
``test_two_ranks.py`` and ``test_two_rank_paths.py`` alike (each launch pays ~10 s of start-up on two ranks)."""

import os

import pytest

from tests.distributed.cases import cases_of, needed, unavailable
from tests.distributed.launch import AS_NCCL, GLOO_DEFAULTS, LAUNCHED, run, write_start_weights


def pytest_collection_modifyitems(items):
    """A test that reads a case this torch cannot run is skipped with the reason (``cases.unavailable``)."""
    for item in items:
        if "distributed" not in item.path.parts:
            continue
        for case in sorted(cases_of(item, "cases") or ()):
            why = unavailable(case)
            if why is not None:
                item.add_marker(pytest.mark.skip(reason=f"{case}: {why}"))


def _once_a_run(tmp_path_factory, launch: str) -> None:
    """Under pytest-xdist each worker's temporary folder is in the run's own: a launch some worker already started
    fails here rather than running twice, which would pass, only slower ([Note: two workers] in tests/conftest.py)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    claim = tmp_path_factory.getbasetemp().parent / f"{launch}.started"
    try:
        with claim.open("x") as f:
            f.write(worker)
    except FileExistsError:
        first = claim.read_text()
        raise AssertionError(f"{launch} starting on {worker} too, after {first}: see SHARING_A_LAUNCH") from None


@pytest.fixture(scope="session")
def parity_run(tmp_path_factory, request):
    """Every case that trains to completion that the selected tests read (all of them in a full run), in one
    launch (each launch pays ~10 s of start-up on two ranks), with gloo run as NCCL runs ([Note: gloo as NCCL]):
    ranks whose collective sequences part fail here."""
    _once_a_run(tmp_path_factory, "parity_run")
    out = tmp_path_factory.mktemp("two_ranks")
    write_start_weights(out)
    rc, log, _ = run(out, *needed(request, "parity_run", LAUNCHED), timeout=900, env=AS_NCCL)
    return out, rc, log


@pytest.fixture(scope="session")
def gloo_defaults_run(tmp_path_factory, request):
    """A few cases with gloo's own defaults: a group per kind of collective and the check once a micro-batch."""
    _once_a_run(tmp_path_factory, "gloo_defaults_run")
    out = tmp_path_factory.mktemp("two_ranks_gloo")
    rc, log, _ = run(out, *needed(request, "gloo_defaults_run", GLOO_DEFAULTS, marker="gloo_cases"), timeout=600)
    return out, rc, log
