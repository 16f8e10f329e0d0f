"use strict";
// Shared by the chat page and the dashboard: API calls carrying the key the user gave, when the server
// asks for one (401). The key lives in sessionStorage: it is gone when the tab closes.
const pagoda = (() => {
  const KEY_STORAGE = "pagoda-api-key";
  let keyRequest = null; // the open key dialog's answer: one dialog, however many calls were refused

  function withKey(headers) {
    const result = Object.assign({}, headers);
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (key) result.Authorization = "Bearer " + key;
    return result;
  }

  // fetch(path, options) with the key; on a 401, asks for a key and tries again, until the user cancels.
  async function apiFetch(path, options = {}) {
    for (;;) {
      const response = await fetch(path, Object.assign({}, options, { headers: withKey(options.headers) }));
      if (response.status !== 401) return response;
      const refused = sessionStorage.getItem(KEY_STORAGE) !== null;
      const message = refused ? "The server refused that API key." : "This server needs an API key.";
      if (!(await askForKey(message))) return response;
    }
  }

  function askForKey(message) {
    if (keyRequest) return keyRequest;
    const dialog = document.getElementById("key-dialog");
    const input = dialog.querySelector("input");
    dialog.querySelector(".key-message").textContent = message;
    input.value = "";
    keyRequest = new Promise((resolve) => {
      dialog.addEventListener("close", () => {
        keyRequest = null;
        const key = input.value.trim();
        if (dialog.returnValue === "ok" && key) {
          sessionStorage.setItem(KEY_STORAGE, key);
          resolve(true);
        } else {
          resolve(false);
        }
      }, { once: true });
    });
    dialog.returnValue = "";
    dialog.showModal();
    return keyRequest;
  }

  function wireKeyDialog() {
    const dialog = document.getElementById("key-dialog");
    dialog.querySelector("form").addEventListener("submit", (event) => {
      event.preventDefault();
      dialog.close(event.submitter && event.submitter.value === "cancel" ? "cancel" : "ok");
    });
  }

  // An API error as one line: OpenAI's {"error": {"message"}} when the body has it.
  async function errorText(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
    } catch (_) {
      // not JSON: the status line says enough
    }
    return `${response.status} ${response.statusText}`;
  }

  function formatSeconds(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
    if (seconds < 1) return `${(seconds * 1000).toFixed(seconds < 0.01 ? 1 : 0)} ms`;
    return `${seconds.toFixed(2)} s`;
  }

  // An Error for a failed API call, with its status (401: the user gave no key; asking again is pointless).
  async function apiError(response) {
    const error = new Error(await errorText(response));
    error.status = response.status;
    return error;
  }

  async function firstModel() {
    const response = await apiFetch("/v1/models");
    if (!response.ok) throw await apiError(response);
    const body = await response.json();
    if (!body.data || !body.data.length) throw new Error("the server lists no model");
    return body.data[0].id;
  }

  document.addEventListener("DOMContentLoaded", wireKeyDialog);
  return { apiFetch, apiError, errorText, formatSeconds, firstModel };
})();
