"""One rank of a two-rank engine job that saves a checkpoint and may be killed part-way (no Lightning).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python save_worker.py DIR STEPS KILL

Trains ``STEPS`` steps of a small model (deterministic: every run with the same STEPS ends in the same state)
and saves it to ``DIR/last.ckpt``. ``KILL`` is ``none``, or ``<rank>:<event>:<who>``: when rank ``<rank>``
reaches its ``<event>``-th file-system or collective event of the save, it SIGKILLs itself (``who=one``) or
every rank (``who=all``) before that event happens. Append ``:fallback`` to refuse ``renameat2`` and exercise
the two-rename fallback. With ``KILL=count`` the save runs to the end and each rank prints ``EVENTS <n>``
and the name of each event. A ``KILL`` ending in ``+bg`` writes the save in the background while the ranks train
one more step (which the checkpoint must not see), then waits for it. The engine is imported without the
package's Lightning glue.

    RANK=r ... python save_worker.py --zygote

imports torch once and then, for each line ``DIR STEPS KILL PORT`` on stdin, forks a child that runs the job
above (its output to ``DIR.rank<r>.out`` / ``.err``) and prints ``RESULT <returncode> <seconds>``: a kill
point then costs a fork, not an interpreter and torch's import. Nothing in the zygote touches torch's thread
pools or a process group before it forks.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
_pkg = types.ModuleType("lightning_chunk")
_pkg.__path__ = [str(ROOT / "lightning_chunk")]
sys.modules["lightning_chunk"] = _pkg

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint.filesystem as dcp_fs  # noqa: E402

from lightning_chunk.engine import ChunkConfig, ChunkEngine, Collectives  # noqa: E402
from lightning_chunk.engine.state import checkpoint  # noqa: E402
from lightning_chunk.engine.system import atomic  # noqa: E402
from tests.engine_steps import step  # noqa: E402

TIMEOUT_S = 20.0


def build(steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(40, 40) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    comm = Collectives(timeout_s=TIMEOUT_S)
    eng = ChunkEngine(model, [opt], config=ChunkConfig(placement="host", chunk_numel=1700), collectives=comm)
    rank = comm.rank
    for i in range(steps):
        step(eng, model, opt, torch.randn(4, 40, generator=torch.Generator().manual_seed(100 * i + rank)))
    return eng, model, opt, comm


class Events:
    """Counts the save's events on this rank; SIGKILLs at the chosen one."""

    def __init__(self, comm: Collectives, kill: str) -> None:
        self.comm, self.n, self.names = comm, 0, []
        self.target = None
        if kill not in ("none", "count"):
            rank, event, who, *rest = kill.split(":")
            if int(rank) == comm.rank:
                self.target = (int(event), who)
            if "fallback" in rest:
                atomic.exchange = lambda a, b: False

    def __call__(self, name: str) -> None:
        self.n += 1
        self.names.append(name)
        if self.target is not None and self.n == self.target[0]:
            if self.target[1] == "all":
                for r, (pid, _) in enumerate(self.comm.peers):
                    if r != self.comm.rank:
                        os.kill(pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        def wrap(owner, attr, name):
            fn = getattr(owner, attr)

            def hooked(*a, **k):
                self(name)
                return fn(*a, **k)

            setattr(owner, attr, hooked)

        wrap(os, "replace", "os.replace")
        wrap(os, "rename", "os.rename")
        wrap(os, "fsync", "os.fsync")
        wrap(os, "mkdir", "os.mkdir")
        wrap(shutil, "rmtree", "rmtree")
        wrap(torch, "save", "torch.save")
        wrap(dcp_fs, "_write_item", "dcp write item")
        wrap(atomic, "exchange", "exchange")
        wrap(Collectives, "failed_ranks", "agreement")


def save(eng, model, opt, comm, path: Path, steps: int, background: bool) -> None:
    """Save the state after ``steps`` steps; ``background``: written beside one more training step, whose
    changes the checkpoint must not see, then waited for (where a failure of the save is raised)."""
    checkpoint.save_sharded(eng, path, {"steps": steps}, with_optimizer=True, background=background)
    if background:
        step(eng, model, opt, torch.randn(4, 40, generator=torch.Generator().manual_seed(100 * steps + comm.rank)))
        eng.manager.readers.settle()


def main(out: Path, steps: int, kill: str) -> None:
    background = kill.endswith("+bg")
    kill = kill.removesuffix("+bg")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    eng, model, opt, comm = build(steps)
    if kill.startswith(("fsize:", "enospc:")):
        return save_fails_then_succeeds(eng, model, opt, comm, out, steps, kill, background)
    events = Events(comm, kill)
    events.install()
    try:
        save(eng, model, opt, comm, out / "last.ckpt", steps, background)
    except Exception as e:  # noqa: BLE001 - the survivor of a killed peer reports and fails
        print(f"SAVE-FAILED rank={comm.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    if kill == "count":
        print(f"EVENTS {events.n} " + " ".join(n.replace(" ", "_") for n in events.names), flush=True)
    print(f"SAVED rank={comm.rank}", flush=True)
    dist.destroy_process_group()


def save_fails_then_succeeds(eng, model, opt, comm, out: Path, steps: int, how: str, background: bool) -> None:
    """``fsize:<rank>``: that rank may write only 8 kB a file (a real EFBIG from the kernel, as on a full disk);
    ``enospc:<rank>``: that rank's storage writer raises ENOSPC. The save must fail on every rank; then, with the
    limit gone, a second save of the same state must succeed."""
    import errno
    import resource

    kind, rank = how.split(":")
    original = dcp_fs._write_item
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if int(rank) == comm.rank:
        if kind == "fsize":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (8_000, old_limit[1]))  # a file holds 15 kB
        else:

            def full(*a, **k):
                raise OSError(errno.ENOSPC, "No space left on device")

            dcp_fs._write_item = full
    try:
        save(eng, model, opt, comm, out / "last.ckpt", steps, background)
        print("UNEXPECTED-SUCCESS", flush=True)
    except checkpoint.CheckpointSaveError as e:
        print(f"SAVE-FAILED rank={comm.rank}: {e}", flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
    dcp_fs._write_item = original
    print("LEFT " + " ".join(sorted(p.name for p in out.iterdir())), flush=True)
    dist.barrier()  # every rank looked before rank 0 starts the next save's partial directory
    if background:  # the training went on a step beside the failed save: back to the state the test expects
        eng, model, opt, comm = build(steps)
    save(eng, model, opt, comm, out / "last.ckpt", steps, background)
    print(f"SAVED rank={comm.rank}", flush=True)
    dist.destroy_process_group()


def zygote() -> None:
    import time

    rank = os.environ["RANK"]
    for line in sys.stdin:
        out, steps, kill, port = line.split()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.environ["MASTER_PORT"] = port
            Path(out).mkdir(parents=True, exist_ok=True)
            for fd, suffix in ((1, "out"), (2, "err")):
                f = os.open(f"{out}.rank{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(f, fd)
            code = 0
            try:
                main(Path(out), int(steps), kill)
            except SystemExit as e:
                code = int(e.code or 0)
            except BaseException as e:  # noqa: BLE001
                print(f"WORKER-ERROR {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                code = 4
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(f"RESULT {rc} {time.monotonic() - start:.3f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        zygote()
    else:
        main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
