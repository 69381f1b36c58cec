"""Sends requests on an arrival schedule, under an optional concurrency cap, with a live progress bar."""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.backends import RequestRecord
from loadtest.workload import RequestSpec, arrival_offsets


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    start: float  # perf_counter() when the first request could go
    duration: float  # until the last request ended


class _Progress:
    """tqdm when it is installed and wanted; otherwise nothing."""

    def __init__(self, total: int | None, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="req", dynamic_ncols=True, file=sys.stderr)
        self.num_errors = 0
        self.num_output_tokens = 0

    def done(self, rec: RequestRecord) -> None:
        if self.bar is None:
            return
        self.num_errors += not rec.ok
        self.num_output_tokens += rec.output_tokens
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.bar.set_postfix(errors=self.num_errors, tok_s=f"{self.num_output_tokens / elapsed:.1f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_load(send: Callable[[RequestSpec, RequestRecord], object], make_spec: Callable[[int], RequestSpec], *,
                   num_requests: int | None, duration: float | None = None, request_rate: float = math.inf,
                   burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                   progress: bool = True,
                   on_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Issue requests 0, 1, ... at their arrival times until `num_requests` or `duration` s of issuing.

    With a concurrency cap, an arrived request waits for a free slot and its clock starts when it
    is sent (as `vllm bench serve --max-concurrency` does); rate inf + cap = fixed concurrency.
    """
    if num_requests is None and duration is None:
        raise ValueError("give a number of requests, a duration, or both")
    if num_requests is None and math.isinf(request_rate) and not max_concurrency:
        raise ValueError("an open-ended run needs a finite request rate or a concurrency cap")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _Progress(num_requests, progress)
    records: list[RequestRecord] = []

    async def one(spec: RequestSpec) -> None:
        rec = RequestRecord(spec.index)
        records.append(rec)
        try:
            await send(spec, rec)
        except Exception as e:  # noqa: BLE001 - one bad response must not end the whole run
            rec.fail("client_error", f"{type(e).__name__}: {e}")
            rec.finish(time.perf_counter(), completed=False)
        finally:
            if slots is not None:
                slots.release()
        bar.done(rec)
        if on_done is not None:
            on_done(rec)

    tasks: list[asyncio.Task] = []
    start = time.perf_counter()
    indices = range(num_requests) if num_requests is not None else itertools.count()
    try:
        for i, offset in zip(indices, arrival_offsets(request_rate, burstiness, seed)):
            if duration is not None and offset >= duration:
                break
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                # Waiting here (not in the task) keeps the backlog bounded in open-ended runs.
                await slots.acquire()
                if duration is not None and time.perf_counter() - start >= duration:
                    slots.release()
                    break
            tasks.append(asyncio.create_task(one(make_spec(i))))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
    end = max((r.end for r in records), default=time.perf_counter())
    return RunResult(records=sorted(records, key=lambda r: r.index), start=start, duration=end - start)
