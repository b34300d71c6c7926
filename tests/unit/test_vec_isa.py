"""[Note: the vector ISA probe]: the pick made with probe children that load alone is inductor's own, or left to
inductor. On torch 2.13 (CI) inductor's children load alone already; the tests take the older torches' path by
saying its probe is slow, which runs the same patched children there."""

from __future__ import annotations

import platform
import sys

import pytest
from torch._inductor import cpu_vec_isa as isa

from lightning_chunk.engine.optim import vec_isa

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="the probe is patched on x86-64 Linux only"
)


@pytest.fixture
def inductor_s_pick():
    """Inductor's own pick and list, made from empty caches; the caches are emptied again after the test."""
    vec_isa._forget(isa)
    plain = (str(isa.pick_vec_isa()), [str(i) for i in isa.valid_vec_isa_list()])
    vec_isa._forget(isa)
    yield plain
    vec_isa._forget(isa)


def test_the_pick_with_children_that_load_alone_is_inductor_s_own(monkeypatch, inductor_s_pick):
    seen = []  # the code each probe child was given
    real_env = isa.python_subprocess_env

    def env():
        seen.append(isa.VecISA._avx_py_load)
        return real_env()

    monkeypatch.setattr(isa, "python_subprocess_env", env)
    monkeypatch.setattr(vec_isa, "_slow_probe", lambda _: True)
    code = isa.VecISA._avx_py_load
    picked = vec_isa.pick()
    assert (str(picked), [str(i) for i in isa.valid_vec_isa_list()]) == inductor_s_pick
    assert seen and all("import torch" not in c for c in seen)  # no child imported torch
    assert isa.VecISA._avx_py_load == code and isa.python_subprocess_env is env  # both put back


def test_a_candidate_that_fails_in_a_child_that_loads_alone_is_left_to_inductor(monkeypatch, inductor_s_pick):
    monkeypatch.setattr(vec_isa, "_slow_probe", lambda _: True)
    monkeypatch.setattr(vec_isa, "_LOAD_ALONE", "\nraise SystemExit(1)\n")  # every such child fails
    picked = vec_isa.pick()
    assert (str(picked), [str(i) for i in isa.valid_vec_isa_list()]) == inductor_s_pick
