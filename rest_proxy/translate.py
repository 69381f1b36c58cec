"""OpenAI request fields -> engine protobuf messages, and engine outputs -> OpenAI fields."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from inference_service.api import pb
from rest_proxy.errors import ProxyError, invalid_request
from rest_proxy.protocol import ChatMessageParam, _SamplingFields
from rest_proxy.schemas import check_format, check_json_schema, parse_json_schema
from rest_proxy.tool_parsers import ToolParser

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool", "function": "tool"}
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
_UINT64 = 2**64


def sampling_params(req: _SamplingFields, *, logprobs: bool = False, top_logprobs: int = 0) -> pb.SamplingParams:
    params = pb.SamplingParams(logprobs=logprobs, top_logprobs=top_logprobs if logprobs else 0)
    # NOTE: a field the client omits stays unset, so the engine's defaults (the checkpoint's
    # generation_config.json, --override-generation-config) apply, as in vLLM.
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                 "prompt_logprobs"):
        value = getattr(req, name)
        if value is not None:
            setattr(params, name, value)
    if req.top_k is not None:
        params.top_k = max(req.top_k, 0)  # vLLM's -1 = off = our 0
    params.allowed_token_ids.extend(req.allowed_token_ids or [])
    params.bad_words.extend(req.bad_words or [])
    if req.seed is not None:
        params.seed = req.seed % _UINT64
    for key, bias in (req.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token_id < 2**32:
            raise invalid_request(f"logit_bias token id {token_id} is out of range", "logit_bias")
        params.logit_bias[token_id] = bias
    structured = structured_output(req)
    if structured is not None:
        params.structured_output.CopyFrom(structured)
    return params


def set_request_options(start: pb.StartGeneration, req: _SamplingFields) -> None:
    """The request-level vLLM fields: truncate_prompt_tokens and priority."""
    if req.truncate_prompt_tokens is not None:
        start.truncate_prompt_tokens = req.truncate_prompt_tokens
    start.priority = req.priority


def default_max_tokens(info: pb.GetModelInfoResponse | None, api_default: int | None) -> int | None:
    """max_tokens of a request that sets none: None (unset) where the engine has a default of its own,
    which then applies, else the API's (`api_default`)."""
    if info is not None and info.generation_defaults.HasField("max_tokens"):
        return None
    return api_default


def format_field(req: _SamplingFields) -> str | None:
    """The request field that carries its format constraint (`response_format`, `guided_regex`,
    `structured_outputs.json`, ...), or None; more than one is a 400 naming the second."""
    given = _given_formats(req)
    return next(iter(given), None)


def _given_formats(req: _SamplingFields) -> dict[str, tuple[str, object]]:
    given: dict[str, tuple[str, object]] = {}  # request field -> (format kind, value)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = ("json_object", True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise invalid_request("response_format of type json_schema needs json_schema.schema",
                                  "response_format.json_schema.schema")
        given["response_format.json_schema.schema"] = ("json", fmt.json_schema.json_schema)
    vllm = req.structured_outputs
    fields = {} if vllm is None else {"json": vllm.json_, "regex": vllm.regex, "choice": vllm.choice,
                                      "grammar": vllm.grammar, "json_object": vllm.json_object or None}
    fields = {f"structured_outputs.{kind}": (kind, value) for kind, value in fields.items()}
    fields.update({f"guided_{kind}": (kind, getattr(req, f"guided_{kind}"))
                   for kind in ("json", "regex", "choice", "grammar")})
    given.update({name: pair for name, pair in fields.items() if pair[1] is not None})
    if len(given) > 1:
        names = [name.split(".json_schema")[0] for name in given]
        raise invalid_request(f"give at most one of {', '.join(names)}", names[1])
    return given


def structured_output(req: _SamplingFields) -> pb.StructuredOutput | None:
    """The request's format constraint: `response_format` (json_object, json_schema), vLLM's
    `structured_outputs` or its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark);
    None for free text. More than one, or one that does not compile, is a 400 naming the client's field."""
    given = _given_formats(req)
    if not given:
        return None
    param, (kind, value) = next(iter(given.items()))
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json":
        schema = parse_json_schema(value, param)
        check_json_schema(schema, param, constrained=True)
        return pb.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "regex":
        check_format("regex", value, param)
        return pb.StructuredOutput(regex=value)
    if kind == "choice":
        # A Lark alternation of JSON-quoted literals: no character of a choice needs regex escaping.
        grammar = "start: " + " | ".join(json.dumps(c) for c in value)
        check_format("choice", grammar, param)
        return pb.StructuredOutput(lark_grammar=grammar)
    check_format("grammar", value, param)
    return pb.StructuredOutput(lark_grammar=value)


def map_format_error(err: ProxyError, param: str, *, detail: bool = True) -> ProxyError:
    """An engine error about the format (`sampling.structured_output...`) blamed on the client's field
    `param` that the proxy translated into it, with the engine's explanation only with `detail`; any other
    error unchanged."""
    field = err.param or ""
    if not field.startswith("sampling.structured_output"):
        return err
    if not detail:
        message = f"{param} cannot be used to constrain the output for this model"
    elif field in err.message:
        message = err.message.replace(field, param)
    else:
        message = f"{param}: {err.message}"
    return ProxyError(err.status, message, type=err.type, param=param, code=err.code)


def check_max_tokens(info: pb.GetModelInfoResponse | None, max_tokens: int | None) -> None:
    """400 naming `max_tokens` for a limit past the model's context length: no prompt leaves room for it."""
    if info is not None and info.max_context_length and max_tokens and max_tokens > info.max_context_length:
        raise invalid_request(f"max_tokens ({max_tokens}) exceeds the model's context length "
                              f"({info.max_context_length})", "max_tokens")


def stopping_criteria(req: _SamplingFields, max_tokens: int | None) -> pb.StoppingCriteria:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    criteria = pb.StoppingCriteria(stop=[s for s in stop if s], stop_token_ids=req.stop_token_ids or [],
                                   min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                                   include_stop_str_in_output=req.include_stop_str_in_output)
    if max_tokens is not None:
        criteria.max_tokens = max_tokens
    return criteria


def message_text(msg: ChatMessageParam, index: int) -> str | None:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    parts = []
    for j, part in enumerate(msg.content):
        if part.type not in ("text", "input_text"):
            raise invalid_request(f"content parts of type {part.type!r} are not supported (text only)",
                                  f"messages[{index}].content[{j}].type")
        parts.append(part.text or "")
    return "".join(parts)


def template_renders_tools(chat_template: str) -> bool:
    return "tools" in (chat_template or "")


def chat_input(messages: list[ChatMessageParam], *, tools: list[dict] | None, parser: ToolParser | None,
               native_tools: bool, prefill: str | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, template_kwargs: dict | None = None) -> pb.ChatInput:
    """Build the engine's chat input.

    A template that renders tools gets them as `tools_json` and messages with structured tool calls.
    For one that does not (SmolLM2's), the tools become a system prompt in the parser's format, and
    earlier calls and results become text in that format, whether or not tools are offered this turn
    (`tools` None): the template could not render them otherwise.
    """
    out: list[pb.ChatMessage] = []
    for i, msg in enumerate(messages):
        role = _ROLES.get(msg.role)
        if role is None:
            raise invalid_request(f"unknown role {msg.role!r}", f"messages[{i}].role")
        text = message_text(msg, i)
        m = pb.ChatMessage(role=role, name=msg.name or "")
        calls = msg.tool_calls or []
        if role == "assistant" and calls:
            if native_tools or parser is None:
                for c in calls:
                    m.tool_calls.append(pb.ToolCall(id=c.id, name=c.function.name,
                                                    arguments_json=c.function.arguments))
                if text is not None:
                    m.content = text
            else:
                rendered = parser.render_calls([(c.function.name, c.function.arguments) for c in calls])
                m.content = f"{text}\n{rendered}" if text else rendered
        elif role == "tool":
            m.tool_call_id = msg.tool_call_id or ""
            body = text or ""
            m.content = body if native_tools or parser is None else parser.render_tool_result(body)
        else:
            m.content = text or ""
        out.append(m)
    chat = pb.ChatInput(continue_final_message=continue_final_message)
    if tools and native_tools:
        chat.tools_json = json.dumps(tools, ensure_ascii=False)
    elif tools and parser is not None:
        instructions = parser.system_prompt(tools)
        if out and out[0].role == "system":
            out[0].content = f"{out[0].content}\n\n{instructions}" if out[0].content else instructions
        else:
            out.insert(0, pb.ChatMessage(role="system", content=instructions))
    if prefill is not None:
        out.append(pb.ChatMessage(role="assistant", content=prefill))
        chat.continue_final_message = True
        add_generation_prompt = False
    chat.messages.extend(out)
    chat.add_generation_prompt = add_generation_prompt
    if template_kwargs:
        chat.chat_template_kwargs_json = json.dumps(template_kwargs)
    return chat


def check_wire_safe(message) -> None:
    """Surface text protobuf cannot carry (lone surrogates) as a 400 rather than a crash."""
    try:
        message.SerializeToString()
    except (ValueError, UnicodeError) as err:
        raise invalid_request(f"request text is not valid Unicode: {err}") from None


def _lp_bytes(raw: bytes) -> list[int]:
    return list(raw)


def check_prompt_logprobs(req: _SamplingFields) -> None:
    """vLLM's rule: prompt logprobs come with the whole answer only, not in a stream."""
    if req.stream and req.prompt_logprobs:
        raise invalid_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")


def _clamped(logprob: float) -> float:
    return max(logprob, -9999.0)  # vLLM's clamp: JSON has no -inf


def vllm_prompt_logprobs(items: Iterable[pb.TokenLogprob], top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token (it has no context), then for each later
    one {token_id: {logprob, rank, decoded_token}} of the prompt token and its `top` alternatives."""
    out: list[dict | None] = [None]
    for lp in items:
        entry = {str(lp.token_id): {"logprob": _clamped(lp.logprob), "rank": lp.rank, "decoded_token": lp.token}}
        for rank, t in enumerate(lp.top_logprobs[:top], 1):
            entry.setdefault(str(t.token_id), {"logprob": _clamped(t.logprob), "rank": rank, "decoded_token": t.token})
        out.append(entry)
    return out


def chat_logprobs(items: Iterable[pb.TokenLogprob], top: int) -> list[dict]:
    return [{"token": lp.token, "logprob": lp.logprob, "bytes": _lp_bytes(lp.token_bytes),
             "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": _lp_bytes(t.token_bytes)}
                              for t in lp.top_logprobs[:top]]}
            for lp in items]


def usage_dict(usage: pb.Usage | None) -> dict:
    prompt = usage.prompt_tokens if usage else 0
    completion = usage.completion_tokens if usage else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens if usage else 0}}


def add_usage(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {"prompt_tokens": a["prompt_tokens"] + b["prompt_tokens"],
            "completion_tokens": a["completion_tokens"] + b["completion_tokens"],
            "total_tokens": a["total_tokens"] + b["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": a["prompt_tokens_details"]["cached_tokens"]
                                      + b["prompt_tokens_details"]["cached_tokens"]}}


def finish_reason(reason: int) -> str:
    if reason == pb.FINISH_REASON_ABORT:
        raise ProxyError(503, "the engine aborted the request (it may be shutting down)",
                         type="service_unavailable", code="aborted")
    return FINISH_REASONS.get(reason, "stop")


def system_fingerprint(info: pb.GetModelInfoResponse | None) -> str:
    seed = f"{info.model_name}|{info.model_path}|{info.kv_cache.dtype}" if info else ""
    return "fp_" + hashlib.sha256(seed.encode()).hexdigest()[:10]
