"""Server-side defaults and vLLM's extra request fields, end to end: a tiny checkpoint whose
generation_config.json sets sampling defaults, served by the real engine over gRPC, and the proxy in front
of it driven by the official `openai` SDK (vLLM fields through `extra_body`)."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

from inference_service import ENGINE_VERSION
from inference_service.api import pb, pb_grpc
from inference_service.engine.generation_config import load_generation_defaults
from rest_proxy.config import ProxyConfig
from tests.grpc_client import GenerateStream
from tests.model.tiny_models import make_hf_model, save_hf_model
from tests.proxy.conftest import launch_engine
from tests.proxy.servers import ProxyServer

# repetition_penalty is what greedy requests can observe exactly; max_new_tokens is the default max_tokens.
GENERATION_CONFIG = {"temperature": 0.0, "top_p": 0.8, "top_k": 7, "repetition_penalty": 3.0,
                     "max_new_tokens": 6, "bos_token_id": 256, "eos_token_id": 257}
PROMPT = "abcabcabcabc"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = save_hf_model(make_hf_model("qwen2"), str(tmp_path_factory.mktemp("tiny")))
    with open(f"{folder}/generation_config.json", "w") as f:
        json.dump(GENERATION_CONFIG, f)
    return folder


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    yield from launch_engine(tmp_path_factory.mktemp("defaults"), "--model", checkpoint,
                             "--override-generation-config", '{"presence_penalty": 0.5}',
                             "--scheduling-policy", "priority", "--max-num-seqs", "1")


@pytest.fixture(scope="module")
def stub(engine):
    with grpc.insecure_channel(engine) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


@pytest.fixture(scope="module")
def proxy(engine):
    server = ProxyServer(ProxyConfig(engines=[engine])).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sdk(proxy) -> OpenAI:
    return OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def generate(stub, **fields):
    stream = GenerateStream(stub)
    stream.start("r", text=PROMPT, **fields)
    stream.wait_done({"r"})
    stream.close()
    return stream.results["r"]


def test_defaults_are_read_merged_and_reported(stub, checkpoint):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    d = info.generation_defaults
    assert (d.temperature, round(d.top_p, 6), d.top_k, d.repetition_penalty, d.presence_penalty, d.max_tokens) \
        == (0.0, 0.8, 7, 3.0, 0.5, 6)
    assert not d.HasField("min_p") and not d.HasField("frequency_penalty")
    assert info.engine_version == ENGINE_VERSION and info.scheduling_policy == "priority"
    assert load_generation_defaults("none", checkpoint).as_dict() == {}
    assert load_generation_defaults(checkpoint, "/elsewhere", {"max_tokens": 3}).as_dict() == {
        "temperature": 0.0, "top_p": 0.8, "top_k": 7, "repetition_penalty": 3.0, "max_tokens": 3}


def test_unset_fields_take_the_defaults_and_set_fields_win(stub):
    defaulted = generate(stub)  # nothing set: greedy (temperature 0), penalties, 6 tokens
    explicit = generate(stub, sampling=pb.SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=0.5,
                                                         top_k=7, top_p=0.8),
                        stopping=pb.StoppingCriteria(max_tokens=6))
    plain = generate(stub, sampling=pb.SamplingParams(temperature=0.0, repetition_penalty=1.0, presence_penalty=0.0),
                     stopping=pb.StoppingCriteria(max_tokens=6))
    assert len(defaulted.tokens) == 6 and defaulted.completions[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert defaulted.tokens == explicit.tokens
    assert plain.tokens != defaulted.tokens  # the penalties changed the greedy path
    assert len(generate(stub, stopping=pb.StoppingCriteria(max_tokens=2)).tokens) == 2


def test_proxy_leaves_omitted_fields_to_the_engine(sdk, stub):
    model = sdk.models.list().data[0].id
    defaulted = generate(stub)
    resp = sdk.completions.create(model=model, prompt=PROMPT)  # no max_tokens, no temperature
    assert resp.usage.completion_tokens == 6 and resp.choices[0].finish_reason == "length"
    ids = sdk.completions.create(model=model, prompt=PROMPT, logprobs=0)
    assert ids.usage.completion_tokens == 6
    assert resp.choices[0].text == ids.choices[0].text
    plain = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                   extra_body={"repetition_penalty": 1.0, "presence_penalty": 0.0})
    assert plain.choices[0].text != resp.choices[0].text
    assert len(defaulted.tokens) == 6


def test_allowed_token_ids_and_bad_words_through_the_proxy(sdk, stub):
    model = sdk.models.list().data[0].id
    tokens = stub.Tokenize(iter([pb.TokenizeRequest(request_id="t", tokenize=pb.TokenizeText(text="xy"))]))
    allowed = list(next(tokens).token_ids)  # byte tokens: "x" and "y"
    resp = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": allowed})
    assert set(resp.choices[0].text) <= {"x", "y"} and len(resp.choices[0].text) == 8
    # Letters only (the random model's free output is mostly invalid UTF-8), then a two-token word banned.
    tokens = stub.Tokenize(iter([pb.TokenizeRequest(request_id="t", tokenize=pb.TokenizeText(text="abcxyz"))]))
    letters = {"allowed_token_ids": list(next(tokens).token_ids)}
    free = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body=letters).choices[0].text
    word = free[:2]
    banned = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={**letters, "bad_words": [word]}).choices[0].text
    assert len(banned) == 6 and word not in banned and banned[0] == free[0] and banned[1] != free[1]
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"allowed_token_ids": [1, 10**6]})
    assert e.value.body["param"] == "sampling.allowed_token_ids[1]"


def test_truncate_stop_str_priority_and_echo(sdk, proxy):
    model = sdk.models.list().data[0].id
    resp = sdk.completions.create(model=model, prompt="zzzzzzzz" + PROMPT, max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 4})
    assert resp.usage.prompt_tokens == 4
    free = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    stop = free[2:4]
    cut = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop])
    kept = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text == free[:2] and kept.choices[0].text == free[:4]
    chat = sdk.chat.completions.create(
        # (the tiny template renders the first message only)
        model=model, max_tokens=3, temperature=0, messages=[{"role": "assistant", "content": "Once"}],
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False, "priority": -2})
    assert chat.choices[0].message.content.startswith("Once") and len(chat.choices[0].message.content) > 4
    for body, param in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"priority": "1"}, "priority"),
                        ({"priority": 1.5}, "priority"), ({"bad_words": [""]}, "bad_words[0]"),
                        ({"allowed_token_ids": [-1]}, "allowed_token_ids[0]")):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body=body)
        assert e.value.status_code == 400 and e.value.body["param"] == param, body
    version = httpx.get(proxy.url + "/version").json()
    assert version == {"version": ENGINE_VERSION, "engines": [{"model": model, "version": ENGINE_VERSION}]}


def grpc_prompt_logprobs(stub, num_top: int) -> list[pb.TokenLogprob]:
    stream = GenerateStream(stub)
    stream.start("plp", text=PROMPT, sampling=pb.SamplingParams(prompt_logprobs=num_top),
                 stopping=pb.StoppingCriteria(max_tokens=1))
    first = stream.next()
    stream.wait_done({"plp"})
    stream.close()
    return list(first.prompt_logprobs)


def vllm_entry(lp: pb.TokenLogprob) -> dict:
    """vLLM's layout of one prompt position: the prompt token first, then the alternatives not already in it."""
    entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}}
    for rank, t in enumerate(lp.top_logprobs, 1):
        entry.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank, "decoded_token": t.token})
    return entry


def test_prompt_logprobs_through_the_proxy_in_vllms_shape(sdk, stub):
    model = sdk.models.list().data[0].id
    expected = grpc_prompt_logprobs(stub, 2)
    assert len(expected) == 11 and all(len(lp.top_logprobs) == 2 and lp.rank >= 1 for lp in expected)
    resp = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=2, extra_body={"prompt_logprobs": 2})
    assert resp.usage.prompt_tokens == 12
    for choice in resp.choices:  # every choice of the prompt, as in vLLM
        assert choice.prompt_logprobs == [None] + [vllm_entry(lp) for lp in expected]
    first = resp.choices[0].prompt_logprobs[1]
    assert {v["rank"] for v in first.values()} >= {1, 2}
    # Chat: vLLM puts them on the response, for the rendered prompt.
    chat = sdk.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": PROMPT}],
                                       extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])
    plain = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert "prompt_logprobs" not in plain.choices[0].model_extra
    for body, stream in (({"prompt_logprobs": 21}, False), ({"prompt_logprobs": -1}, False),
                         ({"prompt_logprobs": 1}, True)):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=stream, extra_body=body)
        assert e.value.status_code == 400 and e.value.body["param"] == "prompt_logprobs", body
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": PROMPT}],
                                        stream=stream, extra_body=body)
        assert e.value.status_code == 400 and e.value.body["param"] == "prompt_logprobs", body


def test_echo_with_logprobs_scores_the_prompt(sdk, stub):
    """OpenAI's legacy `echo` + `logprobs`, and `max_tokens` 0 with it: what lm-evaluation-harness sends to
    score a text (its `local-completions` log-likelihood requests)."""
    model = sdk.models.list().data[0].id
    expected = grpc_prompt_logprobs(stub, 2)  # positions 1..11 of the 12-token prompt
    tokens = [lp.token for lp in expected]
    scored = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.tokens == [PROMPT[0], *tokens]  # byte tokens: one character each
    assert choice.logprobs.token_logprobs == [None] + [lp.logprob for lp in expected]
    assert choice.logprobs.top_logprobs == [None] + [{t.token: t.logprob for t in lp.top_logprobs} for lp in expected]
    assert choice.logprobs.text_offset == list(range(12))
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens, scored.usage.total_tokens) == (12, 0, 12)
    ids = next(stub.Tokenize(iter([pb.TokenizeRequest(tokenize=pb.TokenizeText(text=PROMPT))]))).token_ids
    by_ids = sdk.completions.create(model=model, prompt=list(ids), max_tokens=0, echo=True, logprobs=2)
    assert by_ids.choices[0].logprobs == choice.logprobs and by_ids.choices[0].text == PROMPT
    # With new tokens: the prompt's logprobs, then theirs, in every choice and in the stream.
    free = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
    both = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True, n=2)
    for c in both.choices:
        assert c.text == PROMPT + free.choices[0].text
        assert c.logprobs.token_logprobs == [None] + [lp.logprob for lp in expected] \
            + free.choices[0].logprobs.token_logprobs
        assert c.logprobs.text_offset[12:] == [12 + o for o in free.choices[0].logprobs.text_offset]
    chunks = list(sdk.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1,
                                         echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == both.choices[0].text
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == both.choices[0].logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=model, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.body["message"]
