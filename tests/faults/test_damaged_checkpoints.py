"""A damaged or foreign checkpoint is refused with an error naming the file and the mismatch, before any
parameter or optimizer state of the run is overwritten, and nothing on disk changes."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.state.checkpoint import CheckpointError, load_sharded, save_sharded
from tests.engine_steps import step

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's


def engine(width=24, dtype=torch.float32, seed=0, steps=1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8)).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    eng = ChunkEngine(model, [opt], config=ChunkConfig(placement="host", chunk_numel=1100))
    for i in range(steps):
        step(eng, model, opt, torch.randn(3, width, dtype=dtype, generator=torch.Generator().manual_seed(i)))
    return eng, opt


def state_of(eng, opt):
    sd = {k: v.clone() for k, v in eng.full_state_dict().items()}
    for b in eng.bindings:
        for st in b.optimizer.state.values():
            sd.update({f"opt{id(st)}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return sd


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    for name, kw in {
        "good": {},
        "later": dict(steps=3),
        "wider": dict(width=32),
        "bf16": dict(dtype=torch.bfloat16),
    }.items():
        eng, _ = engine(**kw)
        save_sharded(eng, root / f"{name}.ckpt", {"name": name}, with_optimizer=True)
    return root


def damage(saved: Path, tmp_path: Path, case: str) -> tuple[Path, str]:
    ck = tmp_path / "ck.ckpt"
    shutil.copytree(saved / "good.ckpt", ck)
    if case == "truncated shard":
        shard = ck / "__0_0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return ck, f"shard file '{shard}' is truncated"
    if case == "missing .metadata":
        (ck / ".metadata").unlink()
        return ck, f"index '{ck / '.metadata'}' is missing"
    if case == "missing meta.pt":
        (ck / "meta.pt").unlink()
        return ck, "meta.pt is missing"
    if case == "meta.pt of another save":
        shutil.copy(saved / "later.ckpt" / "meta.pt", ck / "meta.pt")
        return ck, f"'{ck / 'meta.pt'}' and '{ck / '.metadata'}' come from different saves"
    if case == "unreadable meta.pt":
        (ck / "meta.pt").write_bytes(b"not a pickle")
        return ck, f"'{ck / 'meta.pt'}' cannot be read"
    if case == "another model":
        return (
            saved / "wider.ckpt",
            "was written for another model; shapes differ: .*'0.weight: checkpoint \\(32, 32\\) vs model \\(24, 24\\)'",
        )
    if case == "another precision":
        return saved / "bf16.ckpt", (
            "was written with another precision: 4 parameters \\(e.g. '0.weight'\\) were "
            "saved as bfloat16, this run keeps float32"
        )
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "truncated shard",
        "missing .metadata",
        "missing meta.pt",
        "meta.pt of another save",
        "unreadable meta.pt",
        "another model",
        "another precision",
    ],
)
def test_a_damaged_or_foreign_checkpoint_is_refused_before_anything_is_overwritten(saved, tmp_path, case):
    path, match = damage(saved, tmp_path, case)
    eng, opt = engine(seed=5, steps=2)  # a run with its own values and optimizer state
    before, on_disk = state_of(eng, opt), digest(path)
    with pytest.raises(CheckpointError, match=match):
        load_sharded(eng, path, with_optimizer=True)
    after = state_of(eng, opt)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert digest(path) == on_disk


def test_the_undamaged_checkpoint_loads(saved):
    eng, opt = engine(seed=5, steps=2)
    load_sharded(eng, saved / "good.ckpt", with_optimizer=True)
    ref, _ = engine(steps=1)
    assert all(
        torch.equal(a, b) for a, b in zip(eng.full_state_dict().values(), ref.full_state_dict().values(), strict=True)
    )
