"""``step_in_backward=True`` ([Note: stepping in backward]): the same bits as stepping after backward, the gradient
shards given back, and what it cannot do refused with a reason."""

import pytest
import torch

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.config import DtypePolicy
from lightning_chunk.engine.errors import UnsupportedOptimizerError
from lightning_chunk.engine.system import torch_features
from tests.models import VOCAB, ParityNet, ReorderedNet


def train(
    early,
    *,
    cls=ParityNet,
    placement="device",
    chunk_numel=4096,
    dtypes=None,
    accumulate=1,
    steps=5,
    opt_cls=torch.optim.AdamW,
    unused=False,
    kernel="auto",
    fresh=None,
    model_kw=None,
):
    """``fresh``: a list that gets, per step, the chunks whose compute copy the one-pass kernel wrote."""
    torch.manual_seed(0)
    model = cls(variant="unused" if unused else "plain") if cls is ParityNet else cls(**(model_kw or {}))
    opt = opt_cls(model.parameters(), lr=1e-2, weight_decay=0.1)
    eng = ChunkEngine(
        model,
        [opt],
        config=ChunkConfig(
            placement=placement, chunk_numel=chunk_numel, step_in_backward=early, optimizer_kernel=kernel
        ),
        dtypes=dtypes,
    )
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        opt.zero_grad()
        for k in range(accumulate):
            x = torch.randint(0, VOCAB, (4, 8), generator=g)
            last = k == accumulate - 1
            with eng.accumulating() if not last else torch.enable_grad():
                with eng.micro_batch(training=True):
                    # the branch of "unused" runs in some steps only (step 0, the warm-up, is one of them)
                    loss = model(x, use_branch=step % 3 == 0).float().pow(2).mean()
                loss.backward()
                eng.after_backward()
        eng.prepare_step()
        eng.step(opt)
        if fresh is not None:
            fresh.append(set(eng.bindings[0].fresh_low))
        eng.finish_step(stepped=True)
    state = {k: v.clone() for k, v in eng.full_state_dict().items()}
    return eng, state, opt


@pytest.mark.parametrize("placement,chunk_numel", [("device", 4096), ("host", 4096), ("device", None), ("auto", 4096)])
@pytest.mark.parametrize("kind", ["fp32", "bf16-mixed", "accumulate", "unused"])
def test_stepping_in_backward_is_bit_identical_to_stepping_after_it(placement, chunk_numel, kind):
    kw = dict(placement=placement, chunk_numel=chunk_numel)
    if kind == "bf16-mixed":
        kw["dtypes"] = DtypePolicy(compute_dtype=torch.bfloat16, master_dtype=torch.float32)
        if placement == "host":  # host shards with a compute copy: the one-pass kernel, chunk by chunk in backward
            kw["kernel"] = "one_pass"
    if kind == "accumulate":
        kw["accumulate"] = 2
    if kind == "unused":  # a parameter that never gets a gradient: its chunk steps after backward, without it
        kw["unused"] = True
    _, want, opt_a = train(False, **kw)
    eng, got, opt_b = train(True, **kw)
    assert eng.memory_stats()["chunks_stepped_in_backward"] > 0
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # the optimizer's state too: every step count and moment
    for va, vb in zip(
        (p for g in opt_a.param_groups for p in g["params"]),
        (p for g in opt_b.param_groups for p in g["params"]),
        strict=True,
    ):
        sa, sb = opt_a.state.get(va, {}), opt_b.state.get(vb, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("kind", ["fp32", "bf16-mixed", "accumulate"])
def test_without_swapping_storages_host_shards_step_in_backward_as_after_it(kind, monkeypatch):
    """[Note: torch versions]: torch before 2.12 has no ``UntypedStorage._swap_data_ptr_``. A host gradient shard given
    back in backward is then filled again by ``resize_`` from its own allocator: on torch 2.11 every such refill
    called the swap and raised (236 tests of the fast tier failed there). The engine asks ``swap_memory`` alone,
    which refuses when swapping is switched off, as here."""
    kw: dict = dict(placement="host", chunk_numel=4096)
    if kind == "bf16-mixed":
        kw["dtypes"] = DtypePolicy(compute_dtype=torch.bfloat16, master_dtype=torch.float32)
    if kind == "accumulate":
        kw["accumulate"] = 2
    _, want, _ = train(False, **kw)
    monkeypatch.setattr(torch_features, "SWAP_STORAGES", False)
    eng, got, _ = train(True, **kw)
    stats = eng.memory_stats()
    assert stats["chunks_stepped_in_backward"] > 0 and stats["pool_reused"] == 0
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_swapping_storages_is_asked_in_one_place():
    """Every swap goes through ``torch_features.swap_memory``, which a torch without it never reaches."""
    from pathlib import Path

    import lightning_chunk

    root = Path(lightning_chunk.__file__).parent
    callers = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if "._swap_data_ptr_(" in p.read_text()]
    assert callers == ["engine/system/torch_features.py"]


@pytest.mark.parametrize("setting", ["fixed_size", "defaults_reordered_accumulate"])
def test_each_host_chunk_stepped_in_backward_takes_the_one_pass(setting):
    """Stepped in backward, each chunk's call steps that chunk alone: the one-pass kernel must take every host
    chunk with a compute copy, as one step after backward does (it once took the first chunk it was called with
    and left the others to torch's kernel and a second pass). Also with the automatic chunk size, on a model used
    in another order than registered, with accumulation: the same bits both ways."""
    kw = dict(
        placement="host",
        kernel="one_pass",
        steps=3,
        dtypes=DtypePolicy(compute_dtype=torch.bfloat16, master_dtype=torch.float32),
    )
    if setting == "defaults_reordered_accumulate":
        kw.update(cls=ReorderedNet, chunk_numel=None, accumulate=2, model_kw=dict(dim=256, hidden=1024, depth=4))
    after, during = [], []
    _, want, _ = train(False, fresh=after, **kw)
    eng, got, _ = train(True, fresh=during, **kw)
    trainable = {c.chunk_id for c in eng.manager.chunks if c.trainable}
    assert len(trainable) > 1 and after == during == [trainable] * 3
    assert eng.memory_stats()["chunks_stepped_in_backward"] == 2 * len(trainable)  # every step after the warm-up
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_model_used_in_another_order_than_registered_steps_every_chunk_in_backward():
    """The default chunk size on a model whose use order differs from its registration order."""
    _, want, _ = train(False, cls=ReorderedNet, chunk_numel=None, steps=4)
    eng, got, _ = train(True, cls=ReorderedNet, chunk_numel=None, steps=4)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    stepped = eng.memory_stats()["chunks_stepped_in_backward"]
    assert stepped == 3 * sum(c.trainable for c in eng.manager.chunks)  # every chunk, every step after the warm-up


def test_gradient_shards_are_given_back_after_each_step_and_come_back_for_the_next():
    eng, _, opt = train(True, steps=3)
    chunks = [c for c in eng.manager.chunks if c.trainable]
    assert chunks and all(c.grad_released and c.grad.untyped_storage().nbytes() == 0 for c in chunks)
    assert all(p.grad is None for g in opt.param_groups for p in g["params"])  # as after zero_grad()
    plain, _, _ = train(False, steps=3)
    grad_bytes = sum(c.grad.numel() * c.grad.element_size() for c in plain.manager.chunks if c.grad is not None)
    assert plain.memory_stats()["device_chunk_bytes"] - eng.memory_stats()["device_chunk_bytes"] == grad_bytes


def test_what_stepping_in_backward_cannot_do_is_refused_with_a_reason():
    torch.manual_seed(0)
    model = ParityNet()
    params = list(model.parameters())
    two = [torch.optim.AdamW(params[:2]), torch.optim.AdamW(params[2:])]
    with pytest.raises(UnsupportedOptimizerError, match="needs exactly one optimizer; got 2"):
        ChunkEngine(model, two, config=ChunkConfig(placement="device", step_in_backward=True))
    with pytest.raises(ValueError, match="step_in_backward=1 is not allowed; it must be True, False or None"):
        ChunkConfig(step_in_backward=1)
    eng, _, _ = train(True, steps=2)
    with pytest.raises(ValueError, match="clipping gradients by norm is not possible with step_in_backward=True"):
        eng.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="reading the gradients after backward is not possible"):
        eng.clip_grad_value_(1.0)
    # evaluation only: no optimizer, nothing to step, nothing refused
    ChunkEngine(ParityNet(), [], config=ChunkConfig(placement="device", step_in_backward=True))
