"""POST /v1/completions: one engine request per prompt, `n` completions each, all on one Generate stream.

`echo` with `logprobs` scores the prompt too (OpenAI's legacy behaviour, vLLM's): each choice's logprobs start
with the prompt's tokens, the first without a logprob. With `max_tokens` 0 nothing generated is returned, which
is how evaluation harnesses (lm-evaluation-harness's `local-completions`) ask for a text's log-likelihood."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field

from inference_service.api import pb
from rest_proxy.engine_client import EngineClient, EngineRouter
from rest_proxy.errors import ProxyError, invalid_request
from rest_proxy.events import CompletionEvent, PromptLogprobs, StreamUsage, TextDelta
from rest_proxy.metrics import ProxyMetrics
from rest_proxy.protocol import CompletionRequest
from rest_proxy.sse import ChunkWriter, write_chunks
from rest_proxy.translate import (add_usage, check_max_tokens, check_prompt_logprobs, check_wire_safe,
                                  default_max_tokens, finish_reason, sampling_params, set_request_options,
                                  stopping_criteria, system_fingerprint, usage_dict, vllm_prompt_logprobs)


def prompt_inputs(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _check_queue_room(info: pb.GetModelInfoResponse | None, num_sequences: int) -> None:
    """429 up front for a batch the engine's waiting queue could never take at once (it would refuse the
    excess after the rest started)."""
    limit = info.kv_cache.max_waiting_requests if info is not None else 0
    if limit and num_sequences > limit:
        raise ProxyError(429, f"the request asks for {num_sequences} completions (prompts x n), more than the "
                              f"engine queues at once ({limit}); split it into requests of at most {limit}",
                         type="rate_limit_error", param="prompt", code="too_many_prompts")


def _echoes_logprobs(req: CompletionRequest) -> bool:
    return req.echo and req.logprobs is not None


def _logprobs(items, top: int, offset: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in items:
        out["tokens"].append(lp.token)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({t.token: t.logprob for t in lp.top_logprobs[:top]} if top else None)
        out["text_offset"].append(offset)
        offset += len(lp.token)
    return out


def _merge_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


@dataclass
class CompletionPlan:
    """What one completions request turns into before it reaches the engine."""

    req: CompletionRequest
    client: EngineClient
    starts: list[pb.StartGeneration]  # one a prompt, each for `n` completions
    prompts: list[str | list[int]]  # as the client gave them, parallel to `starts`
    echoes: list[str]  # a prompt's text ahead of its completions' (all "" without `echo`)
    request_id: str = field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


class CompletionService:
    def __init__(self, router: EngineRouter, *, metrics: ProxyMetrics):
        self.router = router
        self.metrics = metrics

    async def plan(self, req: CompletionRequest) -> CompletionPlan:
        if req.suffix:
            raise invalid_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid_request("best_of other than n is not supported", "best_of")
        check_prompt_logprobs(req)
        if req.max_tokens == 0 and not req.echo:
            raise invalid_request("max_tokens 0 needs echo: it asks for the prompt's logprobs and no new tokens",
                                  "max_tokens")
        client = await self.router.resolve(req.model)
        info = client.info
        check_max_tokens(info, req.max_tokens)
        prompts = prompt_inputs(req.prompt)
        _check_queue_room(info, len(prompts) * req.n)
        starts, echoes = [], []
        # OpenAI's default for completions is 16, unless the engine has a default of its own. The engine
        # generates at least one token: an echo-only request's is dropped from the answer.
        max_tokens = req.max_tokens if req.max_tokens is not None else default_max_tokens(info, 16)
        for prompt in prompts:
            start = pb.StartGeneration(
                request_id=uuid.uuid4().hex, n=req.n, skip_special_tokens=req.skip_special_tokens,
                sampling=sampling_params(req, logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0),
                stopping=stopping_criteria(req, 1 if req.max_tokens == 0 else max_tokens))
            if _echoes_logprobs(req):
                start.sampling.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
            set_request_options(start, req)
            if isinstance(prompt, str):
                start.text = prompt
                echoes.append(prompt)
            else:
                start.token_ids.ids.extend(prompt)
                echoes.append(await self._detokenize(client, prompt) if req.echo else "")
            if req.add_special_tokens is not None:
                start.add_special_tokens = req.add_special_tokens
            check_wire_safe(start)
            starts.append(start)
        return CompletionPlan(req, client, starts, prompts, echoes if req.echo else [""] * len(starts))

    async def _detokenize(self, client: EngineClient, ids: list[int], skip_special_tokens: bool = True) -> str:
        resp = await client.tokenize(pb.TokenizeRequest(
            detokenize=pb.DetokenizeIds(ids=ids, skip_special_tokens=skip_special_tokens)))
        return resp.text

    async def _echoed_logprobs(self, plan: CompletionPlan, p: int, entries) -> dict:
        """The completions-layout logprobs of prompt `p`'s tokens from the engine's prompt logprobs `entries`
        (every token but the first, after any truncation), the first token's text asked of the tokenizer."""
        req, prompt = plan.req, plan.prompts[p]
        if isinstance(prompt, str):
            text = pb.TokenizeText(text=prompt)
            if req.add_special_tokens is not None:
                text.add_special_tokens = req.add_special_tokens
            prompt = list((await plan.client.tokenize(pb.TokenizeRequest(tokenize=text))).token_ids)
        head = _logprobs([], req.logprobs, 0)
        if prompt:  # (an engine that takes an empty prompt scores no token of it)
            first_id = prompt[max(len(prompt) - len(entries) - 1, 0)]
            first = await self._detokenize(plan.client, [first_id], skip_special_tokens=False)
            head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
        return _merge_logprobs(head, _logprobs(entries, req.logprobs, len("".join(head["tokens"]))))

    async def _with_echoed_logprobs(self, plan: CompletionPlan, merged) -> AsyncIterator[tuple]:
        """The engine's (prompt, message) pairs, each with its prompt's scored tokens when `echo` asks for
        logprobs (else None). Those come on completion 0's first message: the other completions' wait for it."""
        if not _echoes_logprobs(plan.req):
            async for p, resp in merged:
                yield p, resp, None
            return
        echoed: dict[int, dict] = {}
        held: dict[int, list[pb.GenerateResponse]] = {}
        async for p, resp in merged:
            if p not in echoed:
                if resp.index != 0:
                    held.setdefault(p, []).append(resp)
                    continue
                echoed[p] = await self._echoed_logprobs(plan, p, resp.prompt_logprobs)
                for r in held.pop(p, []):
                    yield p, r, echoed[p]
            yield p, resp, echoed[p]
        for p, responses in held.items():  # completion 0 never answered (the request ended first)
            for r in responses:
                yield p, r, None

    async def _events(self, plan: CompletionPlan) -> AsyncIterator[CompletionEvent]:
        usage = None
        offsets: dict[int, int] = {}  # completion -> text offset of its next token
        async with (aclosing(plan.client.generate_many(plan.starts)) as merged,
                    aclosing(self._with_echoed_logprobs(plan, merged)) as messages):
            async for p, resp, echoed_lps in messages:
                for event in self._response_events(plan, p, resp, offsets, echoed_lps):
                    yield event
                if resp.HasField("usage"):
                    usage = add_usage(usage, usage_dict(resp.usage))
        usage = usage or usage_dict(None)
        if plan.req.max_tokens == 0:  # the token the engine had to generate was not returned
            usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
        yield StreamUsage(usage)

    def _response_events(self, plan: CompletionPlan, p: int, resp: pb.GenerateResponse, offsets: dict[int, int],
                         echoed_lps: dict | None) -> Iterator[CompletionEvent]:
        req = plan.req
        index = p * req.n + resp.index
        if resp.prompt_logprobs and req.prompt_logprobs is not None:  # completion 0's first message
            yield PromptLogprobs(p, vllm_prompt_logprobs(resp.prompt_logprobs, req.prompt_logprobs))
        is_first = index not in offsets
        if is_first:
            offsets[index] = len(plan.echoes[p])
        is_echo_only = req.max_tokens == 0
        text = "" if is_echo_only else resp.text
        if is_first:
            text = plan.echoes[p] + text
        lps = None
        if req.logprobs is not None:
            lps = _logprobs([] if is_echo_only else resp.logprobs, req.logprobs, offsets[index])
            offsets[index] += sum(len(t) for t in lps["tokens"])
            if is_first and echoed_lps is not None:
                lps = _merge_logprobs(echoed_lps, lps)
        reason = None
        if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            reason = finish_reason(resp.finish_reason)
            reason = "length" if is_echo_only else reason
        if text or lps is not None or reason:
            yield TextDelta(index, text, lps, reason)

    async def complete(self, plan: CompletionPlan) -> dict:
        n = len(plan.starts) * plan.req.n
        texts: list[list[str]] = [[] for _ in range(n)]
        lps: list[dict | None] = [None] * n
        reasons: list[str] = ["stop"] * n
        # vLLM's: every choice of a prompt carries its prompt logprobs.
        prompt_lps: dict[int, list[dict | None]] = {}
        usage = None
        async with aclosing(self._events(plan)) as events:
            async for event in events:
                match event:
                    case PromptLogprobs(index=p, entries=entries):
                        prompt_lps[p] = entries
                    case TextDelta(index=i):
                        texts[i].append(event.text)
                        if event.logprobs is not None:
                            lps[i] = _merge_logprobs(lps[i], event.logprobs)
                        if event.finish_reason:
                            reasons[i] = event.finish_reason
                    case StreamUsage():
                        usage = event.usage
        choices = [{"index": i, "text": "".join(texts[i]), "logprobs": lps[i], "finish_reason": reasons[i]}
                   for i in range(n)]
        if plan.req.prompt_logprobs is not None:
            for i, choice in enumerate(choices):
                choice["prompt_logprobs"] = prompt_lps.get(i // plan.req.n)
        return {"id": plan.request_id, "object": "text_completion", "created": plan.created,
                "model": plan.req.model, "system_fingerprint": system_fingerprint(plan.client.info),
                "choices": choices, "usage": usage}

    def stream(self, plan: CompletionPlan) -> AsyncIterator[str]:
        """SSE `data:` chunks; the first is yielded only once the engine has answered."""
        req = plan.req
        writer = ChunkWriter(id=plan.request_id, object="text_completion", created=plan.created, model=req.model,
                             system_fingerprint=system_fingerprint(plan.client.info),
                             include_usage=bool(req.stream_options and req.stream_options.include_usage))
        return write_chunks(writer, self._events(plan), _text_chunks)


def _text_chunks(event: TextDelta | PromptLogprobs) -> list[list[dict]]:
    if isinstance(event, PromptLogprobs):
        return []  # a stream asks for none but 0 (see `check_prompt_logprobs`)
    return [[{"index": event.index, "text": event.text, "logprobs": event.logprobs,
              "finish_reason": event.finish_reason}]]
