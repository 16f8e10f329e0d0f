"use strict";
// The chat page: one conversation, each answer streamed from /v1/chat/completions as server-sent events.
// Model text reaches the page through pagodaRender.renderText only (text nodes, never HTML).
(() => {
  const $ = (id) => document.getElementById(id);
  const MODEL_RETRY_MS = 2000;
  const history = []; // {role, content} of the finished turns, sent with every question
  let model = null; // the first entry of /v1/models
  let running = null; // the AbortController of the answer being streamed

  // Only the fields the user filled in: the server's defaults stay the server's.
  function samplingOptions() {
    const options = {};
    const take = (id, name, parse) => {
      const text = $(id).value.trim();
      if (text !== "") options[name] = parse(text);
    };
    take("temperature", "temperature", Number);
    take("top-p", "top_p", Number);
    take("max-tokens", "max_tokens", Number);
    take("seed", "seed", Number);
    const stops = $("stop").value.split("\n").filter((line) => line !== "");
    if (stops.length) options.stop = stops;
    return options;
  }

  function requestBody(question) {
    const messages = [];
    const system = $("system-prompt").value;
    if (system.trim()) messages.push({ role: "system", content: system });
    messages.push(...history, { role: "user", content: question });
    const body = { model, messages, stream: true, stream_options: { include_usage: true } };
    return Object.assign(body, samplingOptions());
  }

  function addMessage(role) {
    $("empty-hint").hidden = true;
    const element = document.createElement("div");
    element.className = `message ${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const content = document.createElement("div");
    content.className = "content";
    const meta = document.createElement("div");
    meta.className = "meta";
    element.append(label, content, meta);
    $("messages").append(element);
    return { element, content, meta };
  }

  function scrollToEnd() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  // The parsed JSON of each `data:` event, until [DONE]; throws if the stream ends without it.
  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new Error("the stream ended before the answer was complete");
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const data = buffer.slice(0, end).split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        buffer = buffer.slice(end + 2);
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  }

  // TTFT from sending to the first chunk; tokens/s over the tokens after the first (decode speed).
  function describe(timing, usage, finish, state) {
    const parts = [];
    if (timing.first !== null) parts.push(`TTFT ${pagoda.formatSeconds((timing.first - timing.start) / 1000)}`);
    const tokens = usage ? usage.completion_tokens : timing.chunks; // stopped: no usage; a chunk is ~ a token
    const approx = usage ? "" : "≈";
    if (tokens > 1 && timing.last > timing.first) {
      const rate = (tokens - 1) / ((timing.last - timing.first) / 1000);
      parts.push(`${approx}${rate.toFixed(1)} tok/s`);
    }
    if (tokens) parts.push(`${approx}${tokens} tokens`);
    parts.push(state === "stopped" ? "stopped" : `finish: ${finish || "?"}`);
    return parts.join(" · ");
  }

  // Streams one answer into `result` (text, usage, finish reason, timing), rendering as it comes.
  async function streamAnswer(body, answer, controller, result) {
    const timing = result.timing;
    const response = await pagoda.apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await pagoda.errorText(response));
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new Error(event.error.message || "the server reported an error");
      if (event.usage) result.usage = event.usage;
      for (const choice of event.choices || []) {
        if (choice.index !== 0) continue; // one answer: the page never asks for n > 1
        const now = performance.now();
        if (timing.first === null) timing.first = now;
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece) {
          result.text += piece;
          timing.last = now;
          timing.chunks += 1;
          pagodaRender.renderText(answer.content, result.text);
          scrollToEnd();
        }
        if (choice.finish_reason) result.finish = choice.finish_reason;
      }
    }
  }

  async function ask(question) {
    const user = addMessage("user");
    pagodaRender.renderText(user.content, question);
    const answer = addMessage("assistant");
    answer.element.dataset.state = "streaming";
    const controller = new AbortController();
    running = controller;
    setBusy(true);
    const timing = { start: performance.now(), first: null, last: null, chunks: 0 };
    const result = { text: "", usage: null, finish: null, timing };
    let state = "done";
    try {
      await streamAnswer(requestBody(question), answer, controller, result);
    } catch (error) {
      state = controller.signal.aborted ? "stopped" : "error";
      if (state === "error") pagodaRender.renderText(answer.content, String(error.message || error));
    } finally {
      running = null;
      setBusy(false);
    }
    answer.element.dataset.state = state;
    if (!answer.element.isConnected) return; // "New chat" stopped it: it belongs to no conversation
    if (state === "error") return; // the question stays out of the history: ask it again
    answer.meta.textContent = describe(timing, result.usage, result.finish, state);
    if (timing.first !== null) answer.element.dataset.ttftMs = (timing.first - timing.start).toFixed(1);
    history.push({ role: "user", content: question }, { role: "assistant", content: result.text });
    scrollToEnd();
  }

  function setBusy(busy) {
    $("send").disabled = busy || model === null;
    $("stop-button").disabled = !busy;
  }

  function submit(event) {
    event.preventDefault();
    const question = $("prompt").value;
    if (running || model === null || !question.trim()) return;
    $("prompt").value = "";
    ask(question);
  }

  function newChat() {
    if (running) running.abort();
    history.length = 0;
    for (const message of document.querySelectorAll("#messages .message")) message.remove();
    $("empty-hint").hidden = false;
  }

  // The built-in model says what it can do, with questions to click; any other model says nothing here.
  async function loadIntro() {
    const response = await pagoda.apiFetch("/chat/intro");
    if (!response.ok) return;
    const { intro, examples } = await response.json();
    if (!intro) return;
    $("intro-text").textContent = intro;
    for (const example of examples) {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = example;
      button.addEventListener("click", () => {
        $("prompt").value = example;
        $("composer").requestSubmit();
      });
      $("intro-examples").append(button);
    }
    $("intro").hidden = false;
  }

  async function loadModel() {
    try {
      model = await pagoda.firstModel();
      $("model-name").textContent = model;
      $("chat-status").textContent = "";
      $("chat-status").classList.remove("error");
      setBusy(false);
      loadIntro().catch(() => {}); // optional: the page works without it
    } catch (error) {
      const retry = error.status !== 401; // no key given: reloading the page asks again
      $("chat-status").textContent = `Cannot list the models (${error.message}); ` +
        (retry ? "retrying." : "reload the page to give an API key.");
      $("chat-status").classList.add("error");
      if (retry) setTimeout(loadModel, MODEL_RETRY_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    // Stop aborts the stream; the server sees the connection close and aborts the request.
    $("stop-button").addEventListener("click", () => running && running.abort());
    $("composer").addEventListener("submit", submit);
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("new-chat").addEventListener("click", newChat);
    setBusy(false);
    loadModel();
  });
})();
