"""torch.profiler over a window of engine steps (`serve --profile-dir DIR --profile-steps START:COUNT`).

Where a served step's time goes (host launches, stream waits, kernels) is what the engine's own histograms cannot
say, and a profiler attached from outside cannot reach the engine core's process: this runs inside whichever
process steps the engine (as vLLM's torch profiler directory does), so the served path is profiled as it ships.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


class StepProfiler:
    """Profiles the engine's steps number `start` .. `start + count - 1` (steps that launched work, counted from 0),
    then writes `DIR/steps-<pid>.json` (a Chrome/Perfetto trace) and `DIR/steps-<pid>.txt` (the top operators by
    device time and by host time)."""

    def __init__(self, out_dir: str, start: int, count: int):
        self.out_dir, self.start, self.count = out_dir, start, count
        self.num_steps = 0
        self._profile: torch.profiler.profile | None = None
        self._step_range: torch.profiler.record_function | None = None
        os.makedirs(out_dir, exist_ok=True)

    @property
    def is_done(self) -> bool:
        return self.num_steps >= self.start + self.count

    def before_step(self) -> None:
        if self.num_steps == self.start and self._profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.__enter__()
            logger.info("profiling engine steps %d..%d", self.start, self.start + self.count - 1)
        if self._profile is not None:
            # One range a step on the trace's host timeline: where each step's launches begin and end
            self._step_range = torch.profiler.record_function(f"engine_step_{self.num_steps}")
            self._step_range.__enter__()

    def after_step(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        self.num_steps += 1
        if self._profile is not None and self.is_done:
            self.finish()

    def finish(self) -> None:
        """Stops a profile in progress and writes it (also called at shutdown, for a window never reached)."""
        profile, self._profile = self._profile, None
        if profile is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the last launched step's kernels belong in the trace
        profile.__exit__(None, None, None)
        base = os.path.join(self.out_dir, f"steps-{os.getpid()}")
        profile.export_chrome_trace(base + ".json")
        events = profile.key_averages()
        with open(base + ".txt", "w") as f:
            f.writelines(events.table(sort_by=key, row_limit=30) + "\n"
                         for key in ("self_device_time_total", "self_cpu_time_total"))
        logger.info("wrote the profile of engine steps %d..%d to %s.{json,txt}", self.start,
                    self.num_steps - 1, base)
