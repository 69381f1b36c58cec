"""Turns a scheduled step into tensors, runs the model over the paged KV cache and samples.

A step is two calls (vLLM's execute_model / sample_tokens split): `execute_model` queues the forward,
`sample_tokens` the sampling. Between them the engine may process the previous step's outputs
(structured-output rows need its token on the host), while the device already runs the forward."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.config import EngineConfig
from inference_service.engine import prompt_logprobs
from inference_service.engine.cuda_graphs import DecodeGraphs, capture_sizes
from inference_service.engine.kv_cache import KVCacheSpec, allocate_kv_caches, profile_activation_bytes
from inference_service.engine.prefill_graphs import PrefillGraphs, prefill_graph_sizes
from inference_service.engine.prompt_logprobs import PendingPromptLogprobs
from inference_service.engine.request import TokenLogprob
from inference_service.engine.sampler import PendingSample, Sampler
from inference_service.engine.sampling_state import SamplingRows, SamplingState
from inference_service.engine.scheduler import ScheduledSeq
from inference_service.engine.sequence import Sequence
from inference_service.engine.step_inputs import PendingTokenIds, StepInputs
from inference_service.engine.transfer import to_device
from inference_service.model.loader import LoadedModel

logger = logging.getLogger(__name__)


def uses_decode_graphs(device: torch.device, config: EngineConfig, attention_backend: str) -> bool:
    """Whether decode steps replay CUDA graphs: on a GPU with the Triton backend (the torch backend reads
    host-side lengths a graph would freeze), unless --enforce-eager."""
    return device.type == "cuda" and not config.enforce_eager and attention_backend == "triton"


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


@dataclass(slots=True)
class ForwardStep:
    """A step whose forward is queued on the device, its sampling not yet."""

    seqs: list[Sequence]  # the sampling sequences, one logits row each
    logits: torch.Tensor | None  # [len(seqs), vocab] float32
    # A row's format mask needs the step in flight's tokens on the host: process that step's
    # outputs before `sample_tokens` (the forward is queued already).
    waits_for_previous_step: bool
    prompt_logprobs: PendingPromptLogprobs | None = None  # of the sequences collecting them


class LaunchedStep:
    """A step queued on the device: its sampled ids are on the GPU at once and on the host after
    `result()`."""

    def __init__(self, sampling_seq_ids: list[int], sample: PendingSample | None,
                 pending_prompt_logprobs: PendingPromptLogprobs | None = None):
        self._sampling_seq_ids = sampling_seq_ids
        self._sample = sample
        self._prompt_logprobs = pending_prompt_logprobs
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

    def prompt_logprobs(self) -> dict[int, list[TokenLogprob]]:
        """Waits for the step's prompt logprobs; returns each collecting sequence's new entries by `seq_id`."""
        return {} if self._prompt_logprobs is None else self._prompt_logprobs.result()


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
        # The model's own config: a tensor-parallel rank's holds its share of the KV heads.
        self.kv_spec = KVCacheSpec.build(self.model.config, config.cache, dtype, backend.name)
        graph_batch = config.cuda_graph_batch_size if uses_decode_graphs(device, config, backend.name) else 0
        # Tensor parallelism: eager prefills (the other ranks follow the decode graphs only).
        peers = getattr(self.model, "graph_step", None)
        prefill_graph_tokens = (min(config.max_prefill_graph_tokens, sched.max_num_batched_tokens, max_model_len)
                                if graph_batch and peers is None else 0)
        prefill_graph_sizes_ = prefill_graph_sizes(prefill_graph_tokens)

        reserve = 0
        if device.type == "cuda" and config.cache.kv_cache_memory_mib is None:
            # Peak activations of the largest prefill step and of the largest graphs, left free.
            reserve = profile_activation_bytes(self.model, self.kv_spec, sched.max_num_batched_tokens,
                                               graph_batch, max_model_len, device,
                                               max(prefill_graph_sizes_, default=0))
        self.num_blocks, self.kv_caches = allocate_kv_caches(self.kv_spec, config.cache, device, reserve)
        self.max_seq_tokens = min(max_model_len, self.num_blocks * self.block_size)
        max_blocks_per_seq = -(-self.max_seq_tokens // self.block_size)
        self.inputs = StepInputs(sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks_per_seq,
                                 self.block_size, device)
        self.sampler = Sampler()
        self.sampling_state = SamplingState(sched.max_num_seqs, loaded.config.vocab_size, device)
        self.sampling_rows = SamplingRows(self.sampling_state)
        self.num_sampling_waits = 0  # steps whose sampling waited for the step before (formats)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if graph_batch:
            vocab = loaded.config.vocab_size
            self._graph_logits = torch.empty((graph_batch, vocab), dtype=torch.float32, device=device)
            # Tensor parallelism: the other ranks follow each graph's warm-up, capture and replay.
            self.graphs = DecodeGraphs(self._forward_into_graph_logits, self.inputs, capture_sizes(graph_batch),
                                       self.max_seq_tokens, device,
                                       announce=functools.partial(peers, self.kv_caches) if peers else None)
            if prefill_graph_sizes_:
                try:
                    self.prefill_graphs = PrefillGraphs(self._forward_into_prefill_logits, self.inputs,
                                                        prefill_graph_sizes_, device)
                except RuntimeError as e:  # a kernel that cannot be captured: slower first tokens, not no server
                    logger.warning("prefill CUDA graphs not captured (%s): prefills run eagerly", e)
                    torch.cuda.synchronize(device)
            if peers is None:  # tensor parallelism: the other ranks would not follow an eager step
                self._compile_eager_variants()

    @torch.inference_mode()
    def _compile_eager_variants(self) -> None:
        """One eager forward of a mixed step (a decode and a prefill chunk after a cached token), reading block 0
        and writing nothing, with the decode attention launched at every compiled variant: what steps outside the
        graphs launch is compiled before the first request (an H100's first offline run compiled five kernels
        mid-run, ~1.4 s each)."""
        backend = self.model.attention_backend
        if not hasattr(backend, "compiling_every_variant"):
            return
        width = self.inputs.block_table_width  # the steps' own table width (kernels specialize on it)
        metadata = AttentionMetadata.for_sequences([1, 1], [1, 2], [[0] * width] * 2, self.block_size, self.device,
                                                   write_kv=False)
        input_ids = torch.zeros(3, dtype=torch.int64, device=self.device)
        positions = torch.tensor([1, 1, 2], dtype=torch.int64, device=self.device)
        with backend.compiling_every_variant(self.dtype, self.kv_caches[0][0]):
            self.model(input_ids, positions, self.kv_caches, metadata)
        if self.device.type == "cuda":  # (the graphs' tests emulate a GPU in Triton's interpreter on the CPU)
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute_model(self, scheduled: list[ScheduledSeq], in_flight: LaunchedStep | None = None) -> ForwardStep:
        """Queues one step's forward on the device without waiting for it, nor for `in_flight`, the
        step before it, whose sampled ids feed this step's pending tokens on the GPU. Sample it with
        `sample_tokens`, after the step in flight's outputs are processed where
        `ForwardStep.waits_for_previous_step` says so."""
        num_seqs = len(scheduled)
        padded = self._graph_size(scheduled)
        prefill_padded = self._prefill_graph_size(scheduled) if padded is None else None
        pending = None if in_flight is None else in_flight.pending
        input_ids, positions, metadata = self.inputs.prepare(scheduled, pad_to=padded, pending=pending,
                                                             pad_tokens_to=prefill_padded)
        rows = [i for i, s in enumerate(scheduled) if s.is_sampling]
        prompt_rows = (prompt_logprobs.select_rows(scheduled, metadata.query_start_loc_cpu)
                       if padded is None and prefill_padded is None else None)
        pending_prompt = None
        if prefill_padded is not None:
            logits = self.prefill_graphs.replay(prefill_padded, scheduled[0].num_new_tokens)  # [1, vocab]
        elif padded is not None:
            logits = self.graphs.replay(padded)[:num_seqs]  # [S, vocab], one row a sequence
            if not rows:
                return ForwardStep([], None, False)
            if len(rows) < num_seqs:  # a one-token prefill chunk short of its prompt's end
                logits = logits[to_device(rows, torch.long, self.device)]
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [T, hidden]
            if prompt_rows is not None:
                pending_prompt = prompt_logprobs.compute(self.model, hidden, prompt_rows)
            if not rows:
                return ForwardStep([], None, False, pending_prompt)
            if len(rows) == num_seqs == hidden.shape[0]:
                last_hidden = hidden  # one token a sequence, and every one samples
            else:
                last_rows = [metadata.query_start_loc_cpu[i + 1] - 1 for i in rows]
                last_hidden = hidden[to_device(last_rows, torch.long, self.device)]
            logits = self.model.compute_logits(last_hidden)  # [num_sampling, vocab]
        seqs = [scheduled[i].seq for i in rows]
        self.sampling_rows.update(seqs)
        # Only a format's matcher and bad words of several tokens need the previous token on the host:
        # penalties read the device history.
        waits = in_flight is not None and in_flight.pending is not None and any(
            seq.grammar is not None or seq.params.has_multi_token_bad_words for seq in seqs)
        self.num_sampling_waits += waits
        return ForwardStep(seqs, logits, waits, pending_prompt)

    @torch.inference_mode()
    def sample_tokens(self, forward: ForwardStep) -> LaunchedStep:
        """Queues the sampling of a forward step's logits; returns at once."""
        seqs = forward.seqs
        if not seqs:
            return LaunchedStep([], None, forward.prompt_logprobs)
        batch = self.sampling_state.batch(
            self.sampling_rows.slots(seqs),
            # Outputs so far: those on the host and those pending, less the one this step samples.
            [len(seq.token_ids) + seq.num_pending_tokens - 1 - seq.num_prompt_tokens for seq in seqs],
            [seq.grammar for seq in seqs],
            [seq.output_token_ids if seq.params.bad_words_token_ids else None for seq in seqs],
        )
        sample = self.sampler.sample(forward.logits, batch)
        self.sampling_state.record_sampled(batch, sample.token_ids)
        return LaunchedStep([seq.seq_id for seq in seqs], sample, forward.prompt_logprobs)

    def _graph_size(self, scheduled: list[ScheduledSeq]) -> int | None:
        """The captured batch size this step replays at, or None to run it eagerly."""
        # NOTE: the graphs keep only the logits of each sequence's last row, not its hidden states.
        if self.graphs is None or any(s.num_new_tokens != 1 or s.seq.is_collecting_prompt_logprobs
                                      for s in scheduled):
            return None
        return self.graphs.padded_size(len(scheduled))

    def _prefill_graph_size(self, scheduled: list[ScheduledSeq]) -> int | None:
        """The captured prompt length this step replays at: a step of one whole fresh prompt (nothing of it
        cached, its last token sampled, no prompt logprobs) no longer than the longest graph; else None."""
        if self.prefill_graphs is None or len(scheduled) != 1:
            return None
        s = scheduled[0]
        if s.start != 0 or s.num_new_tokens < 2 or not s.is_sampling or s.seq.is_collecting_prompt_logprobs:
            return None
        return self.prefill_graphs.padded_size(s.num_new_tokens)

    def _forward_into_prefill_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                                     metadata: AttentionMetadata, last_row: torch.Tensor) -> torch.Tensor:
        """A prefill graph's body: the forward, and the logits of row `last_row` ([1] on the device) written
        into the decode graphs' shared buffer's first row (graphs never run at once)."""
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [size, hidden]
        out = self._graph_logits[:1]
        return self.model.compute_logits(hidden.index_select(0, last_row), out)

    def _forward_into_graph_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                                   metadata: AttentionMetadata) -> torch.Tensor:
        """The captured body: forward and logits of every row, written into one shared buffer
        (so the graphs' outputs do not each hold a [size, vocab] tensor of their own)."""
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [size, hidden]
        out = self._graph_logits[:input_ids.shape[0]]
        return self.model.compute_logits(hidden, out)
