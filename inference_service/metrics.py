"""Prometheus metrics of the engine, and the one log line per finished request."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info

if TYPE_CHECKING:
    from inference_service.engine.block_manager import BlockManager
    from inference_service.engine.request import EngineRequest, Usage
    from inference_service.engine.scheduler import Scheduler, SchedulerOutput
    from inference_service.engine.sequence import FinishReason, Sequence

logger = logging.getLogger("inference_service.requests")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 40, 80)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_PREFIX = "inference_engine_"
# vLLM's names of the same measurements, exported next to ours with the same values and the same
# `model_name` label, so dashboards, alerts and autoscalers written for vLLM work unchanged.
VLLM_PREFIX = "vllm:"


class _Twin:
    """One measurement recorded under our metric and vLLM's (None: no vLLM counterpart)."""

    __slots__ = ("ours", "vllm")

    def __init__(self, ours, vllm=None):
        self.ours, self.vllm = ours, vllm

    def _both(self):
        return (self.ours,) if self.vllm is None else (self.ours, self.vllm)

    def set(self, value: float) -> None:
        for m in self._both():
            m.set(value)

    def inc(self, amount: float = 1) -> None:
        for m in self._both():
            m.inc(amount)

    def observe(self, value: float) -> None:
        for m in self._both():
            m.observe(value)


class _EventSource:
    """Turns the engine's objects into plain metric events (tuples); `_emit` decides where they go."""

    def __init__(self) -> None:
        self._last_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0
        self._first_scheduled: dict[str, float] = {}

    def _emit(self, event: tuple) -> None:
        raise NotImplementedError

    def on_step(self, sched_out: SchedulerOutput, duration_s: float) -> None:
        """A step whose results came back now, `duration_s` after it was scheduled and launched."""
        # A sequence's queue time ends when its first step is launched, not when that step's results
        # come back (the prefill is the prefill time's).
        scheduled_at = time.monotonic() - duration_s
        queue_times = []
        for s in sched_out.scheduled:
            if s.seq.request_id not in self._first_scheduled:
                self._first_scheduled[s.seq.request_id] = scheduled_at
                queue_times.append(max(0.0, scheduled_at - s.seq.arrival_time))
        self._emit(("step", sched_out.num_batched_tokens, duration_s, queue_times))

    def on_first_token(self, ttft_s: float, seq: Sequence) -> None:
        first = self._first_scheduled.get(seq.request_id)
        self._emit(("first_token", ttft_s, None if first is None else max(0.0, time.monotonic() - first)))

    def on_scheduler_state(self, scheduler: Scheduler, block_manager: BlockManager) -> None:
        bm = block_manager
        self._emit(("state", len({s.request_id for s in scheduler.running}), len(scheduler.waiting), bm.usage,
                    scheduler.num_preemptions - self._last_preemptions, bm.num_prefix_queries - self._last_queries,
                    bm.num_prefix_hits - self._last_hits))
        self._last_preemptions = scheduler.num_preemptions
        self._last_queries, self._last_hits = bm.num_prefix_queries, bm.num_prefix_hits

    def on_request_finished(
        self, request: EngineRequest, first_token_time: float | None, usage: Usage, reason: FinishReason | None
    ) -> None:
        self._first_scheduled.pop(request.request_id, None)
        reason_name = reason.value if reason is not None else "unknown"
        self._emit(("finished", request.request_id, request.arrival_time, first_token_time, usage,
                    request.params.n, reason_name, time.monotonic()))


class EngineMetrics(_EventSource):
    """Engine metrics, each under our name and, where vLLM has one, under vLLM's (`vllm:...`, same value);
    `registry` lets tests and several engines in one process keep theirs apart."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        super().__init__()
        r = registry or REGISTRY
        label = {"model_name": model_name}
        self.model_name = model_name

        def twin(kind, name, vllm_name, doc, **kwargs):
            ours = kind(_PREFIX + name, doc, ["model_name"], registry=r, **kwargs).labels(**label)
            theirs = None if vllm_name is None else kind(VLLM_PREFIX + vllm_name, doc, ["model_name"], registry=r,
                                                         **kwargs).labels(**label)
            return _Twin(ours, theirs)

        def gauge(name, vllm_name, doc):
            return twin(Gauge, name, vllm_name, doc)

        def counter(name, vllm_name, doc):
            return twin(Counter, name, vllm_name, doc)

        def histogram(name, vllm_name, doc, buckets=_LATENCY_BUCKETS):
            return twin(Histogram, name, vllm_name, doc, buckets=buckets)

        self.num_requests_running = gauge("requests_running", "num_requests_running",
                                          "Requests with sequences in the running batch.")
        self.num_requests_waiting = gauge("requests_waiting", "num_requests_waiting",
                                          "Sequences waiting to be scheduled.")
        # NOTE: vLLM's `_perc` is a fraction 0..1 as well, despite its name.
        self.kv_cache_usage = gauge("kv_cache_usage_ratio", "kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (0..1).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("preemptions", "num_preemptions",
                                   "Sequences preempted (recomputed later) for lack of KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "generation_tokens",
                                         "Tokens generated by finished requests.")
        self.tokens_per_step = histogram("tokens_per_step", "iteration_tokens_total",
                                         "Tokens computed per engine step.", _TOKEN_BUCKETS)
        self.step_duration = histogram("step_duration_seconds", None, "Wall time of one model step.")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "time_to_first_token_seconds",
                                             "Arrival to first token.")
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "time_per_output_token_seconds",
            "Mean time between output tokens of a request, after the first.",
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "e2e_request_latency_seconds",
                                     "Arrival to last token.")
        self.queue_time = histogram("request_queue_time_seconds", "request_queue_time_seconds",
                                    "Arrival to first scheduling.")
        self.prefill_time = histogram("request_prefill_time_seconds", "request_prefill_time_seconds",
                                      "First scheduling to first token.")
        self.decode_time = histogram("request_decode_time_seconds", "request_decode_time_seconds",
                                     "First token to last token.")
        self._finished = tuple(
            Counter(prefix + "request_success", "Finished requests by finish reason.",
                    ["model_name", "finished_reason"], registry=r)
            for prefix in (_PREFIX, VLLM_PREFIX)
        )
        self.info = Info(_PREFIX + "model", "The served model.", registry=r)
        self.info.info({"model_name": model_name})

    def _emit(self, event: tuple) -> None:
        self.apply([event])

    def apply(self, events: list[tuple]) -> None:
        """Records the events a `MetricsRecorder` of the engine core process took (sent with its step outputs)."""
        for event in events:
            match event:
                case ("step", num_batched_tokens, duration_s, queue_times):
                    self.tokens_per_step.observe(num_batched_tokens)
                    self.step_duration.observe(duration_s)
                    for queue_time in queue_times:
                        self.queue_time.observe(queue_time)
                case ("first_token", ttft_s, prefill_s):
                    self.time_to_first_token.observe(ttft_s)
                    if prefill_s is not None:
                        self.prefill_time.observe(prefill_s)
                case ("state", num_running, num_waiting, kv_usage, num_preempted, num_queries, num_hits):
                    self.num_requests_running.set(num_running)
                    self.num_requests_waiting.set(num_waiting)
                    self.kv_cache_usage.set(kv_usage)
                    self.preemptions.inc(num_preempted)
                    self.prefix_cache_queries.inc(num_queries)
                    self.prefix_cache_hits.inc(num_hits)
                case ("rejected",):
                    self._count_finished("error")
                case ("finished", request_id, arrival_time, first_token_time, usage, n, reason_name, now):
                    self._finished_request(request_id, arrival_time, first_token_time, usage, n, reason_name, now)
                case _:
                    raise TypeError(f"not a metrics event: {event!r}")

    def on_request_rejected(self) -> None:
        """A request refused before it ran (bad parameters, full queue, draining): finish reason `error`."""
        self._count_finished("error")

    def _count_finished(self, reason: str) -> None:
        for counter in self._finished:
            counter.labels(model_name=self.model_name, finished_reason=reason).inc()

    def _finished_request(self, request_id: str, arrival_time: float, first_token_time: float | None, usage: Usage,
                          n: int, reason_name: str, now: float) -> None:
        e2e = now - arrival_time
        self.e2e_latency.observe(e2e)
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self._count_finished(reason_name)
        ttft = (first_token_time - arrival_time) if first_token_time is not None else float("nan")
        tokens_per_s = 0.0
        if first_token_time is not None:
            decode_s = now - first_token_time
            self.decode_time.observe(decode_s)
            per_seq_tokens = usage.completion_tokens / max(1, n)
            if per_seq_tokens > 1:
                self.time_per_output_token.observe(decode_s / (per_seq_tokens - 1))
            tokens_per_s = usage.completion_tokens / e2e if e2e > 0 else 0.0
        logger.info(
            "request %s finished (%s): prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
            "ttft=%.3fs e2e=%.3fs tokens/s=%.1f",
            request_id, reason_name, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
            ttft, e2e, tokens_per_s,
        )


class MetricsRecorder(_EventSource):
    """`EngineMetrics`' interface inside the engine core process: keeps the events, which travel to the
    front end with the next step output (`take`) and are recorded there (`EngineMetrics.apply`), so the
    front end's one `/metrics` shows both processes."""

    def __init__(self) -> None:
        super().__init__()
        self._events: list[tuple] = []

    def _emit(self, event: tuple) -> None:
        self._events.append(event)

    def on_request_rejected(self) -> None:
        self._events.append(("rejected",))

    def take(self) -> list[tuple]:
        """The events since the last call."""
        events, self._events = self._events, []
        return events
