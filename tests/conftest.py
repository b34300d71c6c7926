"""Suite-wide fixtures.

[Note: the thread count a test leaves behind]
Lightning's launchers set ``OMP_NUM_THREADS`` in the process that fits, to the cores over the ranks of that fit
(``_set_num_threads_if_needed``), and only where it is unset. A launcher run inside the pytest process (one-rank
fits had one until one process went without, [Note: the launcher] in ``parallel.py``) thus leaves
``OMP_NUM_THREADS=2`` on a 2-core machine, and every later two-rank child inherits it: the launcher then keeps two
threads a rank, four on two cores (four of the parity cases: 25.6-26.8 s against 18.9-20.3 s with it unset,
alternated). Each test starts from the environment the session started with.

[Note: two workers]
A serial run keeps CI's two cores 43% busy (18:59 of CPU over 25:20 on 2026-12-07): most tests are one process whose
tensors are too small for a second thread, and a rank waits on the other. So the README runs the suite on two
pytest-xdist workers (``-n 2``): 15:03 against 22:33, the fast tier 2:02 against 4:08.
``pytest_xdist_make_scheduler`` hands each worker a test module at a time, never a single test: a module-scoped
fixture (the four-rank launch, a checkpoint many tests read) then runs once, where xdist's default would run it on
both workers. The modules of ``SHARING_A_LAUNCH`` form one unit, as the session-scoped launches they read run once
(xdist's own ``--dist loadgroup`` does nothing on pytest 9, which ignores the node id it rewrites). A worker takes
its share of the cores as a rank does: one thread, set again after every test, since a one-rank fit sets every core.
"""

import os

import pytest
import torch

from lightning_chunk.ranks import cores_here

_OMP_NUM_THREADS = os.environ.get("OMP_NUM_THREADS")
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# the modules that read the session-scoped launches of tests/distributed/conftest.py: one unit for the workers
SHARING_A_LAUNCH = ("tests/distributed/test_two_ranks.py", "tests/distributed/test_two_rank_paths.py")

_THREADS = max(1, cores_here() // _WORKERS) if _WORKERS > 1 else torch.get_num_threads()  # a worker's share
torch.set_num_threads(_THREADS)


@pytest.fixture(autouse=True)
def _omp_num_threads_as_the_session_started():
    yield
    if _OMP_NUM_THREADS is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = _OMP_NUM_THREADS
    torch.set_num_threads(_THREADS)


def pytest_collection_modifyitems(items):
    """A test outside ``SHARING_A_LAUNCH`` that reads a session-scoped fixture of this suite would start that fixture
    again on the other worker ([Note: two workers]): refused, serial runs included."""
    for item in items:
        defs = item._fixtureinfo.name2fixturedefs  # the fixtures the test reads, through others too
        shared = [n for n, d in defs.items() if d and d[-1].scope == "session" and d[-1].baseid.startswith("tests")]
        if shared and item.nodeid.split("::")[0] not in SHARING_A_LAUNCH:
            raise pytest.UsageError(
                f"{item.nodeid} reads the session-scoped {shared}: add its module to SHARING_A_LAUNCH in conftest.py"
            )


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """A test module at a time, ``SHARING_A_LAUNCH`` as one, in the order of collection ([Note: two workers])."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # xdist's order, by test count, would leave the one-test soak to the end

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "the two-rank launches" if module in SHARING_A_LAUNCH else module

    return ModuleScheduling(config, log)
