"""GGUF under tensor parallelism: each rank slices its rows (and whole Q8_0 blocks of columns) out of the
memory map, dequantized, or repacked in their blocks where the quantized kernels run (CUDA; here the Triton
interpreter); two ranks give the logits of one process that dequantized the same file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import transformers
from harness import PagedHarness
from test_gguf_sentencepiece import _permute, _vocab
from tp_ranks import free_port, run_rank, teacher_forced_logits

from inference_service.distributed.gguf_shards import read_gguf_shard, read_gguf_shard_packed
from inference_service.distributed.sharding import ShardPlan
from inference_service.model.gguf_loader import GGUFCheckpoint
from inference_service.model.loader import load_model
from inference_service.model.quant.packed_linear import dequantize_packed

NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    """A tiny llama in GGUF: Q8_0 matrices (q/k rows in llama.cpp's order), F32 norms."""
    tokens, scores, types = _vocab()
    config = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = str(tmp_path_factory.mktemp("tp_gguf") / "tiny-q8.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [(writer.add_context_length, 256), (writer.add_embedding_length, 64),
                       (writer.add_block_count, 2), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2), (writer.add_rope_dimension_count, 16),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_tokenizer_model, "llama"), (writer.add_token_list, tokens),
                       (writer.add_token_scores, scores), (writer.add_token_types, types),
                       (writer.add_unk_token_id, 0), (writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2)]:
        add(value)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            array = ((1.0 if name.endswith("norm.weight") else 0.0) + 0.15 * torch.randn_like(param)).numpy()
            if name == "model.embed_tokens.weight":
                gguf_name = "token_embd.weight"
            elif name == "model.norm.weight":
                gguf_name = "output_norm.weight"
            elif name == "lm_head.weight":
                gguf_name = "output.weight"
            else:
                layer, rest = name.removeprefix("model.layers.").split(".", 1)
                module = rest.rsplit(".", 1)[0]
                gguf_name = f"blk.{layer}.{NAMES[module]}.weight"
                if module in ("self_attn.q_proj", "self_attn.k_proj"):
                    array = _permute(array, 4 if module == "self_attn.q_proj" else 2)
            array = np.ascontiguousarray(array, dtype=np.float32)
            if array.ndim == 2:
                quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(gguf_name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SLICED = [("blk.1.attn_output.weight", "model.layers.1.self_attn.o_proj.weight", 1),
          ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", 1),
          ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", 0),
          ("blk.1.attn_v.weight", "model.layers.1.self_attn.v_proj.weight", 0)]


def _shards(gguf_path):
    """(rank, the GGUF tensor, its HF name's `TensorShard` on that rank of two, the split dim) of each `SLICED`."""
    checkpoint = GGUFCheckpoint(gguf_path)
    tensors = {t.name: t for t in checkpoint._reader.tensors}
    for rank in (0, 1):
        plan = ShardPlan(checkpoint.config, rank, 2)
        for gguf_name, hf_name, dim in SLICED:
            yield rank, tensors[gguf_name], plan.shard_of(hf_name), dim


def test_packed_shards_hold_the_blocks_of_the_dequantized_slices(gguf_path):
    for _, tensor, shard, _ in _shards(gguf_path):
        packed = read_gguf_shard_packed(tensor, shard)
        np.testing.assert_array_equal(dequantize_packed(packed, torch.float32).numpy(), read_gguf_shard(tensor, shard))


def test_shards_are_slices_of_the_dequantized_tensors(gguf_path):
    for rank, tensor, shard, dim in _shards(gguf_path):
        full = GGUFCheckpoint._dequantize(tensor)
        n = full.shape[dim] // 2
        expected = full[rank * n:(rank + 1) * n] if dim == 0 else full[:, rank * n:(rank + 1) * n]
        np.testing.assert_array_equal(read_gguf_shard(tensor, shard), expected)


def test_two_ranks_match_one_process(gguf_path, tmp_path):
    prompts, chunk = [[1, 70, 80, 90, 100, 110, 120, 130], [1, 200, 210]], 4
    reference = load_model(gguf_path, dtype=torch.float32, quantized_weights=False).model
    generated = PagedHarness(reference).generate(prompts, 4, prefill_chunk=chunk)
    forced = [tokens[:-1] for tokens in generated]
    expected = teacher_forced_logits(reference, prompts, forced, chunk)
    out_file = str(tmp_path / "rank0.pt")
    mp.start_processes(run_rank, args=(2, free_port(), [(gguf_path, prompts, forced, chunk)], out_file), nprocs=2,
                       start_method="spawn")
    saved = torch.load(out_file)
    got = saved["logits"][0]
    assert saved["summaries"][0][:2] == ("gguf", 8)  # the ranks kept their Q8_0 blocks (quantization, bits)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
