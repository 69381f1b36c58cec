"""POST /v1/chat/completions: plan the request, run it on the engine, and shape the answer.

Both modes consume the same typed event stream (`events`): non-streaming adds the deltas up, streaming
sends them as chunks. With MCP execution on, the proxy runs the model's MCP calls between rounds.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from inference_service.api import pb
from rest_proxy.chat_state import ChoiceState
from rest_proxy.engine_client import EngineClient, EngineRouter
from rest_proxy.errors import ProxyError, invalid_request
from rest_proxy.events import ChatDelta, ChatEvent, ChatFinish, McpCall, PromptLogprobs, StreamUsage
from rest_proxy.metrics import ProxyMetrics
from rest_proxy.protocol import ChatCompletionRequest, ChatMessageParam, FunctionCallParam, ToolCallParam
from rest_proxy.reasoning import (PromptState, ReasoningFormat, ReasoningParser, answer_after_thinking, get_format,
                                  prompt_state, select_format, text_state)
from rest_proxy.schemas import check_json_schema, strict_schema
from rest_proxy.sse import ChunkWriter, write_chunks
from rest_proxy.tool_parsers import ToolParser, parser_for_model
from rest_proxy.translate import (add_usage, chat_input, chat_logprobs, check_max_tokens, check_prompt_logprobs,
                                  check_wire_safe, finish_reason, format_field, map_format_error, message_text,
                                  sampling_params, set_request_options, stopping_criteria, system_fingerprint,
                                  template_renders_tools, usage_dict, vllm_prompt_logprobs)

log = logging.getLogger(__name__)


@dataclass
class ChatPlan:
    """What one chat request turns into before it reaches the engine."""

    req: ChatCompletionRequest
    client: EngineClient
    messages: list[ChatMessageParam]
    tools: list[dict] | None  # the tools offered this turn (None: none, or tool_choice "none")
    parser: ToolParser  # the model's tool format: past calls are written in it whether or not tools are offered
    native_tools: bool
    # Each offered tool's arguments schema as calls are constrained to it (a strict tool's as strict mode reads it).
    schemas: dict[str, dict | None] = field(default_factory=dict)
    strict: frozenset[str] = frozenset()  # the offered tools with `strict: true`
    format_param: str | None = None  # the client field behind the engine's format constraint
    forced: str | None = None  # the function a forced call must name ("" means any)
    prefill: str | None = None
    execute_mcp: bool = False
    top_logprobs: int = 0
    reasoning: ReasoningFormat | None = None  # the model's thinking format (None: it does not think)
    reasoning_prompt: PromptState = PromptState.UNKNOWN  # where the generation prompt leaves the thinking
    request_id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


class ChatService:
    def __init__(self, router: EngineRouter, *, metrics: ProxyMetrics, mcp=None, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, mcp_execute: bool = True, max_mcp_rounds: int = 5):
        self.router = router
        self.metrics = metrics
        self.mcp = mcp
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.mcp_execute = mcp_execute
        self.max_mcp_rounds = max(1, max_mcp_rounds)

    def parser_for(self, client: EngineClient) -> ToolParser:
        info = client.info
        return parser_for_model(self.tool_parser, info.family if info else "", info.chat_template if info else "")

    def reasoning_for(self, client: EngineClient) -> ReasoningFormat | None:
        """The model's reasoning format: `--reasoning-parser`, else the one its chat template implies."""
        if self.reasoning_parser is not None:
            return get_format(self.reasoning_parser)
        return select_format(client.info.chat_template if client.info else "")

    async def plan(self, req: ChatCompletionRequest) -> ChatPlan:
        check_prompt_logprobs(req)
        if req.top_logprobs and not req.logprobs:  # OpenAI's and vLLM's rule, rather than none silently
            raise invalid_request("top_logprobs needs logprobs set to true", "top_logprobs")
        client = await self.router.resolve(req.model)
        info = client.info
        check_max_tokens(info, req.max_completion_tokens or req.max_tokens)
        injected = False
        if req.tools is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        else:
            tools = self.mcp.tools() if self.mcp is not None else []
            injected = bool(tools)
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        forced = None
        if not isinstance(choice, str):
            forced = choice.function.name
            if forced not in {t["function"]["name"] for t in tools}:
                raise invalid_request(f"tool_choice names {forced!r}, which is not among the tools",
                                      "tool_choice")
        elif choice == "required":
            if not tools:
                raise invalid_request("tool_choice 'required' needs at least one tool", "tool_choice")
            forced = ""
        active = bool(tools) and choice != "none"
        schemas, strict = _tool_schemas(req, forced)
        plan = ChatPlan(req=req, client=client, messages=list(req.messages), tools=tools if active else None,
                        parser=self.parser_for(client),
                        native_tools=template_renders_tools(info.chat_template if info else ""),
                        schemas=schemas, strict=frozenset(strict), forced=forced, top_logprobs=req.top_logprobs or 0,
                        execute_mcp=injected and active and self.mcp_execute and req.n == 1,
                        format_param=format_field(req))
        if forced is not None and active and not req.continue_final_message:
            plan.prefill = plan.parser.call_prefix(forced or None)
        plan.parser.set_tools(tools if active else [])
        plan.reasoning = self.reasoning_for(client)
        if plan.reasoning is not None and info is not None:
            plan.reasoning_prompt = prompt_state(
                info.chat_template, req.chat_template_kwargs,
                {"bos_token": info.special_tokens.bos_token, "eos_token": info.special_tokens.eos_token})
        return plan

    @staticmethod
    def _reasoning_parser(plan: ChatPlan, first_round: bool) -> ReasoningParser | None:
        """The thinking parser of a round's output, or None where it holds no thinking: a forced call's
        prefill puts the output past it; a continued final message says itself where it stands."""
        if plan.reasoning is None:
            return None
        if first_round and plan.prefill is not None:
            return None
        if first_round and plan.req.continue_final_message:
            return plan.reasoning.parser(text_state(message_text(plan.messages[-1], len(plan.messages) - 1) or ""))
        return plan.reasoning.parser(plan.reasoning_prompt)

    def _start(self, plan: ChatPlan, messages: list[ChatMessageParam], offer_tools: bool,
               first_round: bool) -> pb.StartGeneration:
        req = plan.req
        tools = plan.tools if offer_tools else None
        chat = chat_input(messages, tools=tools, parser=plan.parser,
                          native_tools=plan.native_tools, prefill=plan.prefill if first_round else None,
                          add_generation_prompt=req.add_generation_prompt,
                          continue_final_message=req.continue_final_message and first_round,
                          template_kwargs=req.chat_template_kwargs)
        start = pb.StartGeneration(
            request_id=uuid.uuid4().hex, chat=chat, n=req.n, skip_special_tokens=req.skip_special_tokens,
            sampling=sampling_params(req, logprobs=req.logprobs, top_logprobs=plan.top_logprobs),
            stopping=stopping_criteria(req, req.max_completion_tokens or req.max_tokens))
        set_request_options(start, req)
        if first_round and plan.prefill is not None and plan.forced is not None:
            self._constrain_forced_call(plan, start)
        elif tools and plan.strict & {t["function"]["name"] for t in tools}:
            self._constrain_strict_calls(plan, start)
        check_wire_safe(start)
        return start

    @staticmethod
    def _constrain_forced_call(plan: ChatPlan, start: pb.StartGeneration) -> None:
        """tool_choice naming a function, or "required": the text after the call's prefill must be calls (to
        that function, or to any of the tools) with arguments matching the tool's parameter schema, and the end
        of the markup, so even a small model's calls parse."""
        named = bool(plan.forced)
        tools = [(t["function"]["name"], plan.schemas.get(t["function"]["name"], t["function"].get("parameters")))
                 for t in plan.tools if not named or t["function"]["name"] == plan.forced]
        grammar = plan.parser.calls_grammar(tools, named=named, parallel=plan.req.parallel_tool_calls)
        if grammar is None:
            return
        if start.sampling.HasField("structured_output"):
            raise invalid_request("a tool_choice of 'required' or naming a function constrains the output "
                                  "itself: it cannot be combined with response_format, structured_outputs or "
                                  "guided_*", "tool_choice")
        start.sampling.structured_output.lark_grammar = grammar
        plan.format_param = _tool_param(plan, plan.forced)

    @staticmethod
    def _constrain_strict_calls(plan: ChatPlan, start: pb.StartGeneration) -> None:
        """tool_choice "auto" with `strict` tools: the model may answer in text, but a call it opens names one of
        the tools, a strict one's arguments match its schema and any other's are a JSON object. A request format
        (response_format, guided_*) constrains the text instead, and the calls are then left free."""
        if start.sampling.HasField("structured_output"):
            return
        names = [t["function"]["name"] for t in plan.tools]
        tools = [(name, (plan.schemas.get(name) if name in plan.strict else None) or {"type": "object"})
                 for name in names]
        grammar = plan.parser.text_or_calls_grammar(tools, parallel=plan.req.parallel_tool_calls)
        if grammar is not None:
            start.sampling.structured_output.lark_grammar = grammar
            plan.format_param = _tool_param(plan, None)

    async def events(self, plan: ChatPlan) -> AsyncIterator[ChatEvent]:
        """The planned request's events, `StreamUsage` last; with MCP execution, across its rounds (only the
        last round's finish, no deltas of MCP tool calls, and an `McpCall` for each call the proxy ran)."""
        messages = plan.messages
        usage = None
        rounds = self.max_mcp_rounds if plan.execute_mcp else 1
        for round_no in range(rounds):
            last = round_no == rounds - 1
            offer_tools = plan.tools is not None and not (plan.execute_mcp and last)
            parser = plan.parser if offer_tools else None
            first = round_no == 0
            start = self._start(plan, messages, offer_tools, first)
            reasoning = self._reasoning_parser(plan, first)
            if reasoning is not None and start.sampling.HasField("structured_output") \
                    and not answer_after_thinking(start.sampling.structured_output, reasoning):
                reasoning = None  # a grammar of the client's that holds from the first token: no thinking
            states = [ChoiceState(parser, prefix=(plan.prefill or "") if first else "",
                                  parallel=plan.req.parallel_tool_calls,
                                  forced=plan.forced if first and parser else None,
                                  reasoning=reasoning.fresh() if reasoning is not None else None,
                                  include_reasoning=plan.req.include_reasoning,
                                  has_reasoning_field=plan.reasoning is not None)
                      for _ in range(plan.req.n)]
            echo = _echo_text(plan) if first else None
            echoed: set[int] = set()
            async with aclosing(self._generate(plan, start)) as responses:
                async for resp in responses:
                    if resp.index >= len(states):
                        continue
                    if resp.prompt_logprobs and first:  # completion 0's first message
                        entries = vllm_prompt_logprobs(resp.prompt_logprobs, plan.req.prompt_logprobs or 0)
                        yield PromptLogprobs(0, entries)
                    if echo and resp.index not in echoed:  # once the engine has answered, not before
                        echoed.add(resp.index)
                        yield ChatDelta(resp.index, [{"content": echo}], None)
                    state = states[resp.index]
                    deltas = state.feed(resp.text)
                    lps = chat_logprobs(resp.logprobs, plan.top_logprobs) if plan.req.logprobs else None
                    if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        deltas += state.feed("", final=True)
                    if plan.execute_mcp:
                        deltas = [d for d in deltas if "tool_calls" not in d]
                    if deltas or lps:
                        if lps:
                            state.logprobs += lps
                        yield ChatDelta(resp.index, deltas, lps)
                    if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        reason = state.finish(finish_reason(resp.finish_reason))
                        if not plan.execute_mcp:
                            yield ChatFinish(resp.index, reason)
                    if resp.HasField("usage"):
                        usage = add_usage(usage, usage_dict(resp.usage))
            state = states[0]
            if plan.execute_mcp and state.finish_reason == "tool_calls" and not last:
                calls, results = await self._run_mcp_calls(state)
                for call in calls:
                    yield call
                messages = messages + results
                continue
            if plan.execute_mcp:
                if state.finish_reason == "tool_calls":
                    state.finish_reason = "stop"
                yield ChatFinish(0, state.finish_reason or "stop")
            break
        yield StreamUsage(usage or usage_dict(None))

    @staticmethod
    async def _generate(plan: ChatPlan, start: pb.StartGeneration) -> AsyncIterator[pb.GenerateResponse]:
        """The engine's responses; its errors about the format name the client field the proxy translated."""
        try:
            async with aclosing(plan.client.generate(start)) as responses:
                async for resp in responses:
                    yield resp
        except ProxyError as err:
            if plan.format_param is None:
                raise
            # NOTE: a tool constraint is the proxy's own grammar: the engine's message would quote it.
            raise map_format_error(err, plan.format_param,
                                   detail=not plan.format_param.startswith("tools")) from None

    async def _run_mcp_calls(self, state: ChoiceState) -> tuple[list[McpCall], list[ChatMessageParam]]:
        """Runs the round's calls: their events, and the assistant turn and tool results the next round reads."""
        calls = state.calls
        assistant = ChatMessageParam(role="assistant", content=state.text or None, tool_calls=[
            ToolCallParam(id=c["id"], function=FunctionCallParam(name=c["function"]["name"],
                                                                 arguments=c["function"]["arguments"] or "{}"))
            for c in calls])
        events, results = [], []
        for c in calls:
            result = await self.mcp.call_tool(c["function"]["name"], c["function"]["arguments"])
            events.append(McpCall(result.server, result.tool, c["function"]["arguments"] or "{}", result.text,
                                  result.is_error))
            results.append(ChatMessageParam(role="tool", tool_call_id=c["id"], content=result.text))
        return events, [assistant, *results]

    async def complete(self, plan: ChatPlan) -> dict:
        states = {i: ChoiceState(None, has_reasoning_field=plan.reasoning is not None) for i in range(plan.req.n)}
        reasons: dict[int, str] = {}
        usage = prompt_lps = None
        # NOTE: re-assemble from the deltas so the answer is by construction the stream's sum.
        async with aclosing(self.events(plan)) as events:
            async for event in events:
                match event:
                    case PromptLogprobs(entries=entries):
                        prompt_lps = entries
                    case ChatDelta():
                        states[event.index].add_deltas(event.deltas, event.logprobs)
                    case ChatFinish():
                        reasons[event.index] = event.reason
                    case StreamUsage():
                        usage = event.usage
        choices = []
        for i in range(plan.req.n):
            st = states[i]
            choices.append({"index": i, "message": st.message(), "finish_reason": reasons.get(i, "stop"),
                            "logprobs": {"content": st.logprobs, "refusal": None} if plan.req.logprobs else None})
        answer = {"id": plan.request_id, "object": "chat.completion", "created": plan.created,
                  "model": plan.req.model, "system_fingerprint": system_fingerprint(plan.client.info),
                  "choices": choices, "usage": usage}
        if plan.req.prompt_logprobs is not None:
            answer["prompt_logprobs"] = prompt_lps  # vLLM's place: the response, not a choice
        return answer

    def stream(self, plan: ChatPlan) -> AsyncIterator[str]:
        """SSE `data:` chunks; the first is yielded only once the engine has answered."""
        writer = ChunkWriter(id=plan.request_id, object="chat.completion.chunk", created=plan.created,
                             model=plan.req.model, system_fingerprint=system_fingerprint(plan.client.info),
                             include_usage=bool(plan.req.stream_options and plan.req.stream_options.include_usage))
        first_token = self.metrics.first_token_latency.labels(endpoint="chat")
        return write_chunks(writer, self.events(plan), _ChatChunks(first_token))


class _ChatChunks:
    """Each chat event's chunks: a choice's first event comes after a chunk of its role; a delta with several
    message deltas is a chunk each (its logprobs on the first); the first text observes `first_token`."""

    def __init__(self, first_token):
        self.first_token = first_token
        self.t0 = time.perf_counter()
        self.started: set[int] = set()
        self.is_first_text = True

    def __call__(self, event: ChatDelta | ChatFinish | PromptLogprobs | McpCall) -> list[list[dict]]:
        if isinstance(event, PromptLogprobs | McpCall):
            # A stream asks for no prompt logprobs but 0 (see `check_prompt_logprobs`); the chat API has no
            # place for the calls the proxy ran.
            return []
        chunks = []
        if event.index not in self.started:
            self.started.add(event.index)
            chunks.append([_choice(event.index, {"role": "assistant", "content": ""})])
        match event:
            case ChatDelta(index=index, deltas=deltas, logprobs=lps):
                if self.is_first_text and deltas:
                    self.is_first_text = False
                    self.first_token.observe(time.perf_counter() - self.t0)
                if not deltas:
                    chunks.append([_choice(index, {}, lps)])
                chunks += [[_choice(index, delta, lps if j == 0 else None)] for j, delta in enumerate(deltas)]
            case ChatFinish():
                chunks.append([_choice(event.index, {}, None, event.reason)])
        return chunks


def _choice(index: int, delta: dict, lps: list[dict] | None = None, reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": {"content": lps, "refusal": None} if lps is not None else None,
            "finish_reason": reason}


def _echo_text(plan: ChatPlan) -> str | None:
    """vLLM's chat `echo`: the last message's content, when that message is the assistant's (the one the
    answer continues, as with `continue_final_message`); None otherwise."""
    if not plan.req.echo or not plan.messages or plan.messages[-1].role != "assistant":
        return None
    return message_text(plan.messages[-1], len(plan.messages) - 1) or None


def _tool_schemas(req: ChatCompletionRequest, forced: str | None) -> tuple[dict[str, dict | None], set[str]]:
    """Check every tool's parameter schema (400 naming `tools[i].function.parameters`), whatever the
    tool_choice: a valid JSON schema, and one llguidance compiles where calls will be constrained to it (forced,
    or `strict`). Returns each tool's schema as calls are held to it, and the names of the strict tools."""
    schemas: dict[str, dict | None] = {}
    strict: set[str] = set()
    for i, tool in enumerate(req.tools or []):
        fn, param = tool.function, f"tools[{i}].function.parameters"
        schema = fn.parameters
        if fn.strict:
            schema = strict_schema(schema, param)
            strict.add(fn.name)
        constrained = bool(fn.strict) or forced == "" or forced == fn.name
        if schema is not None or constrained:
            check_json_schema(schema if schema is not None else {"type": "object"}, param, constrained=constrained)
        schemas[fn.name] = schema
    return schemas, strict


def _tool_param(plan: ChatPlan, name: str | None) -> str:
    """The client field to blame for a tool-call constraint: the one tool's parameters, or all the tools."""
    names = [t.function.name for t in plan.req.tools or []]
    if name and name in names:
        return f"tools[{names.index(name)}].function.parameters"
    return "tools"
