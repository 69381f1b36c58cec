"""Request models of the OpenAI API subset the proxy serves.

Unknown fields are ignored (as OpenAI's own server does); numeric limits are the proto's, so a value
that cannot be represented on the wire is a 400 here rather than a failure further down.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
# What the engine hands the chat template itself (`inference.v1.ChatInput.chat_template_kwargs_json`).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "special_tokens"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False


class FunctionDefinition(_Model):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallParam(_Model):
    name: str
    arguments: str = "{}"


class ToolCallParam(_Model):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessageParam(_Model):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Model):
    """vLLM's `structured_outputs` (one of its fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Model):
    """Sampling and stopping fields shared by chat and completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=UINT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs or guided_* fields (one at most).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vLLM's extra sampling fields (through the SDK's `extra_body`).
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    # Strict: "3" or 3.5 is a 400, not silently an int. Honoured under the engine's --scheduling-policy priority.
    priority: Annotated[int, Field(strict=True, ge=INT32_MIN, le=INT32_MAX)] = 0
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves a thinking model's reasoning out of the answer
    echo: bool = False  # vLLM's: the answer starts with the last message's content when that is the assistant's

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
        if reserved:
            raise ValueError(f"may not set {', '.join(map(repr, reserved))}: the request's own fields "
                             f"(messages, tools, add_generation_prompt, ...) set what the template gets")
        return kwargs


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | list[
        list[Annotated[int, Field(ge=0, le=UINT32_MAX)]]]
    # 0 with `echo`: the prompt's logprobs only (see `rest_proxy.completions`).
    max_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    add_special_tokens: bool | None = None


class EmbeddingRequest(_Model):
    model: str
    input: str | list[str] | list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | list[
        list[Annotated[int, Field(ge=0, le=UINT32_MAX)]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    user: str | None = None
    truncate: bool = False


class ScoreRequest(_Model):
    """vLLM's /score: `text_1` against each of `text_2` (one text_1), or pair by pair (as many of each)."""

    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    truncate: bool = False  # as in /v1/embeddings: cut inputs to the model's limit instead of a 400


class RerankRequest(_Model):
    """The rerank API of vLLM, Jina and Cohere: `documents` ordered by relevance to `query`."""

    model: str
    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=0)] = 0  # 0: all of them
    return_documents: bool = True
    truncate: bool = False


class TokenizeRequest(_Model):
    model: str
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None


class DetokenizeRequest(_Model):
    model: str
    tokens: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]]
    skip_special_tokens: bool | None = None
