"""Structured output on the embedded model: outputs match their format (JSON schema, JSON object, regex,
Lark grammar) whatever the sampling, batching, preemption or scheduling mode, and leave the unconstrained
requests of the same batch untouched; a bad format is an error naming its field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.sequence import FinishReason
from inference_service.engine.structured_output import StructuredOutputSpec, token_bitmask, unpack_bitmask
from inference_service.errors import InvalidRequestError
from test_llm_engine import PROMPTS, assert_all_blocks_free, loaded, make_engine, run  # noqa: F401 - fixture

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"


def _params(kind: str, value: str = "", **kw) -> SamplingParams:
    return SamplingParams(structured_output=StructuredOutputSpec(kind, value), **{"max_tokens": 80, **kw})


def test_every_format_is_met_greedy_and_sampled(loaded):
    engine = make_engine(loaded)
    prompts = ["Give me a JSON with a person's name and age:", "Describe a cat as JSON:", "Today's date is",
               "Is the sky blue? Answer:"]
    for temperature in (0.0, 1.0):
        params = [_params("json_schema", json.dumps(PERSON), temperature=temperature, seed=1),
                  _params("json_object", temperature=temperature, seed=2),
                  _params("regex", DATE, temperature=temperature, seed=3),
                  _params("lark_grammar", 'start: "yes" | "no" | "maybe"', temperature=temperature, seed=4)]
        out = run(engine, prompts, params)
        texts = [out[f"r{i}"]["text"][0] for i in range(4)]
        assert all(out[f"r{i}"]["finish"][0] == FinishReason.STOP for i in range(4)), texts
        jsonschema.validate(json.loads(texts[0]), PERSON)
        assert isinstance(json.loads(texts[1]), dict), texts[1]
        assert re.fullmatch(DATE, texts[2]), texts[2]
        assert texts[3] in ("yes", "no", "maybe"), texts[3]
    assert_all_blocks_free(engine)


def test_unconstrained_neighbours_are_untouched(loaded):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = run(make_engine(loaded), PROMPTS[:3], free)
    mixed = run(make_engine(loaded), PROMPTS[:6],
                [free] * 3 + [_params("json_object", temperature=0.0), _params("regex", DATE, temperature=0.0),
                              _params("json_schema", json.dumps(PERSON), temperature=0.7, n=3, seed=5)])
    for i in range(3):
        assert mixed[f"r{i}"]["tokens"][0] == alone[f"r{i}"]["tokens"][0]
    # n = 3: each completion has its own matcher. Seeded: unseeded sampling may spend max_tokens on the
    # whitespace the JSON grammar allows, and a cut-off document is no test of the matchers.
    for index in range(3):
        assert mixed["r5"]["finish"][index] == FinishReason.STOP, mixed["r5"]["text"]
        jsonschema.validate(json.loads(mixed["r5"]["text"][index]), PERSON)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_and_async_runs_give_the_same_constrained_output(loaded, async_scheduling):
    prompts = PROMPTS[:8]
    params = [_params("json_schema", json.dumps(PERSON), temperature=0.0) if i % 2 else
              _params("regex", r"[a-z ]{40,60}\.", temperature=0.0) for i in range(len(prompts))]
    reference = run(make_engine(loaded), prompts, params)
    small = make_engine(loaded, num_blocks_mib=6, async_scheduling=async_scheduling)  # 8 blocks, see test_llm_engine
    got = run(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    for rid in reference:
        assert got[rid]["tokens"] == reference[rid]["tokens"], rid
    assert_all_blocks_free(small)


@pytest.mark.parametrize("stopping", [{"min_tokens": 5}, {"ignore_eos": True}])
def test_a_complete_format_ends_the_request(loaded, stopping):
    # Once the output is a whole match that admits nothing more, the request ends there: neither
    # min_tokens nor ignore_eos can make it go on (every token but EOS is masked).
    out = run(make_engine(loaded), ["Is the sky blue? Answer:"],
              _params("lark_grammar", 'start: "yes" | "no"', temperature=0.0, **stopping))["r0"]
    assert out["finish"][0] == FinishReason.STOP
    assert out["tokens"][0] == loaded.tokenizer.encode(out["text"][0], add_special_tokens=False)
    assert out["text"][0] in ("yes", "no")


def test_mask_allows_exactly_the_prefixes_of_a_match(loaded):
    engine = make_engine(loaded)
    tokenizer = engine.tokenizer
    matcher = engine.grammar_compiler.compile(StructuredOutputSpec("regex", "(yes|no)"))
    vocab_size = loaded.config.vocab_size
    allowed = unpack_bitmask(token_bitmask([matcher], vocab_size), vocab_size)[0]  # [V]
    texts = {i: tokenizer.decode([i], skip_special_tokens=False) for i in allowed.nonzero().flatten().tolist()}
    assert texts and all(t and ("yes".startswith(t) or "no".startswith(t)) for t in texts.values()), texts
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in texts
    assert not allowed[tokenizer.eos_token_id]  # the empty output is no match
    matcher.consume_tokens(tokenizer.encode("no", add_special_tokens=False))
    allowed = unpack_bitmask(token_bitmask([matcher], vocab_size), vocab_size)[0]
    assert allowed.nonzero().flatten().tolist() == [tokenizer.eos_token_id]


@pytest.mark.parametrize(("kind", "value", "message"), [
    ("regex", "((", "unclosed group"),
    ("json_schema", "{not json", "is not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON schema object"),
    ("json_schema", '{"type": "nonsense"}', "nonsense"),
    ("lark_grammar", "start: undefined_rule", "undefined_rule"),
    ("regex", "", "must be a non-empty string"),
])
def test_a_bad_format_names_its_field(loaded, kind, value, message):
    engine = make_engine(loaded)
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        engine.add_request(engine.input_processor.process("bad", "Hello", _params(kind, value)))
    assert info.value.field == f"sampling.structured_output.{kind}"
    assert not engine.has_unfinished


def test_an_unknown_kind_is_refused():
    with pytest.raises(InvalidRequestError, match="must be one of json_schema") as info:
        StructuredOutputSpec("yaml", "x")
    assert info.value.field == "sampling.structured_output"
