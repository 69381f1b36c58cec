"""Request models of the OpenAI Responses API (`POST /v1/responses`) as the proxy serves it.

The top level is typed here; `input` items, `tools` and `tool_choice` are read one by one in
`responses_translate.py`, so that an error names the exact place (`input[2].type`, `tools[0].parameters`).
Unknown fields are ignored, as elsewhere in the proxy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from rest_proxy.protocol import UINT32_MAX, _Model


class TextFormat(_Model):
    """`text.format`: free text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class ResponsesRequest(_Model):
    model: str
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None


# -- input items (what `input` may hold) ---------------------------------------------------------------
class ContentPartItem(_Model):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPartItem]


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str = "{}"


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[ContentPartItem]


class FunctionToolItem(_Model):
    """A function tool as the Responses API writes it (flat, where chat nests it under `function`)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Model):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
