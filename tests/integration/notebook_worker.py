"""Two devices fitted from a notebook's process (``python -i``, a Jupyter kernel), by DDP's ``ddp_notebook`` and by
chunk_offload, from the same start: prints one JSON line with what the notebook's process holds after each fit
([Note: the launcher] in ``lightning_chunk/parallel.py``). Run as a script by ``test_launching.py``."""

import json
import sys
import warnings

sys.ps1 = ">>> "  # what a notebook's process looks like to Lightning, which reads it when it is imported ...

import lightning as L  # noqa: E402
import lightning.fabric.utilities.imports as fabric_imports  # noqa: E402
import lightning.pytorch.trainer.connectors.accelerator_connector as connector  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_chunk import ChunkOffloadStrategy, OffloadOptions  # noqa: E402
from tests.models import ParityNet, quiet_trainer, token_data  # noqa: E402

fabric_imports._IS_INTERACTIVE = connector._IS_INTERACTIVE = True  # ... and in a process forked after that import


def fit(strategy):
    L.seed_everything(7, verbose=False)
    model = ParityNet()
    trainer = quiet_trainer(
        strategy=strategy, devices=2, max_steps=6, num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=3
    )
    trainer.fit(model, token_data(), token_data(16, seed=1))
    validated = trainer.validate(model, token_data(16, seed=1), verbose=False)[0]["val_loss"]
    return model, trainer, validated


ref, ref_trainer, ref_val = fit(DDPStrategy(start_method="fork"))
got, got_trainer, got_val = fit(ChunkOffloadStrategy(offload=OffloadOptions(optimizer_kernel="loop")))
L.seed_everything(7, verbose=False)
init = ParityNet().state_dict()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got_trainer.save_checkpoint(sys.argv[1])
saved = torch.load(sys.argv[1], weights_only=False)
print(
    json.dumps(
        {
            "launcher": type(got_trainer.strategy.launcher).__name__,
            "status": got_trainer.state.status.value,
            "same_as_ddp": all(torch.equal(v, got.state_dict()[k]) for k, v in ref.state_dict().items()),
            "trained": any(not torch.equal(v, got.state_dict()[k]) for k, v in init.items() if v.is_floating_point()),
            "val_loss": [
                float(ref_trainer.callback_metrics["val_loss"]),
                float(got_trainer.callback_metrics["val_loss"]),
            ],
            "validated": [ref_val, got_val],
            "saved_weights": all(torch.equal(v, saved["state_dict"][k]) for k, v in got.state_dict().items()),
            "save_said": [str(w.message) for w in caught if "did not train" in str(w.message)],
        }
    )
)
