"""[Note: converted checkpoints] in lightning_chunk/hf_weights.py: a mixture of experts whose checkpoint holds a
tensor per expert and projection is read as the model's 3D experts, piece by piece as the pack reads it, with the
values ``from_pretrained`` loads."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_chunk.engine.files.weights import ModuleWeights, open_weights  # noqa: E402
from lightning_chunk.hf_weights import HFConvertedWeights, converted  # noqa: E402
from tests.hf.models import config, save_pretrained  # noqa: E402


def held(kind: str) -> torch.nn.Module:
    """The config's model on the meta device, held as a LightningModule holds it (``self.model``)."""
    from transformers import AutoModelForCausalLM

    holder = torch.nn.Module()
    with torch.device("meta"):
        holder.model = AutoModelForCausalLM.from_config(config(kind))
    return holder


def test_experts_saved_one_by_one_read_as_the_model_s_3d_tensors_with_from_pretrained_s_values(tmp_path):
    from transformers import AutoModelForCausalLM

    pre = save_pretrained("mixtral", tmp_path / "mixtral")
    file = open_weights(pre)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in file.keys()  # the checkpoint's layout
    weights = converted(file, held("mixtral"))
    assert isinstance(weights, HFConvertedWeights)
    want = AutoModelForCausalLM.from_pretrained(pre).state_dict()
    assert sorted(weights.keys()) == sorted(want)
    for key, value in want.items():
        assert weights.shape(key) == value.shape and weights.dtype(key) == value.dtype, key
        flat, n = value.reshape(-1), value.numel()
        assert torch.equal(weights.read(key), flat), key
        assert torch.equal(weights.read(key, n // 3, 2 * n // 3), flat[n // 3 : 2 * n // 3]), key  # a rank's piece
    module = held("mixtral")
    matched = ModuleWeights(converted(file, module), module)  # names and shapes checked before any read
    assert matched.prefix == "model." and all(matched.provides(t) for t in module.state_dict(keep_vars=True).values())


def test_a_checkpoint_in_the_model_s_own_layout_is_read_as_it_is(tmp_path):
    file = open_weights(save_pretrained("llama", tmp_path / "llama"))
    assert converted(file, held("llama")) is file
    assert converted(file, torch.nn.Linear(2, 2)) is file  # no transformers model at all


def test_a_file_of_the_module_s_own_names_beside_other_parameters_is_read_as_it_is(tmp_path):
    """A consolidated checkpoint of a module holding the model beside a head of its own: transformers' base-prefix
    handling renames ``model.model.layers...`` to the model's names, but no transform applies, so the file keeps
    its names and every tensor, the head's included, matches under no prefix."""
    from transformers import AutoModelForCausalLM

    whole = torch.nn.Module()
    whole.model, whole.head = AutoModelForCausalLM.from_config(config("mixtral")), torch.nn.Linear(2, 2)
    torch.save(whole.state_dict(), tmp_path / "whole.pt")
    file = open_weights(tmp_path / "whole.pt")
    module = held("mixtral")
    module.head = torch.nn.Linear(2, 2, device="meta")
    assert converted(file, module) is file
    matched = ModuleWeights(file, module)
    assert matched.prefix == "" and matched.provides(module.head.weight)
