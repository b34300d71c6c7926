"""Helpers of the fault tests: two-rank jobs run as plain processes, and what a checkpoint directory holds."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tests.children import child_env
from tests.forked import ForkedProcess, forkable

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """Ranks of ``script`` started as separate processes, as torchrun or SLURM start them (no launcher that would
    kill the survivor); their output goes to files, so a long traceback cannot block them. ``nodes``: the ranks
    numbered node by node as on that many machines (``NODE_RANK``, ``LOCAL_RANK`` within the node and torchrun's
    ``LOCAL_WORLD_SIZE``), all on this one."""

    def __init__(
        self, script: Path, out: Path, *args: str, world_size: int = 2, nodes: int = 1, env: dict | None = None
    ) -> None:
        if world_size % nodes:
            raise ValueError(f"world_size={world_size} is not a whole number of ranks on each of nodes={nodes}")
        per_node = world_size // nodes
        port = str(free_port())
        self.out, self.files = out, []
        self.procs: list[Any] = []
        out.mkdir(parents=True, exist_ok=True)
        for r in range(world_size):
            e = child_env()
            e.update(
                RANK=str(r),
                LOCAL_RANK=str(r % per_node),
                NODE_RANK=str(r // per_node),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(per_node),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                PYTHONPATH=str(ROOT),
                OMP_NUM_THREADS="1",
            )  # as torchrun sets it: spinning thread pools of 2 ranks on 2 cores cost 3x
            e.update(env or {})
            so, se = out / f"rank{r}.out", out / f"rank{r}.err"
            if forkable(e):  # [Note: forked ranks] in tests/forked.py
                self.procs.append(ForkedProcess(script, [str(out), *args], e, ROOT, so, se))
                continue
            files = [open(so, "w"), open(se, "w")]  # noqa: SIM115 (closed in wait)
            self.files += files
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(out), *args], env=e, stdout=files[0], stderr=files[1], cwd=ROOT
                )
            )

    def wait(self, timeout: float = 240, *, until_first: bool = False) -> list[tuple[int | None, str, str, float]]:
        """``(returncode, stdout, stderr, time.time() at exit)`` per rank; ``until_first``: return once one rank
        exited, having killed the others (a stopped rank never exits by itself). A rank still running at
        ``timeout`` is killed and reported with returncode None."""
        ended: dict[int, tuple[int, float]] = {}
        deadline = time.monotonic() + timeout
        while len(ended) < len(self.procs) and time.monotonic() < deadline:
            for r, p in enumerate(self.procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = (p.returncode, time.time())
            if until_first and ended:
                break
            time.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in self.files:
            f.close()
        out = []
        for r in range(len(self.procs)):
            rc, at = ended.get(r, (None, time.time()))
            out.append((rc, (self.out / f"rank{r}.out").read_text(), (self.out / f"rank{r}.err").read_text(), at))
        return out


class Zygotes:
    """One ``--zygote`` process per rank of ``script``: each job is a fork of the already-imported interpreter."""

    def __init__(self, script: Path, world_size: int = 2) -> None:
        self.procs = []
        for r in range(world_size):
            e = child_env()
            e.update(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                PYTHONPATH=str(ROOT),
                OMP_NUM_THREADS="1",
            )  # as Ranks: one thread a rank
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), "--zygote"],
                    env=e,
                    cwd=ROOT,
                    text=True,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
            )

    def run(self, out: Path, *args: str) -> list[tuple[int, str, str, float]]:
        """``(returncode, stdout, stderr, seconds)`` per rank of one job writing under ``out``."""
        port = free_port()
        for p in self.procs:
            p.stdin.write(f"{out} {' '.join(args)} {port}\n")
            p.stdin.flush()
        results = []
        for r, p in enumerate(self.procs):
            line = p.stdout.readline().split()
            assert line and line[0] == "RESULT", f"zygote {r} died"

            def read(s):
                return Path(f"{out}.rank{r}.{s}").read_text()

            results.append((int(line[1]), read("out"), read("err"), float(line[2])))
        return results

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait(timeout=30)


def saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint's DCP part, read whole on this process."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if hasattr(m, "size")
    }
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def find_last(dirpath: Path) -> str | None:
    """What Lightning's ``fit(ckpt_path="last")`` picks in ``dirpath`` (its own code, not a copy of it)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    from tests.models import quiet_trainer

    t = quiet_trainer(callbacks=[ModelCheckpoint(dirpath=dirpath)], enable_checkpointing=True)
    return t._checkpoint_connector._parse_ckpt_path(
        TrainerFn.FITTING, "last", model_provided=True, model_connected=True
    )
