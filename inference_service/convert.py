"""Conversion between protobuf messages and engine types, and nothing else."""

from __future__ import annotations

import json
from typing import Any

from inference_service.api import pb
from inference_service.engine.embedding_engine import EmbeddingResult, EmbedOptions
from inference_service.engine.generation_config import GenerationDefaults
from inference_service.engine.input_processor import ChatPrompt
from inference_service.engine.request import CompletionDelta, TokenLogprob
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.sequence import FinishReason
from inference_service.engine.structured_output import StructuredOutputSpec
from inference_service.errors import EngineError, InvalidRequestError
from inference_service.model.tokenizer import Tokenizer

_FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def _optional(msg: Any, name: str, default: Any) -> Any:
    return getattr(msg, name) if msg.HasField(name) else default


def sampling_params_from_proto(start: pb.StartGeneration,
                               defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
    """A field the request leaves unset takes the server's default from `defaults`, else the API's."""
    s, st = start.sampling, start.stopping
    d = defaults
    return SamplingParams(
        temperature=_optional(s, "temperature", d.get("temperature", 1.0)),
        top_p=_optional(s, "top_p", d.get("top_p", 1.0)),
        top_k=_optional(s, "top_k", d.get("top_k", 0)),
        min_p=_optional(s, "min_p", d.get("min_p", 0.0)),
        repetition_penalty=_optional(s, "repetition_penalty", d.get("repetition_penalty", 1.0)),
        frequency_penalty=_optional(s, "frequency_penalty", d.get("frequency_penalty", 0.0)),
        presence_penalty=_optional(s, "presence_penalty", d.get("presence_penalty", 0.0)),
        logit_bias=dict(s.logit_bias),
        seed=_optional(s, "seed", None),
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        structured_output=_structured_output(s),
        allowed_token_ids=list(s.allowed_token_ids),
        bad_words=list(s.bad_words),
        prompt_logprobs=_optional(s, "prompt_logprobs", None),
        max_tokens=_optional(st, "max_tokens", None),
        default_max_tokens=d.max_tokens,
        min_tokens=st.min_tokens,
        stop=list(st.stop),
        stop_token_ids=list(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        include_stop_str_in_output=st.include_stop_str_in_output,
        n=start.n or 1,
        skip_special_tokens=_optional(start, "skip_special_tokens", True),
        truncate_prompt_tokens=_optional(start, "truncate_prompt_tokens", None),
    )


def generation_defaults_to_proto(defaults: GenerationDefaults) -> pb.GenerationDefaults:
    return pb.GenerationDefaults(**defaults.as_dict())


def _structured_output(s: pb.SamplingParams) -> StructuredOutputSpec | None:
    kind = s.structured_output.WhichOneof("format") if s.HasField("structured_output") else None
    if kind is None:
        return None
    if kind == "json_object":
        if not s.structured_output.json_object:
            raise InvalidRequestError("sampling.structured_output.json_object must be true when set",
                                      field="sampling.structured_output.json_object")
        return StructuredOutputSpec("json_object")
    return StructuredOutputSpec(kind, getattr(s.structured_output, kind))


def _tool_call_to_dict(call: pb.ToolCall, field_path: str) -> dict[str, Any]:
    arguments: Any = call.arguments_json or "{}"
    try:
        # Templates index into the arguments (`arguments.items()`), so give them the object.
        arguments = json.loads(arguments)
    except json.JSONDecodeError:
        raise InvalidRequestError(
            f"{field_path}.arguments_json is not valid JSON: {call.arguments_json!r}", field=f"{field_path}.arguments_json"
        ) from None
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def chat_from_proto(chat: pb.ChatInput) -> ChatPrompt:
    messages = []
    for i, m in enumerate(chat.messages):
        path = f"chat.messages[{i}]"
        if m.role not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidRequestError(
                f"{path}.role must be one of system, user, assistant, tool, developer; got {m.role!r}",
                field=f"{path}.role",
            )
        message: dict[str, Any] = {"role": m.role, "content": m.content if m.HasField("content") else None}
        if message["content"] is None and not m.tool_calls:
            raise InvalidRequestError(f"{path}.content is required for a {m.role} message", field=f"{path}.content")
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [_tool_call_to_dict(c, f"{path}.tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return ChatPrompt(
        messages=messages,
        tools_json=chat.tools_json,
        add_generation_prompt=_optional(chat, "add_generation_prompt", True),
        continue_final_message=chat.continue_final_message,
        template_kwargs_json=chat.chat_template_kwargs_json,
    )


def prompt_from_proto(start: pb.StartGeneration) -> str | list[int] | ChatPrompt:
    kind = start.WhichOneof("input")
    if kind == "text":
        return start.text
    if kind == "token_ids":
        return list(start.token_ids.ids)
    if kind == "chat":
        return chat_from_proto(start.chat)
    raise InvalidRequestError("the request has no input: set text, token_ids or chat", field="input")


def error_to_proto(exc: EngineError) -> pb.Error:
    return pb.Error(code=exc.code.value[0], message=exc.message, field=exc.field or "")


def error_response(request_id: str, exc: EngineError) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id, finish_reason=pb.FINISH_REASON_ERROR, error=error_to_proto(exc))


def delta_to_proto(request_id: str, delta: CompletionDelta, tokenizer: Tokenizer) -> pb.GenerateResponse:
    """`request_id` is the client's id (the engine's own id is unique across streams)."""
    response = pb.GenerateResponse(
        request_id=request_id,
        index=delta.index,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=_FINISH_REASONS[delta.finish_reason],
    )
    if delta.stop_reason is not None:
        response.stop_reason = str(delta.stop_reason)
    for lp in delta.logprobs or ():
        _add_logprob(response.logprobs, lp, tokenizer)
    for lp in delta.prompt_logprobs or ():
        _add_logprob(response.prompt_logprobs, lp, tokenizer)
    if delta.usage is not None:
        u = delta.usage
        response.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                         cached_tokens=u.cached_tokens))
    if delta.error is not None:
        response.error.CopyFrom(error_to_proto(delta.error))
    return response


def _token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    try:
        raw = tokenizer.token_bytes(token_id)
    except ValueError:  # a padding row of the model's vocabulary (alternatives may be any row): no token
        return "", b""
    return tokenizer.decode([token_id], skip_special_tokens=False), raw


def _add_logprob(entries: Any, lp: TokenLogprob, tokenizer: Tokenizer) -> None:
    token, raw = _token_text(tokenizer, lp.token_id)
    entry = entries.add(token_id=lp.token_id, token=token, token_bytes=raw, logprob=lp.logprob)
    if lp.rank is not None:
        entry.rank = lp.rank
    for token_id, logprob in lp.top_logprobs:
        token, raw = _token_text(tokenizer, token_id)
        entry.top_logprobs.add(token_id=token_id, token=token, token_bytes=raw, logprob=logprob)


def embed_inputs_from_proto(msg: pb.EmbedRequest) -> list[str | list[int]]:
    inputs: list[str | list[int]] = []
    for i, item in enumerate(msg.inputs):
        kind = item.WhichOneof("input")
        if kind is None:
            raise InvalidRequestError(f"inputs[{i}] sets neither text nor token_ids", field=f"inputs[{i}]")
        inputs.append(item.text if kind == "text" else list(item.token_ids.ids))
    return inputs


def embed_options_from_proto(msg: pb.EmbedRequest) -> EmbedOptions:
    return EmbedOptions(truncate=msg.truncate, normalize=_optional(msg, "normalize", None),
                        dimensions=msg.dimensions)


def embedding_result_to_proto(request_id: str, result: EmbeddingResult) -> pb.EmbedResponse:
    response = pb.EmbedResponse(request_id=request_id, prompt_tokens=result.prompt_tokens)
    for values, num_tokens in zip(result.embeddings.tolist(), result.num_tokens, strict=True):
        response.embeddings.add(values=values, num_tokens=num_tokens)
    return response
