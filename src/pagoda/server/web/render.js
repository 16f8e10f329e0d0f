"use strict";
// Model output on the page: only ever text nodes, never HTML, so "<script>" in an answer is shown as text.
// Fenced code blocks (```) become <pre><code> filled with textContent; the rest is text, its lines kept by
// the stylesheet (white-space: pre-wrap). An unclosed fence (still streaming) runs to the end.
const pagodaRender = (() => {
  const FENCE = /```[^\n]*\n?([\s\S]*?)(?:```|$)/g;

  function renderText(element, text) {
    element.replaceChildren();
    let done = 0;
    for (const match of text.matchAll(FENCE)) {
      if (match.index > done) element.append(document.createTextNode(text.slice(done, match.index)));
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      code.textContent = match[1];
      pre.append(code);
      element.append(pre);
      done = match.index + match[0].length;
    }
    if (done < text.length) element.append(document.createTextNode(text.slice(done)));
  }

  return { renderText };
})();
