// The chat UI: streams /v1/chat/completions, shows thinking (reasoning_content) collapsed, renders the answer
// as Markdown, and runs MCP tool calls through the proxy (/ui/mcp/*) so their calls and results are shown.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const els = {
    model: $("model"), apiKey: $("api-key"), system: $("system"), temperature: $("temperature"),
    maxTokens: $("max-tokens"), useMcp: $("use-mcp"), mcpCount: $("mcp-count"), status: $("status"),
    messages: $("messages"), input: $("input"), send: $("send"), stop: $("stop"), composer: $("composer"),
    newChat: $("new-chat"),
  };
  const MAX_TOOL_ROUNDS = 5;
  let history = [];       // the conversation as OpenAI chat messages (no system message)
  let mcpTools = [];      // the proxy's MCP tools, offered to the model when "MCP tools" is ticked
  let controller = null;  // aborts the request in flight (Stop)

  for (const [key, el] of [["apiKey", els.apiKey], ["system", els.system], ["temperature", els.temperature],
                           ["maxTokens", els.maxTokens]]) {
    const saved = localStorage.getItem("ui." + key);
    if (saved !== null) el.value = saved;
    el.addEventListener("change", () => localStorage.setItem("ui." + key, el.value));
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (els.apiKey.value.trim()) h.Authorization = "Bearer " + els.apiKey.value.trim();
    return h;
  }

  async function errorText(resp) {
    try { const body = await resp.json(); return body.error ? body.error.message : JSON.stringify(body); }
    catch (e) { return resp.status + " " + resp.statusText; }
  }

  function setStatus(text) { els.status.textContent = text || ""; }

  async function loadModels() {
    const chosen = els.model.value || localStorage.getItem("ui.model");
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) {
      setStatus(resp.status === 401 ? "This proxy needs its API key: enter it on the left." : await errorText(resp));
      return;
    }
    const models = (await resp.json()).data.map((m) => m.id);
    els.model.replaceChildren(...models.map((id) => new Option(id, id, false, id === chosen)));
    setStatus("");
    const tools = await fetch("/ui/mcp/tools", { headers: headers() });
    mcpTools = tools.ok ? (await tools.json()).tools : [];
    els.mcpCount.textContent = mcpTools.length ? `(${mcpTools.length})` : "(none)";
  }

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    div.innerHTML = `<div class="role">${role}</div>`;
    if (text !== undefined) div.append(text);
    els.messages.append(div);
    div.scrollIntoView({ block: "end" });
    return div;
  }

  // One assistant turn on screen: thinking (collapsed), tool calls with their results, the answer.
  function assistantView() {
    const div = addMessage("assistant");
    const thinking = document.createElement("details");
    thinking.className = "thinking";
    thinking.hidden = true;
    thinking.innerHTML = "<summary>Thinking</summary><div class=\"body\"></div>";
    const tools = document.createElement("div");
    tools.className = "tools";
    const content = document.createElement("div");
    content.className = "content";
    div.append(thinking, tools, content);
    return { div, thinking, tools, content, text: "", reasoning: "" };
  }

  function toolView(view, call) {
    const d = document.createElement("details");
    d.className = "tool";
    d.innerHTML = `<summary>Tool call: <code></code></summary><pre class="args"></pre><div class="result">running…</div>`;
    d.querySelector("code").textContent = call.function.name;
    d.querySelector(".args").textContent = call.function.arguments;
    view.tools.append(d);
    return d;
  }

  // Streams one model round into `view`; returns {toolCalls, finishReason}.
  async function streamRound(view, body) {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    const calls = [];
    let buffer = "", finishReason = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          const thought = delta.reasoning_content || delta.reasoning;
          if (thought) {
            view.reasoning += thought;
            view.thinking.hidden = false;
            view.thinking.querySelector(".body").textContent = view.reasoning;
          }
          if (delta.content) {
            view.text += delta.content;
            view.content.innerHTML = Markdown.render(view.text);
          }
          for (const tc of delta.tool_calls || []) {
            const c = calls[tc.index] || (calls[tc.index] = { id: "", type: "function", function: { name: "", arguments: "" } });
            if (tc.id) c.id = tc.id;
            if (tc.function && tc.function.name) c.function.name += tc.function.name;
            if (tc.function && tc.function.arguments) c.function.arguments += tc.function.arguments;
          }
          if (choice.finish_reason) finishReason = choice.finish_reason;
        }
        view.div.scrollIntoView({ block: "end" });
      }
    }
    return { toolCalls: calls.filter(Boolean), finishReason };
  }

  async function runTool(call) {
    const resp = await fetch("/ui/mcp/call", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ name: call.function.name, arguments: call.function.arguments || "{}" }),
    });
    return resp.ok ? (await resp.json()).output : "error: " + await errorText(resp);
  }

  async function send(text) {
    history.push({ role: "user", content: text });
    addMessage("user", text);
    controller = new AbortController();
    els.send.disabled = true;
    els.stop.disabled = false;
    setStatus("");
    const view = assistantView();
    try {
      const offerTools = els.useMcp.checked && mcpTools.length > 0;
      for (let round = 0; round < MAX_TOOL_ROUNDS; round++) {
        const system = els.system.value.trim();
        const body = {
          model: els.model.value, stream: true,
          messages: (system ? [{ role: "system", content: system }] : []).concat(history),
          temperature: Number(els.temperature.value), max_tokens: Number(els.maxTokens.value),
        };
        if (offerTools) body.tools = mcpTools;
        view.text = "";
        const { toolCalls, finishReason } = await streamRound(view, body);
        if (!toolCalls.length) {
          history.push({ role: "assistant", content: view.text });
          if (finishReason === "length") view.div.append(note("stopped at max tokens"));
          break;
        }
        history.push({ role: "assistant", content: view.text || null, tool_calls: toolCalls });
        for (const call of toolCalls) {
          const d = toolView(view, call);
          const output = await runTool(call);
          d.querySelector(".result").textContent = output;
          history.push({ role: "tool", tool_call_id: call.id, content: output });
        }
      }
    } catch (err) {
      if (err.name === "AbortError") {
        view.div.append(note("stopped"));
        if (view.text) history.push({ role: "assistant", content: view.text });
      } else {
        view.div.append(note("error: " + err.message));
        setStatus(err.message);
      }
    } finally {
      controller = null;
      els.send.disabled = false;
      els.stop.disabled = true;
      view.div.dataset.done = "true";
    }
  }

  function note(text) {
    const n = document.createElement("div");
    n.className = "note";
    n.textContent = text;
    return n;
  }

  els.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = els.input.value.trim();
    if (!text || controller) return;
    els.input.value = "";
    send(text);
  });
  els.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); els.composer.requestSubmit(); }
  });
  els.stop.addEventListener("click", () => { if (controller) controller.abort(); });
  els.newChat.addEventListener("click", () => { if (!controller) { history = []; els.messages.replaceChildren(); } });
  els.model.addEventListener("change", () => localStorage.setItem("ui.model", els.model.value));
  els.apiKey.addEventListener("change", loadModels);
  loadModels();
})();
