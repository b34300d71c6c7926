"""[Note: gradients in bf16 until the step]: host chunks stepped in backward by the native one-pass kernel take this
step's gradients in bf16 and step from them; every other reader finds them widened to fp32. The bits are those of
stepping after backward from fp32 gradient shards."""

import contextlib

import pytest
import torch

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.config import DtypePolicy
from lightning_chunk.engine.memory import low_grads
from lightning_chunk.engine.optim import adam_native
from lightning_chunk.engine.optim.host_adam import HostAdam
from tests.backward_models import BackwardSizedNet
from tests.features import needs_swap
from tests.late_copies import late_copies
from tests.models import VOCAB, ParityNet

BF16 = DtypePolicy(compute_dtype=torch.bfloat16, master_dtype=torch.float32)


def train(early, *, variant="plain", thread=False, late=False, steps=5, fail_at=None):
    """Five AdamW steps of a ``ParityNet`` in bf16-mixed, every shard on the host, the one-pass kernel; ``late``: the
    gradient copies land late, as on CUDA (``tests/late_copies.py``); ``fail_at``: that step's batch is too large,
    its backward runs out of memory part way, and the loop ends it as the strategy does and skips the step."""
    torch.manual_seed(0)
    model = ParityNet(variant=variant) if fail_at is None else BackwardSizedNet(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = ChunkConfig(
        placement="host", chunk_numel=4096, step_in_backward=early, step_thread=thread, optimizer_kernel="one_pass"
    )
    eng = ChunkEngine(model, [opt], config=config, dtypes=BF16)
    if late:
        copies = late_copies(eng.manager)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        opt.zero_grad()
        with eng.micro_batch(training=True) as outputs:
            x = torch.randint(0, VOCAB, (8 if i == fail_at else 4, 8), generator=g)
            loss = model(x, use_branch=i % 3 == 0).float().pow(2).mean()
            outputs(loss)
        try:
            loss.backward()
        except torch.OutOfMemoryError:
            with pytest.warns(UserWarning, match="had stepped in it") if early else contextlib.nullcontext():
                eng.after_backward()  # as the strategy does ([Note: a backward that raised])
            continue  # the step is skipped, as a loop that catches it would
        eng.after_backward()
        eng.prepare_step()
        eng.step(opt)
        eng.finish_step(stepped=True)
        if late:
            copies.handed.clear()
    assert not any(c.grads_in_low for c in eng.manager.chunks)
    eng.manager.ledger.check(eng.manager.chunks)  # the bf16 buffers moved the ledger as they came and went
    state = {k: v.clone() for k, v in eng.full_state_dict().items()}
    moments = [{k: v.clone() for k, v in opt.state[p].items()} for group in opt.param_groups for p in group["params"]]
    stats = eng.memory_stats()
    eng.teardown()
    return state, moments, stats


def same(a, b):
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    for x, y in zip(a[1], b[1], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(autouse=True)
def native():
    if adam_native.native_kernel() is None:
        pytest.skip(f"no native one-pass kernel here: {adam_native.why_not()}")


@pytest.mark.parametrize(
    "variant,thread,late",
    [("plain", False, False), ("plain", True, True), ("unused", False, False), ("tied", True, True)],
    ids=["autograd_thread", "worker_copies_late", "a_branch_not_taken", "tied_worker_copies_late"],
)
def test_chunks_stepped_from_bf16_gradients_train_as_after_backward(variant, thread, late):
    """Every step after the warm-up steps the host chunks from their bf16 gradients, on the autograd thread or on
    the worker with copies landing late; a chunk whose branch was not taken this step (``unused``) waits for the
    end of backward, which widens its gradients, and steps after it. The parameters and the moments are those of
    stepping after backward, bit for bit."""
    want = train(False, variant=variant, thread=thread, late=late)
    got = train(True, variant=variant, thread=thread, late=late)
    assert "chunks_stepped_from_bf16_grads" not in want[2]
    assert got[2]["chunks_stepped_from_bf16_grads"] > 0
    assert (got[2]["chunks_widened_to_fp32"] > 0) == (variant == "unused")
    same(got, want)


def test_a_step_the_one_pass_does_not_take_widens_the_gradients_for_torch_s_kernel(monkeypatch):
    """Where the native loop does not step a chunk given bf16 gradients (it raised, say), torch's kernel steps it
    from them widened to fp32: the bits of stepping the same way from the fp32 shard."""
    real = HostAdam.step_one_pass

    def not_from_bf16(self, views, only=None):  # noqa: ANN001, ANN202
        low = only is not None and any(c.grads_in_low for c in self.manager.chunks)
        return (set(), set()) if low else real(self, views, only)

    monkeypatch.setattr(HostAdam, "step_one_pass", not_from_bf16)
    got = train(True)
    assert got[2]["chunks_stepped_from_bf16_grads"] > 0
    monkeypatch.setattr(low_grads, "LOW_GRADS", False)
    want = train(True)
    assert "chunks_stepped_from_bf16_grads" not in want[2]
    same(got, want)


def test_a_backward_that_raised_leaves_its_bf16_gradients_widened_for_the_next(monkeypatch):
    """A backward that raised after some chunks took their gradients in bf16 and others stepped from them: what
    follows is what follows the same failure on the fp32 path, bit for bit, and nothing stays in bf16 ([Note: a
    backward that raised] in engine/runtime/raised.py)."""
    got = train(True, fail_at=2)
    assert got[2]["chunks_widened_to_fp32"] > 0  # the failed backward's, as it ended
    monkeypatch.setattr(low_grads, "LOW_GRADS", False)
    same(got, train(True, fail_at=2))


@needs_swap
def test_a_chunk_s_first_bf16_buffer_comes_from_the_pool(monkeypatch):
    """Chunks stepped in backward one after another share the few bf16 buffers in flight from their first step from
    them on: each allocated its own there (on a GPU pinned, a model's worth at 2 bytes a parameter), all but the
    pool's few then freed."""
    from lightning_chunk.engine.chunks.chunk import Role
    from lightning_chunk.engine.tiers.tier_set import TierSet

    made = []
    real = TierSet.alloc

    def alloc(self, chunk, role, dtype):  # noqa: ANN001, ANN202
        made.extend([chunk.chunk_id] * (role is Role.GRAD and dtype == torch.bfloat16))
        return real(self, chunk, role, dtype)

    monkeypatch.setattr(TierSet, "alloc", alloc)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = ChunkConfig(placement="host", chunk_numel=64 * 65, step_in_backward=True, optimizer_kernel="one_pass")
    eng = ChunkEngine(model, [opt], config=config, dtypes=BF16)
    for _ in range(3):
        opt.zero_grad()
        with eng.micro_batch(training=True) as outputs:
            loss = model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean()
            outputs(loss)
        loss.backward()
        eng.after_backward()
        eng.prepare_step()
        eng.step(opt)
        eng.finish_step(stepped=True)
    chunks, stats = len(eng.manager.chunks), eng.memory_stats()
    eng.teardown()
    assert chunks == 12 and stats["chunks_stepped_from_bf16_grads"] == 24  # the warm-up's step aside
    assert len(made) == 1, made  # one buffer in flight on the autograd thread: 12 without the pool
