"""Turns a scheduled step into tensors, runs the model over the paged KV cache and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.config import EngineConfig
from inference_service.engine.cuda_graphs import DecodeGraphs, capture_sizes
from inference_service.engine.kv_cache import KVCacheSpec, allocate_kv_caches, profile_activation_bytes
from inference_service.engine.sampler import PendingSample, Sampler, SamplingBatch
from inference_service.engine.scheduler import ScheduledSeq
from inference_service.engine.step_inputs import PendingTokenIds, StepInputs
from inference_service.engine.transfer import to_device
from inference_service.model.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


class LaunchedStep:
    """A step queued on the device: its sampled ids are on the GPU at once and on the host after
    `result()`."""

    def __init__(self, sampling_seq_ids: list[int], sample: PendingSample | None):
        self._sampling_seq_ids = sampling_seq_ids
        self._sample = sample
        self.pending = None if sample is None else PendingTokenIds(
            sample.token_ids, {seq_id: j for j, seq_id in enumerate(sampling_seq_ids)})

    def result(self) -> dict[int, SampledToken]:
        """Waits for the step's sampled ids; returns the sampled token of each sampling sequence."""
        if self._sample is None:
            return {}
        out = self._sample.result()
        return {
            seq_id: SampledToken(out.token_ids[j], out.logprobs[j], out.top_logprobs[j])
            for j, seq_id in enumerate(self._sampling_seq_ids)
        }


class ModelRunner:
    """Owns the KV cache, the step input buffers and the decode CUDA graphs, and runs steps.
    One instance per engine; not thread-safe."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int):
        self.model = loaded.model
        self.model_config = loaded.config
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        sched = config.scheduler
        backend = self.model.attention_backend
        self.kv_spec = KVCacheSpec.build(loaded.config, config.cache, dtype, backend.name)
        use_graphs = device.type == "cuda" and not config.enforce_eager and backend.name == "triton"
        graph_batch = min(config.max_cuda_graph_batch_size, sched.max_num_seqs) if use_graphs else 0

        reserve = 0
        if device.type == "cuda" and config.cache.kv_cache_memory_mib is None:
            # Peak activations of the largest prefill step and of the largest graph, left free.
            reserve = profile_activation_bytes(self.model, self.kv_spec, sched.max_num_batched_tokens,
                                               graph_batch, max_model_len, device)
        self.num_blocks, self.kv_caches = allocate_kv_caches(self.kv_spec, config.cache, device, reserve)
        self.max_seq_tokens = min(max_model_len, self.num_blocks * self.block_size)
        max_blocks_per_seq = -(-self.max_seq_tokens // self.block_size)
        self.inputs = StepInputs(sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks_per_seq,
                                 self.block_size, device)
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        if graph_batch:
            vocab = loaded.config.vocab_size
            self._graph_logits = torch.empty((graph_batch, vocab), dtype=torch.float32, device=device)
            self.graphs = DecodeGraphs(self._forward_into_graph_logits, self.inputs, capture_sizes(graph_batch),
                                       self.max_seq_tokens, device)

    def run(self, scheduled: list[ScheduledSeq]) -> dict[int, SampledToken]:
        """Computes one step; returns the sampled token of every sequence that samples, by seq_id."""
        return self.launch(scheduled).result()

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq], in_flight: LaunchedStep | None = None) -> LaunchedStep:
        """Queues one step on the device without waiting for it, nor for `in_flight`, the step
        before it, whose sampled ids feed this step's pending tokens on the GPU."""
        num_seqs = len(scheduled)
        padded = self._graph_size(scheduled)
        pending = None if in_flight is None else in_flight.pending
        input_ids, positions, metadata = self.inputs.prepare(scheduled, pad_to=padded, pending=pending)
        rows = [i for i, s in enumerate(scheduled) if s.is_sampling]
        if padded is not None:
            logits = self.graphs.replay(padded)[:num_seqs]  # [S, vocab], one row a sequence
            if not rows:
                return LaunchedStep([], None)
            if len(rows) < num_seqs:  # a one-token prefill chunk short of its prompt's end
                logits = logits[to_device(rows, torch.long, self.device)]
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [T, hidden]
            if not rows:
                return LaunchedStep([], None)
            if len(rows) == num_seqs == hidden.shape[0]:
                last_hidden = hidden  # one token a sequence, and every one samples
            else:
                last_rows = [metadata.query_start_loc_cpu[i + 1] - 1 for i in rows]
                last_hidden = hidden[to_device(last_rows, torch.long, self.device)]
            logits = self.model.compute_logits(last_hidden)  # [num_sampling, vocab]
        seqs = [scheduled[i].seq for i in rows]
        histories = [_token_history(seq) for seq in seqs]
        batch = SamplingBatch.build(
            params=[seq.params for seq in seqs],
            prompt_token_ids=[h[0] for h in histories],
            output_token_ids=[h[1] for h in histories],
            generators=[seq.generator for seq in seqs],
            device=self.device,
            eos_token_ids=[seq.eos_token_ids for seq in seqs],
            grammars=[seq.grammar for seq in seqs],
            vocab_size=logits.shape[-1],
        )
        return LaunchedStep([seq.seq_id for seq in seqs], self.sampler.sample(logits, batch))

    def _graph_size(self, scheduled: list[ScheduledSeq]) -> int | None:
        """The captured batch size this step replays at, or None to run it eagerly."""
        if self.graphs is None or any(s.num_new_tokens != 1 for s in scheduled):
            return None
        return self.graphs.padded_size(len(scheduled))

    def _forward_into_graph_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                                   metadata: AttentionMetadata) -> torch.Tensor:
        """The captured body: forward and logits of every row, written into one shared buffer
        (so the graphs' outputs do not each hold a [size, vocab] tensor of their own)."""
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [size, hidden]
        out = self._graph_logits[:input_ids.shape[0]]
        out.copy_(self.model.compute_logits(hidden))
        return out


def _token_history(seq) -> tuple[list[int], list[int]]:
    """(prompt, output) token ids as far as the sequence's sampling reads them.

    NOTE: slicing a long prompt every step for every row is the hot path's largest Python cost, and
    only penalties and min_tokens look at the history; other rows get empty lists."""
    p = seq.params
    if not p.needs_output_history:
        return [], []
    # The only pending token may be the one this step samples: the step before must be resolved.
    assert seq.num_pending_tokens == 1, f"sequence {seq.seq_id} samples from an incomplete history"
    if p.repetition_penalty != 1.0:
        return seq.prompt_token_ids, seq.output_token_ids
    return [], seq.output_token_ids
