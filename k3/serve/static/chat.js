// k3 chat page: talks to this server's OpenAI-compatible API (/v1/models, /v1/chat/completions).
// Streams replies (server-sent events), shows the model's thinking in a collapsible block, tool calls
// with a field to answer each one, images when the model has vision; Stop aborts the request (the
// server cancels it when the connection closes). The API key, when the server asks for one, is kept in
// this tab's sessionStorage only.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { history: [], key: sessionStorage.getItem("k3-key") || "", model: null, vision: false,
                controller: null, image: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

class AuthError extends Error {}

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: headers() });
  if (r.status === 401) {
    showKeyForm(state.key ? "that key was refused" : "");
    throw new AuthError("API key needed");
  }
  if (!r.ok) {
    let message = r.status + " " + r.statusText;
    try { message = (await r.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return r;
}

function showKeyForm(error) {
  $("key-form").hidden = false;
  $("key-error").textContent = error;
  $("key").focus();
}

async function loadModel() {
  try {
    const models = await (await api("/v1/models")).json();
    const card = models.data[0];
    state.model = card.id;
    state.vision = !!card.vision;
    $("model").textContent = `${card.id} · context ${card.max_model_len}` + (card.vision ? " · vision" : "");
    $("image-label").hidden = !state.vision;
    $("key-form").hidden = true;
  } catch (e) {
    if (!(e instanceof AuthError)) $("model").textContent = "server unreachable: " + e.message;
  }
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function bubble(role) {
  const b = el("div", "msg " + role);
  b.appendChild(el("div", "role", role));
  $("messages").appendChild(b);
  return b;
}

function scrollDown() { $("messages").scrollTop = $("messages").scrollHeight; }

function renderUser(message) {
  const b = bubble("user");
  const parts = typeof message.content === "string" ? [{ type: "text", text: message.content }] : message.content;
  for (const p of parts) {
    if (p.type === "text") b.appendChild(el("div", "content", p.text));
    else if (p.type === "image_url") { const img = el("img"); img.src = p.image_url.url; img.alt = "image"; b.appendChild(img); }
  }
  scrollDown();
}

function renderTool(message, name) {
  const b = bubble("tool");
  b.appendChild(el("div", "content", `${name} → ${message.content}`));
  scrollDown();
}

function settings() {
  const num = (id) => Number($(id).value);
  const body = { temperature: num("temperature"), top_p: num("top-p"), top_k: num("top-k"),
                 max_tokens: num("max-tokens"), chat_template_kwargs: { thinking: $("thinking").checked } };
  if ($("thinking").checked) body.reasoning_effort = $("effort").value;
  const tools = $("tools").value.trim();
  if (tools) {
    let parsed;
    try { parsed = JSON.parse(tools); } catch (e) { throw new Error("Tools: not JSON (" + e.message + ")"); }
    if (!Array.isArray(parsed)) throw new Error("Tools: a JSON array of function declarations, please");
    body.tools = parsed;
  }
  return body;
}

function renderToolCalls(box, calls) {
  for (const call of calls) {
    const c = el("div", "tool-call");
    c.appendChild(el("div", "", `call ${call.function.name}(${call.function.arguments})`));
    const form = el("form");
    const input = el("input");
    input.placeholder = "tool result";
    input.setAttribute("aria-label", `result of ${call.function.name}`);
    form.appendChild(input);
    form.appendChild(el("button", "", "Answer"));
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const message = { role: "tool", tool_call_id: call.id, name: call.function.name, content: input.value };
      state.history.push(message);
      form.remove();
      renderTool(message, call.function.name);
      generate();
    });
    c.appendChild(form);
    box.appendChild(c);
  }
}

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function generate() {
  const b = bubble("assistant");
  const thinking = el("details", "thinking");
  const summary = el("summary", "", "Thinking");
  const thought = el("div", "thought");
  thinking.append(summary, thought);
  thinking.open = true;
  thinking.hidden = true;
  const content = el("div", "content");
  const tools = el("div", "tools");
  const meta = el("span", "meta");
  b.append(thinking, content, tools, meta);
  const reply = { role: "assistant", content: "", reasoning_content: "" };
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
  state.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  try {
    const body = { model: state.model || "kimi-k3", messages, stream: true, stream_options: { include_usage: true },
                   ...settings() };
    const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
                                                  signal: state.controller.signal });
    for await (const chunk of sseEvents(r)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) meta.textContent += ` · ${chunk.usage.completion_tokens} tokens`;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if (d.reasoning_content) {
        reply.reasoning_content += d.reasoning_content;
        thought.textContent = reply.reasoning_content;
        thinking.hidden = false;
      }
      if (d.content) {
        reply.content += d.content;
        content.textContent = reply.content;
        thinking.open = false;  // the answer has started: fold the thinking away
      }
      if (d.tool_calls) {
        reply.tool_calls = d.tool_calls.map(({ index, ...c }) => c);
        renderToolCalls(tools, reply.tool_calls);
      }
      if (choice.finish_reason) meta.textContent = choice.finish_reason + meta.textContent;
      scrollDown();
    }
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    meta.textContent += ` · ${seconds} s`;
    b.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") { meta.textContent = "stopped"; b.dataset.state = "stopped"; }
    else { meta.textContent = "error: " + e.message; b.classList.add("failed"); b.dataset.state = "error"; }
  } finally {
    state.history.push(reply);
    thinking.open = false;
    summary.textContent = reply.reasoning_content ? "Thinking" : "Thinking (none)";
    state.controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("stop").disabled = !busy;
  $("send").disabled = busy;
  $("status").textContent = busy ? "generating..." : "";
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function onSend(ev) {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text && !state.image) return;
  let message = { role: "user", content: text };
  if (state.image) {
    message.content = [{ type: "image_url", image_url: { url: state.image } }, { type: "text", text }];
    state.image = null;
    $("attachments").textContent = "";
    $("image").value = "";
  }
  $("input").value = "";
  state.history.push(message);
  renderUser(message);
  await generate();
}

window.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", onSend);
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("settings-button").addEventListener("click", () => {
    const s = $("settings");
    s.hidden = !s.hidden;
    $("settings-button").setAttribute("aria-expanded", String(!s.hidden));
  });
  $("key-button").addEventListener("click", () => showKeyForm(""));
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("key").value.trim();
    sessionStorage.setItem("k3-key", state.key);
    loadModel();
  });
  $("new-chat").addEventListener("click", () => { state.history = []; $("messages").textContent = ""; });
  $("image").addEventListener("change", async () => {
    const file = $("image").files[0];
    if (!file) return;
    state.image = await readImage(file);
    const img = el("img");
    img.src = state.image;
    img.alt = "attached image";
    $("attachments").replaceChildren(img);
  });
  loadModel();
});
