"""[Note: gradients landed beside backward], played on a CPU: gradient copies that land late (``LateCopies``: a
copy's destination reads NaN until its event is waited for, as memory a CUDA copy has not reached yet holds anything)
and a worker thread stepping each chunk in backward. The worker lands each chunk's copies; the autograd thread waits
for none of them in backward; the steps are torch's."""

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine
from tests.engine_steps import step
from tests.late_copies import WORKER, late_copies


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("accumulate,ring", [(1, None), (2, None), (2, 1280)])
def test_the_worker_lands_each_chunk_s_gradient_copies_and_the_steps_are_torch_s(accumulate, ring):
    """Before, the autograd thread drained every copy before handing each chunk to the worker: it waited, once a
    chunk, for the GPU to finish all it had queued. With accumulation the last micro-batch's copies are added on
    the host from their staging buffers: the worker does that too. A ring of 1280 bytes (``pin_memory="exact"``)
    holds about two chunks' staged copies: the autograd thread lands the oldest handed ones itself to take their
    slices back."""
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    opt, oref = torch.optim.Adam(model.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    config = ChunkConfig(placement="host", chunk_numel=150, step_in_backward=True, step_thread=True)
    eng = ChunkEngine(model, [opt], config=config)
    late = late_copies(eng.manager, ring)
    landed_by = []
    for i in range(5):
        xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * i + j)) for j in range(accumulate)]
        before = len(late.events)
        if accumulate == 1:
            step(eng, model, opt, xs[0])
        else:
            opt.zero_grad()
            for j, x in enumerate(xs):
                before = len(late.events)  # the last micro-batch's copies: the earlier ones land at their end
                with eng.no_sync() if j < accumulate - 1 else torch.enable_grad():
                    with eng.micro_batch(training=True) as outputs:
                        loss = model(x).pow(2).mean() / accumulate
                        outputs(loss)
                    loss.backward()
                    eng.after_backward()
            eng.prepare_step()
            opt.step()
            eng.finish_step(stepped=True)
        landed_by.append({e.by for e in late.events[before:]})
        late.handed.clear()
        oref.zero_grad()
        for x in xs:
            (ref(x).pow(2).mean() / accumulate).backward()
        oref.step()
    assert eng.early.early > 0 and len(late) == 0
    # the warm-up steps after backward; then the autograd thread waits for no copy before its chunk is handed over
    # (the worker lands them; the end of backward lands those it has not come to yet)
    assert landed_by[0] == {"main, before hand-over"}, landed_by
    assert all(by <= {WORKER, "main, handed over"} for by in landed_by[1:]), landed_by
    assert WORKER in set().union(*landed_by[1:]), landed_by  # the end of backward may come first to some
    stats = eng.memory_stats()
    assert stats["grad_copies_handed_over"] >= stats["grad_copies_landed_by_drain"] and stats["grad_copies_handed_over"]
    sd = eng.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6)
    eng.teardown()


def test_a_landed_copy_lets_its_staging_buffer_go_without_the_cycle_collector():
    """A copy handed over referenced its landing function, which referenced the chunk's copies: a cycle, so each
    staging buffer (on CUDA a pinned block of torch's caching host allocator) outlived its drain until the cycle
    collector ran, and the next copies had to pin new blocks. With the collector off, no copy outlives its step."""
    import gc
    import weakref

    from lightning_chunk.engine.tiers.offload import _Copy

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    config = ChunkConfig(placement="host", chunk_numel=150, step_in_backward=True, step_thread=True)
    eng = ChunkEngine(model, [opt], config=config)
    late = late_copies(eng.manager)
    made: list[weakref.ref] = []
    init = _Copy.__init__

    def track(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    gc.collect()
    gc.disable()
    try:
        _Copy.__init__ = track  # type: ignore[method-assign]
        for i in range(3):
            step(eng, model, opt, torch.randn(3, 8, generator=torch.Generator().manual_seed(i)))
        assert made and late.handed
        assert [r for r in made if r() is not None] == []
    finally:
        _Copy.__init__ = init  # type: ignore[method-assign]
        gc.enable()
