"""Step inputs in persistent buffers, decode-graph batch sizes, and the KV cache's element type."""

from __future__ import annotations

import pytest
import torch

from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig
from inference_service.engine.cuda_graphs import capture_sizes
from inference_service.engine.kv_cache import FP8_KV_DTYPE, KVCacheSpec
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.scheduler import ScheduledSeq
from inference_service.engine.sequence import Sequence
from inference_service.engine.step_inputs import PendingTokenIds, StepInputs
from inference_service.model.config import ModelConfig

BLOCK_SIZE = 4


def _seq(token_ids: list[int], block_table: list[int], num_computed: int) -> Sequence:
    seq = Sequence("r", 0, list(token_ids), len(token_ids), SamplingParams(), frozenset(), 64)
    seq.block_table, seq.num_computed_tokens = list(block_table), num_computed
    return seq


def _scheduled(seq: Sequence, num_new_tokens: int, is_sampling: bool) -> ScheduledSeq:
    return ScheduledSeq(seq, seq.num_computed_tokens, num_new_tokens, is_sampling)


def _inputs() -> StepInputs:
    return StepInputs(max_num_tokens=32, max_num_seqs=8, max_blocks_per_seq=6, block_size=BLOCK_SIZE,
                      device=torch.device("cpu"))


def test_prepare_mixed_step_exact_buffers():
    inputs = _inputs()
    chunk = _seq(list(range(100, 110)), [7, 2, 9], num_computed=3)  # tokens 3..8 of a 10-token prompt
    decode = _seq([5, 6, 7, 8, 9], [4, 1], num_computed=4)  # its 5th token, position 4 -> block 1, offset 0
    ids, positions, md = inputs.prepare([_scheduled(chunk, 6, False), _scheduled(decode, 1, True)])
    assert ids.tolist() == [103, 104, 105, 106, 107, 108, 9]
    assert positions.tolist() == [3, 4, 5, 6, 7, 8, 4]
    # position p of block table t -> t[p // 4] * 4 + p % 4
    assert md.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0, 1 * 4 + 0]
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu == [0, 6, 7]
    assert md.seq_lens.tolist() == md.seq_lens_cpu == [9, 5]
    assert (md.max_query_len, md.max_seq_len, md.num_decode_seqs) == (6, 9, 0)  # the decode is not in front
    assert md.block_tables.shape == (2, 3)
    assert md.block_tables[0].tolist() == [7, 2, 9] and md.block_tables[1, :2].tolist() == [4, 1]


def test_prepare_reuses_buffers_and_pads_decode_steps():
    inputs = _inputs()
    inputs.prepare([_scheduled(_seq(list(range(20)), [0, 1, 2, 3, 5], 0), 20, True)])  # leaves stale values
    seqs = [_seq([1, 2, 3], [3], 2), _seq([4, 5, 6, 7, 8, 9], [6, 8], 5)]
    ids, positions, md = inputs.prepare([_scheduled(s, 1, True) for s in seqs], pad_to=4)
    assert ids.tolist() == [3, 9, 0, 0]
    assert positions.tolist() == [2, 5, 0, 0]  # padding rows at position 0, inside every rope table
    assert md.slot_mapping.tolist() == [3 * 4 + 2, 8 * 4 + 1, -1, -1]  # padding writes no cache slot
    assert md.seq_lens.tolist() == [3, 6, 0, 0]  # and attends to nothing
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.block_tables.shape[0] == 4 and md.max_query_len == 1 and md.num_decode_seqs == 4
    with pytest.raises(AssertionError, match="decode-only"):
        inputs.prepare([_scheduled(seqs[1], 2, True)], pad_to=2)


def test_block_table_rows_follow_growth_row_changes_and_preemption():
    inputs = _inputs()
    a, b = _seq([1, 2, 3, 4], [5], 3), _seq([6, 7, 8, 9], [2, 6], 3)
    _, _, md = inputs.prepare([_scheduled(a, 1, True), _scheduled(b, 1, True)])
    assert md.block_tables[0, :1].tolist() == [5] and md.block_tables[1, :2].tolist() == [2, 6]
    a.block_table.append(7)  # a grows: only its new block is written
    for seq, token in ((a, 10), (b, 11)):
        seq.token_ids.append(token)
        seq.num_computed_tokens = 4
    _, _, md = inputs.prepare([_scheduled(a, 1, True), _scheduled(b, 1, True)])
    assert md.block_tables.tolist() == [[5, 7], [2, 6]]
    _, _, md = inputs.prepare([_scheduled(b, 1, True), _scheduled(a, 1, True)])  # rows swap sequences
    assert md.block_tables.tolist() == [[2, 6], [5, 7]]
    # a is preempted and readmitted with new blocks, as many as before, in the same row
    a.block_table, a.num_preemptions = [3, 4], 1
    _, _, md = inputs.prepare([_scheduled(b, 1, True), _scheduled(a, 1, True)])
    assert md.block_tables.tolist() == [[2, 6], [3, 4]]
    assert md.slot_mapping.tolist() == [6 * 4 + 0, 4 * 4 + 0]


def test_leading_one_token_rows_are_counted_as_decodes():
    inputs = _inputs()
    decodes = [_seq([1, 2, 3], [3], 2), _seq([4, 5, 6, 7, 8, 9], [6, 8], 5)]
    last_prompt_token = _seq([1, 2, 3, 4], [2], 3)  # a chunk of one token: attends like a decode
    prefill, later_decode = _seq(list(range(10)), [1, 4, 5], 0), _seq([7, 7], [9], 1)
    step = [_scheduled(s, 1, True) for s in decodes] + [_scheduled(last_prompt_token, 1, True),
                                                        _scheduled(prefill, 10, True), _scheduled(later_decode, 1, True)]
    _, _, md = inputs.prepare(step)
    assert md.num_decode_seqs == 3 and md.query_start_loc_cpu == [0, 1, 2, 3, 13, 14]


def test_pending_tokens_are_gathered_from_the_step_in_flight():
    inputs = _inputs()
    known = _seq([5, 6, 7], [2], 2)  # decodes its known token 7 at position 2
    pending = _seq([1, 2, 3, 4], [9, 3], 4)  # token at position 4 sampled by the step in flight
    pending_too = _seq([8, 9], [5], 2)
    in_flight = PendingTokenIds(torch.tensor([70, 40, 90]), {pending.seq_id: 2, pending_too.seq_id: 0})
    ids, positions, md = inputs.prepare([_scheduled(s, 1, True) for s in (known, pending, pending_too)],
                                        pending=in_flight)
    assert ids.tolist() == [7, 90, 70]
    assert positions.tolist() == [2, 4, 2]
    assert md.slot_mapping.tolist() == [2 * 4 + 2, 3 * 4 + 0, 5 * 4 + 2]


def _byte_span(t: torch.Tensor, staging: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr() - staging.data_ptr()
    return start, start + t.numel() * t.element_size()


@pytest.mark.parametrize("num_tokens,num_seqs", [(1, 1), (4, 4), (20, 1), (32, 8), (9, 3)])
def test_a_steps_arrays_are_one_range_below_the_block_tables(num_tokens, num_seqs):
    """What a step writes is uploaded in one copy: its arrays and block-table rows are one contiguous range of the
    staging bytes (the pending rows' included only when some are pending), each array aligned to its type, none
    overlapping another, and a shape gets the same views every time (graphs are captured over them)."""
    inputs = _inputs()
    staging = inputs._host  # on the CPU also the device buffer
    arrays = inputs.arrays(num_tokens, num_seqs)
    assert arrays is inputs.arrays(num_tokens, num_seqs)
    assert [a.numel() for a in arrays] == [num_tokens] * 3 + [num_seqs + 1, num_seqs, num_seqs, num_seqs]
    for a in arrays:
        assert (a.data_ptr() - staging.data_ptr()) % a.element_size() == 0
    spans = sorted([_byte_span(a, staging) for a in arrays] + [_byte_span(inputs.block_tables[:num_seqs], staging)])
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert 0 <= start - end < 8  # no overlap; no gap but the pending rows' alignment
    assert spans[-1] == _byte_span(inputs.block_tables[:num_seqs], staging)  # the tables on top
    assert inputs.upload_range(num_tokens, num_seqs, num_pending=1) == (spans[0][0], spans[-1][1])
    assert inputs.upload_range(num_tokens, num_seqs, num_pending=0) == (
        _byte_span(arrays.query_start_loc, staging)[0], spans[-1][1])


def test_views_made_again_past_the_cached_shapes(monkeypatch):
    """Steps of more shapes than are kept: the views are dropped and made again over the same bytes."""
    monkeypatch.setattr("inference_service.engine.step_inputs._MAX_CACHED_SHAPES", 2)
    inputs = _inputs()
    first = inputs.arrays(1, 1)
    for n in (2, 3, 4):
        ids, _, md = inputs.prepare([_scheduled(_seq(list(range(10, 10 + n)), [3, 4], 0), n, True)])
        assert ids.tolist() == list(range(10, 10 + n)) and md.query_start_loc.tolist() == [0, n]
    again = inputs.arrays(1, 1)
    assert again is not first and again.input_ids.data_ptr() == first.input_ids.data_ptr()
    ids, positions, _ = inputs.prepare([_scheduled(_seq([5, 6, 7], [2], 2), 1, True)])
    assert (ids.tolist(), positions.tolist()) == ([7], [2])


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    # 16 apart from 256 on: --max-num-seqs 384 (the fp8 bench) captures 43 graphs, not 51
    assert capture_sizes(384) == [1, 2, 4, *range(8, 256, 8), *range(256, 385, 16)]
    assert len(capture_sizes(384)) == 43
    assert capture_sizes(300) == [1, 2, 4, *range(8, 256, 8), 256, 272, 288, 300]
    assert capture_sizes(1024)[-3:] == [992, 1008, 1024]
    with pytest.raises(ValueError, match="batch size must be >= 1"):
        capture_sizes(0)


def test_cuda_graphs_cover_max_num_seqs_by_default():
    """The shipped configuration: every decode batch the scheduler can form has a graph, unless told otherwise."""
    assert EngineConfig().cuda_graph_batch_size == SchedulerConfig().max_num_seqs == 256
    assert EngineConfig(scheduler=SchedulerConfig(max_num_seqs=384)).cuda_graph_batch_size == 384
    assert EngineConfig(max_cuda_graph_batch_size=128,
                        scheduler=SchedulerConfig(max_num_seqs=384)).cuda_graph_batch_size == 128
    assert EngineConfig(max_cuda_graph_batch_size=512,
                        scheduler=SchedulerConfig(max_num_seqs=384)).cuda_graph_batch_size == 384


def _model_config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                       head_dim=16)


def test_kv_cache_spec_dtype_and_block_bytes():
    spec = KVCacheSpec.build(_model_config(), CacheConfig(block_size=16), torch.bfloat16, "torch")
    assert spec.dtype == torch.bfloat16 and spec.block_shape(5) == (5, 16, 2, 16)
    assert spec.bytes_per_block == 2 * 3 * 16 * 2 * 16 * 2  # k and v, layers, tokens, kv heads, head_dim, bytes
    fp8 = KVCacheSpec.build(_model_config(), CacheConfig(block_size=16, kv_cache_dtype="fp8"), torch.bfloat16, "triton")
    assert fp8.dtype == FP8_KV_DTYPE and fp8.bytes_per_block == spec.bytes_per_block // 2
    fp32 = KVCacheSpec.build(_model_config(), CacheConfig(block_size=16), torch.float32, "torch_paged")
    fp16 = KVCacheSpec.build(_model_config(), CacheConfig(block_size=16, kv_cache_dtype="float16"), torch.float32,
                             "torch_paged")
    assert fp16.dtype == torch.float16 and fp16.bytes_per_block == fp32.bytes_per_block // 2
    with pytest.raises(ValueError, match="--kv-cache-dtype fp16 is for the CPU attention backend"):
        KVCacheSpec.build(_model_config(), CacheConfig(kv_cache_dtype="fp16"), torch.bfloat16, "triton")


def test_fp8_kv_cache_needs_the_triton_backend():
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs the Triton attention backend"):
        KVCacheSpec.build(_model_config(), CacheConfig(kv_cache_dtype="fp8"), torch.float32, "torch")


def test_gpu_config_validation():
    with pytest.raises(ValueError, match=r"--kv-cache-dtype must be auto, fp8 \(fp8_e4m3\) or fp16 \(float16\)"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="--max-cuda-graph-batch-size must be >= 1"):
        EngineConfig(max_cuda_graph_batch_size=0)
