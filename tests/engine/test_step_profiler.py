"""`--profile-dir`: a torch.profiler trace of exactly the asked engine steps, from the process that runs them."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from inference_service.cli import build_parser, configs_from_args
from inference_service.config import EngineConfig
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.sampling_params import SamplingParams
from inference_service.metrics import EngineMetrics
from test_llm_engine import loaded  # noqa: F401 - fixture


def test_profiles_exactly_the_window_of_steps(loaded, tmp_path):  # noqa: F811
    config = EngineConfig(profile_dir=str(tmp_path), profile_steps=(2, 3))
    engine = LLMEngine(config, loaded=loaded, metrics=EngineMetrics("test", registry=CollectorRegistry()))
    # one prefill step and 7 decode steps: steps 2, 3 and 4 are profiled
    engine.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    (trace,) = tmp_path.glob("steps-*.json")
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {n for n in names if str(n).startswith("engine_step_")} == {"engine_step_2", "engine_step_3",
                                                                          "engine_step_4"}
    assert any(str(n).startswith("aten::") for n in names)
    (table,) = tmp_path.glob("steps-*.txt")
    assert "Self CPU" in table.read_text()
    assert engine.step_profiler is None  # done: later steps run unprofiled


def test_profile_steps_flag_and_config_are_checked():
    config, _ = configs_from_args(build_parser().parse_args(["serve", "--profile-dir", "/tmp/p", "--profile-steps",
                                                             "5:2"]))
    assert (config.profile_dir, config.profile_steps) == ("/tmp/p", (5, 2))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--profile-steps", "5"])
    with pytest.raises(ValueError, match="--profile-steps START:COUNT needs"):
        EngineConfig(profile_steps=(0, 0))
