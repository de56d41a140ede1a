"""A rank's boxes of a Megatron-LM torch_dist checkpoint (megatron_het.checkpoint.megatron_lm_boxes)
equal the same boxes cut from the whole checkpoint, in every key layout megatron-core writes
(layers stacked or one key per layer, fc1 fused or as gate/up halves, local or Transformer
Engine norm names), and cost only their own bytes; a box the save does not hold is one line."""

from __future__ import annotations

import pathlib
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_het.checkpoint.megatron_lm import read_megatron_checkpoint
from megatron_het.checkpoint.megatron_lm_boxes import read_boxes
from megatron_het.checkpoint.megatron_lm_dist import write_dist_checkpoint
from megatron_het.checkpoint.megatron_lm_files import read_dcp_metadata
from megatron_het.checkpoint.reshard import take_slice, target_slice
from megatron_het.config import model_preset
from megatron_het.errors import UserError
from megatron_het.model.llama import build_model

CONFIG = model_preset("tiny")


def weights() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model(CONFIG, seed=3).state_dict().items()}


def per_layer(directory: pathlib.Path) -> None:
    """Rewrite ``directory``'s tensors as megatron-core saves non-homogeneous layers: one key
    per layer (``decoder.layers.N.…``) and fc1 as its ``weight_w`` / ``weight_v`` halves."""
    metadata = read_dcp_metadata(directory)
    tensors = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, dcp.metadata.TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=directory, no_dist=True)
        out = {}
        for key, tensor in tensors.items():
            if not key.startswith("decoder.layers."):
                out[key] = tensor
                continue
            suffix = key[len("decoder.layers.") :]
            for layer in range(tensor.shape[0]):
                if suffix == "mlp.linear_fc1.weight":
                    gate, up = tensor[layer].chunk(2)
                    out[f"decoder.layers.{layer}.{suffix}_w"] = gate.clone()
                    out[f"decoder.layers.{layer}.{suffix}_v"] = up.clone()
                else:
                    out[f"decoder.layers.{layer}.{suffix}"] = tensor[layer].clone()
        for path in directory.glob("*.distcp"):
            path.unlink()
        (directory / ".metadata").unlink()
        dcp.save(out, checkpoint_id=directory, no_dist=True)


@pytest.mark.parametrize("layout", ["stacked", "te", "per_layer"])
def test_boxes_equal_the_whole_checkpoints_slices(tmp_path, layout: str) -> None:
    naming = "te" if layout == "te" else "local"
    directory = write_dist_checkpoint(
        tmp_path / "mlm", CONFIG, weights(), 5, tp_size=2, naming=naming
    )
    if layout == "per_layer":
        per_layer(directory)
        keys = set(read_dcp_metadata(directory).state_dict_metadata)
        assert "decoder.layers.1.mlp.linear_fc1.weight_v" in keys
        assert not any(k.startswith("decoder.layers.mlp") for k in keys)
    full = read_megatron_checkpoint(tmp_path / "mlm").state
    whole = sum(t.numel() * t.element_size() for t in full.values())
    metadata = read_dcp_metadata(directory)
    for tp, rank in ((2, 0), (2, 1), (1, 0)):
        boxes = {name: target_slice(name, CONFIG, tp, rank) for name in full}
        got, nbytes = read_boxes(directory, CONFIG, boxes, metadata)
        assert set(got) == set(full)
        for name, (offsets, shape) in boxes.items():
            assert torch.equal(got[name], take_slice(full[name], offsets, shape)), (tp, name)
        # Replicated norms are read whole by each rank; everything else is split.
        assert nbytes < 0.55 * whole if tp == 2 else nbytes == whole
    # A stage's layers only: none of the other layers' bytes.
    stage = {n: target_slice(n, CONFIG, 1, 0) for n in full if n.startswith("layers.1.")}
    got, nbytes = read_boxes(directory, CONFIG, stage, metadata)
    assert nbytes == sum(full[n].numel() * full[n].element_size() for n in stage)


def test_a_box_outside_the_save_is_one_line(tmp_path) -> None:
    directory = write_dist_checkpoint(tmp_path / "mlm", CONFIG, weights(), 5)
    metadata = read_dcp_metadata(directory)
    layers = CONFIG.num_layers
    with pytest.raises(UserError, match="no tensor for layers.0.mlp.nothing.weight"):
        read_boxes(directory, CONFIG, {"layers.0.mlp.nothing.weight": ((0,), (1,))}, metadata)
    with pytest.raises(UserError, match="does not hold the box"):
        box = ((0,), (CONFIG.hidden_size,))
        read_boxes(directory, CONFIG, {f"layers.{layers}.input_norm.weight": box}, metadata)
