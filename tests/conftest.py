"""Suite-wide fixtures.

[Note: the thread count a test leaves behind]
Lightning's launchers set ``OMP_NUM_THREADS`` in the process that fits, to the cores over the ranks of that fit
(``_set_num_threads_if_needed``), and only where it is unset. A launcher run inside the pytest process (one-rank
fits had one until one process went without, [Note: the launcher] in ``parallel.py``) thus leaves
``OMP_NUM_THREADS=2`` on a 2-core machine, and every later two-rank child inherits it: the launcher then keeps two
threads a rank, four on two cores (four of the parity cases: 25.6-26.8 s against 18.9-20.3 s with it unset,
alternated). Each test starts from the environment the session started with.
"""

import os

import pytest

_OMP_NUM_THREADS = os.environ.get("OMP_NUM_THREADS")


@pytest.fixture(autouse=True)
def _omp_num_threads_as_the_session_started():
    yield
    if _OMP_NUM_THREADS is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = _OMP_NUM_THREADS
