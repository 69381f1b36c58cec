"""The synchronous engine: requests in, one `step()` at a time, completion deltas out."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from inference_service.config import EngineConfig
from inference_service.engine.block_manager import BlockManager
from inference_service.engine.generation_config import load_generation_defaults
from inference_service.engine.info import EngineInfo, EngineLoad, ModelInfo
from inference_service.engine.input_processor import InputProcessor
from inference_service.engine.model_runner import LaunchedStep, ModelRunner, SampledToken
from inference_service.engine.output_processor import OutputProcessor
from inference_service.engine.model_loading import load_model_for, resolve_device, resolve_dtype
from inference_service.engine.request import CompletionDelta, EngineRequest, RequestOutput, TokenLogprob, Usage
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.scheduler import Scheduler, SchedulerOutput
from inference_service.engine.sequence import FinishReason, Sequence
from inference_service.engine.step_profiler import StepProfiler
from inference_service.engine.structured_output import GrammarCompiler
from inference_service.errors import EngineError, InvalidRequestError
from inference_service.model.chat_template import load_chat_template
from inference_service.metrics import EngineMetrics
from inference_service.model.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlightStep:
    sched_out: SchedulerOutput
    launched: LaunchedStep
    start_time: float


@dataclass
class _RequestState:
    request: EngineRequest
    seqs: list[Sequence]
    num_finished: int = 0
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    last_token_time: float = field(default_factory=time.monotonic)


class LLMEngine:
    """Continuous batching over one model: `step()` = schedule -> run -> update_from_output.

    With async scheduling (on by default on a GPU) a step is launched and left in flight: the
    next `step()` schedules and launches its successor first, feeding it the sampled ids on the
    GPU, and only then waits for the step in flight and processes its outputs, so the host's work
    overlaps the GPU's. A sequence that stops (EOS, stop string) computes one more token, dropped.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, metrics: EngineMetrics | None = None):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.loaded = loaded or load_model_for(config).loaded
        self.tokenizer = self.loaded.tokenizer
        if config.chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
        model_len = self.loaded.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.generation_defaults = load_generation_defaults(config.generation_config, self.loaded.model_path,
                                                            config.override_generation_config,
                                                            self.loaded.gguf_metadata)
        self.model_runner = ModelRunner(self.loaded, config, self.device, self.dtype, self.max_model_len)
        self.block_manager = BlockManager(
            self.model_runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.loaded.config.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.loaded.config.vocab_size)
        self.metrics = metrics or EngineMetrics(self.loaded.model_name)
        self.requests: dict[str, _RequestState] = {}
        self.is_async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                    else config.async_scheduling)
        self._in_flight: _InFlightStep | None = None
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        # A sequence may not outgrow the whole cache, or preempting it could never make room.
        self.max_seq_tokens = self.model_runner.max_seq_tokens
        self._generate_ids = itertools.count()
        self.step_profiler = (StepProfiler(config.profile_dir, *config.profile_steps)
                              if config.profile_dir is not None else None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    def info(self) -> EngineInfo:
        """The engine's sizes and limits (fixed once built)."""
        sched, bm = self.config.scheduler, self.block_manager
        return EngineInfo(
            model=ModelInfo.of(self.loaded, self.config.served_model_name, self.device, self.dtype),
            max_model_len=self.max_model_len, max_seq_tokens=self.max_seq_tokens, block_size=bm.block_size,
            num_blocks=bm.num_blocks, enable_prefix_caching=bm.enable_prefix_caching,
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            max_waiting_requests=sched.max_waiting_requests, is_async_scheduling=self.is_async_scheduling,
            scheduling_policy=sched.policy, generation_defaults=self.generation_defaults,
        )

    def load(self) -> EngineLoad:
        """The queues and the cache now."""
        return EngineLoad(num_waiting=self.num_waiting, num_running=len(self.scheduler.running),
                          num_free_blocks=self.block_manager.num_free_blocks, num_blocks=self.block_manager.num_blocks)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission (new or preempted)."""
        return len(self.scheduler.waiting)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def compile_grammar(self, structured_output):
        """The llguidance matcher of a request's output format; `InvalidRequestError` for a bad one.

        Thread-safe: the async engine compiles off the step thread."""
        return self.grammar_compiler.compile(structured_output)

    def add_request(self, request: EngineRequest) -> None:
        """Queues a processed request as `params.n` sequences sharing its prompt's blocks."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", field="request_id")
        params = request.params
        num_prompt = len(request.prompt_token_ids)
        if num_prompt >= self.max_seq_tokens:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens but the KV cache holds only {self.max_seq_tokens}",
                field="input",
            )
        max_total = min(self.max_seq_tokens, num_prompt + (params.max_tokens or params.default_max_tokens
                                                            or self.max_model_len))
        grammar = request.grammar
        if grammar is None and params.structured_output is not None:
            grammar = self.grammar_compiler.compile(params.structured_output)
        seqs = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(params.seed + index)
            seq = Sequence(
                request_id=request.request_id,
                index=index,
                token_ids=list(request.prompt_token_ids),
                num_prompt_tokens=num_prompt,
                params=params,
                eos_token_ids=self.eos_token_ids,
                max_total_tokens=max_total,
                generator=generator,
                grammar=grammar if index == 0 or grammar is None else grammar.deep_copy(),
                arrival_time=request.arrival_time,
                priority=request.priority,
                # The prompt's logprobs are the same for every completion: completion 0 computes them.
                prompt_logprobs=[] if index == 0 and params.prompt_logprobs is not None else None,
            )
            seqs.append(seq)
            self.output_processor.add(seq)
            self.scheduler.add(seq)
        self.requests[request.request_id] = _RequestState(request, seqs)

    def add_or_reject(self, request: EngineRequest) -> list[CompletionDelta]:
        """`add_request`, but a request the engine's state refuses (cache size, format, duplicate id) is
        counted as rejected and answered with its one error delta instead of raising."""
        try:
            self.add_request(request)
        except EngineError as e:
            self.metrics.on_request_rejected()
            usage = Usage(len(request.prompt_token_ids), 0, 0)
            return [CompletionDelta(request.request_id, 0, [], "", finish_reason=FinishReason.ERROR, usage=usage,
                                    error=e)]
        return []

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> list[CompletionDelta]:
        """Ends every unfinished sequence of the request; returns their final deltas."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        deltas = []
        for seq in state.seqs:
            if seq.is_finished:
                continue
            self.scheduler.finish(seq, reason)
            self.output_processor.remove(seq)
            deltas.append(self._finish_delta(state, seq))
        self.metrics.on_scheduler_state(self.scheduler, self.block_manager)
        return deltas

    def abort_all(self, reason: FinishReason = FinishReason.ABORT) -> list[CompletionDelta]:
        """Ends every request; returns their final deltas."""
        return [delta for request_id in list(self.requests) for delta in self.abort_request(request_id, reason)]

    def step(self) -> list[CompletionDelta]:
        """Schedules and launches a step; returns the deltas of the step(s) resolved meanwhile:
        this one without async scheduling, else the one launched by the previous call."""
        deltas = []
        sched_out = self.scheduler.schedule()
        launched = None
        if not sched_out.is_empty:
            if self.step_profiler is not None:
                self.step_profiler.before_step()
            start = time.perf_counter()
            forward = self.model_runner.execute_model(sched_out.scheduled, self._in_flight and self._in_flight.launched)
            if forward.waits_for_previous_step:
                # Formats' matchers take the previous token on the host: the forward is queued meanwhile.
                deltas = self.wait_for_in_flight_step()
            launched = _InFlightStep(sched_out, self.model_runner.sample_tokens(forward), start)
        deltas += self.wait_for_in_flight_step()
        self._in_flight = launched
        if not self.is_async_scheduling:
            deltas += self.wait_for_in_flight_step()
        if launched is not None and self.step_profiler is not None:
            self.step_profiler.after_step()
            if self.step_profiler.is_done:
                self.step_profiler = None
        return deltas

    def run_until_idle(self) -> list[CompletionDelta]:
        """Steps until no request is left; returns every delta on the way."""
        deltas = []
        while self.has_unfinished:
            deltas += self.step()
        return deltas

    def generate(self, prompts: Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams]) -> list[RequestOutput]:
        """Offline generation: runs every prompt (text or token ids) to the end, batched together.

        `sampling_params` is one for all prompts or one per prompt. Returns the outputs in prompt order.
        The engine must be idle (no request added otherwise), so that no delta goes unreturned."""
        if self.has_unfinished:
            raise RuntimeError("generate() needs an idle engine: requests added with add_request are running")
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        outputs = {}
        for prompt, p in zip(prompts, params):
            request_id = f"generate-{next(self._generate_ids)}"
            self.add_request(self.input_processor.process(request_id, prompt, p))
            outputs[request_id] = RequestOutput.empty(request_id, p.n)
        for delta in self.run_until_idle():
            outputs[delta.request_id].add(delta)
        return list(outputs.values())

    def wait_for_in_flight_step(self) -> list[CompletionDelta]:
        """Waits for the step in flight, if any, and returns its deltas."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        sampled = in_flight.launched.result()
        self._add_prompt_logprobs(in_flight.sched_out, in_flight.launched.prompt_logprobs())
        self.metrics.on_step(in_flight.sched_out, time.perf_counter() - in_flight.start_time)
        return self.update_from_output(in_flight.sched_out, sampled)

    @staticmethod
    def _add_prompt_logprobs(sched_out: SchedulerOutput, new_entries: dict[int, list[TokenLogprob]]) -> None:
        """Appends a step's prompt logprobs to their sequences (before the step's sampled tokens, so that the
        first token's delta finds them complete)."""
        if not new_entries:
            return
        for s in sched_out.scheduled:
            entries = new_entries.get(s.seq.seq_id)
            if entries is not None:
                s.seq.prompt_logprobs += entries

    def update_from_output(self, sched_out: SchedulerOutput, sampled: dict[int, SampledToken]) -> list[CompletionDelta]:
        """Appends a finished step's sampled tokens (by `seq_id`) and returns their deltas."""
        token_ids = {seq_id: s.token_id for seq_id, s in sampled.items()}
        deltas = []
        now = time.monotonic()
        for seq in self.scheduler.update_from_output(sched_out, token_ids):
            state = self.requests[seq.request_id]
            delta, stop_string_verdict = self.output_processor.process(seq, sampled[seq.seq_id])
            if seq.prompt_logprobs is not None and seq.num_output_tokens == 1:
                assert len(seq.prompt_logprobs) == seq.num_prompt_tokens - 1
                delta.prompt_logprobs = seq.prompt_logprobs
            if stop_string_verdict is not None:
                self.scheduler.finish(seq, stop_string_verdict.reason, stop_string_verdict.stop_reason)
            if state.first_token_time is None:
                state.first_token_time = now
                self.metrics.on_first_token(now - state.request.arrival_time, seq)
            if seq.is_finished:
                self._on_seq_finished(state, seq, delta)
            deltas.append(delta)
        self.metrics.on_scheduler_state(self.scheduler, self.block_manager)
        return deltas

    def _finish_delta(self, state: _RequestState, seq: Sequence) -> CompletionDelta:
        delta = CompletionDelta(seq.request_id, seq.index, [], "", finish_reason=seq.finish_reason)
        self._on_seq_finished(state, seq, delta)
        return delta

    def _on_seq_finished(self, state: _RequestState, seq: Sequence, delta: CompletionDelta) -> None:
        state.num_finished += 1
        if state.num_finished < len(state.seqs):
            return
        del self.requests[seq.request_id]
        usage = Usage(
            prompt_tokens=len(state.request.prompt_token_ids),
            completion_tokens=sum(s.num_output_tokens for s in state.seqs),
            cached_tokens=max(0, state.seqs[0].num_cached_tokens),
        )
        delta.usage = usage
        self.metrics.on_request_finished(state.request, state.first_token_time, usage, seq.finish_reason)
