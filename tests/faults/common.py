"""Helpers of the fault tests: two-rank jobs run as plain processes, and what a checkpoint directory holds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """Two ranks of ``script`` started as separate processes (no launcher that would kill the survivor)."""

    def __init__(self, script: Path, *args: str, world_size: int = 2, env: Optional[dict] = None) -> None:
        port = str(free_port())
        self.start = time.monotonic()
        self.procs = []
        for r in range(world_size):
            e = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_"))}
            e.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, PYTHONPATH=str(ROOT), **(env or {}))
            self.procs.append(subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True, cwd=ROOT))

    def wait(self, timeout: float = 240) -> list[tuple[int, str, str, float]]:
        """``(returncode, stdout, stderr, seconds since start)`` per rank."""
        out = []
        for p in self.procs:
            try:
                so, se = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - self.start)))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                so, se = p.communicate()
                se += "\nHUNG: killed by the test"
            out.append((p.returncode, so, se, time.monotonic() - self.start))
        return out


class Zygotes:
    """One ``--zygote`` process per rank of ``script``: each job is a fork of the already-imported interpreter."""

    def __init__(self, script: Path, world_size: int = 2) -> None:
        self.procs = []
        for r in range(world_size):
            e = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_"))}
            e.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                     PYTHONPATH=str(ROOT))
            self.procs.append(subprocess.Popen([sys.executable, str(script), "--zygote"], env=e, cwd=ROOT, text=True,
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE))

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
            read = lambda s: Path(f"{out}.rank{r}.{s}").read_text()
            results.append((int(line[1]), read("out"), read("err"), float(line[2])))
        return results

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait(timeout=30)


def saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint's DCP part, read whole on this process."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
           if hasattr(m, "size")}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def find_last(dirpath: Path) -> Optional[str]:
    """What Lightning's ``fit(ckpt_path="last")`` picks in ``dirpath`` (its own code, not a copy of it)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    t = L.Trainer(callbacks=[ModelCheckpoint(dirpath=dirpath)], logger=False, enable_progress_bar=False,
                  enable_model_summary=False)
    return t._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", model_provided=True,
                                                    model_connected=True)
