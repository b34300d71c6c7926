"""``strategy.optimizer_state_norms(p)``: the norms of each parameter's optimizer state, computed from the pieces each
rank holds ([Note: optimizer state norms from the pieces]), against what a user computes from plain torch's state on
one rank."""

import pytest
import torch

from tests.compare import EXACT, assert_same_params
from tests.integration.test_full_optimizer_state import STEPS, chunked
from tests.models import ParityNet, fit


def plain_state_norms(optimizer, module, p):
    """What a user computes from plain torch's state, named as ``optimizer_state_norms`` names them."""
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        each = {f"{key}_{p}_norm/{n}": optimizer.state[q][key].norm(p) for n, q in module.named_parameters()}
        out.update(each, **{f"{key}_{p}_norm_total": torch.stack([v.float() for v in each.values()]).norm(p)})
    return out


class LogsStateNorms(ParityNet):
    def __init__(self, p: float = 2.0, **kw) -> None:
        super().__init__(**kw)
        self.p, self.norms = p, []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        strategy = self.trainer.strategy
        if hasattr(strategy, "optimizer_state_norms"):
            self.norms.append(strategy.optimizer_state_norms(self.p))
        else:
            self.norms.append(plain_state_norms(self.trainer.optimizers[0], self, self.p))


@pytest.mark.parametrize("p", [2.0, float("inf")], ids=["2", "inf"])
@pytest.mark.parametrize("kw", [dict(placement="host"), dict(device_memory_limit=80_000, chunk_numel=4096)])
def test_the_state_norms_from_the_pieces_are_plain_torch_s_to_the_bit(kw, p):
    """[Note: optimizer state norms from the pieces] on one rank: each piece is the whole state."""
    run = dict(steps=STEPS, cls=LogsStateNorms, model_kwargs=dict(p=p))
    ref, got = fit("auto", **run), fit(chunked(**kw), **run)
    assert_same_params(ref, got, EXACT)
    assert len(ref.norms) == len(got.norms) == STEPS
    for a, b in zip(ref.norms, got.norms, strict=True):
        assert a.keys() == b.keys() and len(a) == 2 * (len(list(ref.parameters())) + 1)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)


def test_the_state_norms_read_disk_shards_and_after_fit_the_optimizer_s_own_and_refuse_a_bad_norm_type(tmp_path):
    run = dict(steps=3, cls=LogsStateNorms)
    strategy = chunked(host_memory_limit=140_000, disk_dir=tmp_path / "scratch", chunk_numel=2048)
    ref, got = fit("auto", **run), fit(strategy, **run)
    assert strategy.memory_stats()["disk_shards"] > 0
    for a, b in zip(ref.norms, got.norms, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    after = strategy.optimizer_state_norms()  # after fit: from the optimizer's own state, as the last step left it
    assert after.keys() == ref.norms[-1].keys()
    for k, v in ref.norms[-1].items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=k)
    with pytest.raises(ValueError, match=r"`norm_type` must be a positive number.*Got -1"):
        strategy.optimizer_state_norms(-1)
