"""GGUF Q-types kept packed for the GPU (`GGUFCheckpoint.weights(gpu_packed=True)`): the embedded SmolLM2
Q4_1's decoder projections come as `IntPackedWeight`s that expand bit-exactly to the dequantized
tensors the plain path gives (llama.cpp's q/k row order undone on both), everything else as before."""

from __future__ import annotations

import itertools

import torch

from inference_service.model.gguf_loader import GGUFCheckpoint
from inference_service.model.loader import default_model_path
from inference_service.model.quant.packed_linear import dequantize_packed
from kernels.quant_layout import IntPackedWeight

NUM_TENSORS = 19  # the embedding and the first two blocks (9 tensors each)


def test_gguf_projections_come_packed_and_expand_to_the_dequantized_tensors():
    checkpoint = GGUFCheckpoint(default_model_path())
    plain = itertools.islice(checkpoint.weights(torch.float32), NUM_TENSORS)
    packed = itertools.islice(checkpoint.weights(torch.float32, gpu_packed=True), NUM_TENSORS)
    num_packed = 0
    for (name, expected), (packed_name, weight) in zip(plain, packed, strict=True):
        assert packed_name == name
        if name.endswith("_proj.weight"):
            assert isinstance(weight, IntPackedWeight) and (weight.bits, weight.group_size) == (4, 32)
            assert torch.equal(dequantize_packed(weight, torch.float32), expected), name
            num_packed += 1
        else:
            assert isinstance(weight, torch.Tensor) and torch.equal(weight, expected), name
    assert num_packed == 14  # q, k, v, o, gate, up, down of two blocks
