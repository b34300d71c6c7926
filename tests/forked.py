"""Rank processes forked from an interpreter that has already imported torch, Lightning and this package.

[Note: forked ranks]
A fresh interpreter spends about 10 s of CPU importing Lightning on the CI's machine (torch 3.5 s; Lightning imports
``torch._dynamo`` and ``torchmetrics``, whose text metrics import ``transformers`` where it is installed), and the
suite starts its multi-rank scripts some forty times, two to four ranks each: on two cores that was a third of the
full suite's time. ``Ranks`` (tests/faults/common.py) therefore starts each rank as a child of one fork server
(``multiprocessing``'s ``forkserver``, which preloads ``tests.forked_preload``), and the child runs the script as
``python script.py`` would: ``sys.argv``, ``__main__``, the script's directory first on ``sys.path``, the working
directory, the environment and stdout/stderr redirected to files, the exit status a ``Popen``'s (a signal's
negative number). What an exec would do and a fork cannot is done by hand: the thread count ``OMP_NUM_THREADS``
asks for (OpenMP read the server's environment when torch loaded), and the rank Lightning's ``rank_zero_only``
read from the environment at import. A job whose environment sets what only a process start reads
(``GLIBC_TUNABLES``, ``MALLOC_*``, ``LD_PRELOAD``), or ``LIGHTNING_CHUNK_TEST_EXEC=1``, still gets a fresh process.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_CONTEXT: Any = None
EXEC_ONLY = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_")


def forkable(env: Mapping[str, str]) -> bool:
    """Whether a job with ``env`` can be a fork: nothing in it is read only when a process starts."""
    if env.get("LIGHTNING_CHUNK_TEST_EXEC", "0") not in ("", "0"):
        return False
    return not any(k.startswith(EXEC_ONLY) for k in env)


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.forked_preload"])
        _CONTEXT = ctx
    return _CONTEXT


def _run(script: str, args: Sequence[str], env: Mapping[str, str], cwd: str, out: str, err: str | None) -> None:
    """In the forked child: run ``script`` as ``python script args`` would, and exit with its status (``err=None``:
    stderr goes where stdout goes)."""
    for fd, path in ((1, out), (2, err)):
        if path is None:
            os.dup2(1, fd)
            continue
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own streams)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning.pytorch.utilities import rank_zero as pytorch_rank_zero

    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    rank = fabric_rank_zero._get_rank()
    fabric_rank_zero.rank_zero_only.rank = pytorch_rank_zero.rank_zero_only.rank = rank or 0  # type: ignore[attr-defined]
    module = script[3:] if script.startswith("-m ") else None  # ``python -m module``
    sys.argv = [script if module is None else module, *args]
    first = cwd if module is not None else str(Path(script).parent)
    sys.path[:0] = [first, *([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])]
    code: Any = 0
    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path = ROOT, timeout: float = 300) -> Any:
    """``subprocess.run(argv, capture_output=True, text=True)`` for ``[sys.executable, script or -m module, ...]``,
    forked where it can be (a fresh process where ``env`` needs one): a ``CompletedProcess``."""
    env = dict(os.environ if env is None else env)
    if argv[0] != sys.executable or not forkable(env):
        return subprocess.run(list(argv), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    target = f"-m {argv[2]}" if argv[1] == "-m" else argv[1]
    rest = list(argv[3:] if argv[1] == "-m" else argv[2:])
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "out", Path(d) / "err"
        p = ForkedProcess(Path(target), rest, env, cwd, out, err)
        if p.wait(timeout) is None:
            p.kill()
            p.wait()
            raise subprocess.TimeoutExpired(list(argv), timeout)
        return subprocess.CompletedProcess(list(argv), p.returncode, out.read_text(), err.read_text())


class ForkedProcess:
    """The part of ``subprocess.Popen`` that ``Ranks`` uses, for a rank forked from the preloaded server."""

    def __init__(
        self, script: Path, args: Sequence[str], env: Mapping[str, str], cwd: Path, out: Path, err: Path | None
    ) -> None:
        where = (str(out), None if err is None else str(err))
        # ``script`` may be ``-m module``
        self._p = _context().Process(target=_run, args=(str(script), list(args), dict(env), str(cwd), *where))
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def kill(self) -> None:
        if self._p.exitcode is None:
            self._p.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self._p.join(timeout)
        return self._p.exitcode
