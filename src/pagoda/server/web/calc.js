"use strict";
// The calculator page: the inputs are `pagoda calc` flags; every figure (and every chart point) comes from
// /calc/report, which runs the calculator's own Python. This script only lays the answer out.
(() => {
  const FIELDS = ["model", "gpu", "num_gpus", "dtype", "kv_dtype", "batch", "seq_len", "prompt_len"];
  const SVG = "http://www.w3.org/2000/svg";
  const CHART = { width: 640, height: 300, left: 62, right: 16, top: 12, bottom: 38 };
  let pending = null; // the debounce timer
  let sequence = 0; // answers older than the newest request are dropped

  const $ = (id) => document.getElementById(id);

  function setStatus(text, isError = false) {
    $("calc-status").textContent = text;
    $("calc-status").classList.toggle("error", isError);
  }

  function fillSelect(select, values, chosen) {
    select.replaceChildren(...values.map((value) => {
      const option = document.createElement("option");
      option.value = option.textContent = value;
      return option;
    }));
    select.value = chosen;
  }

  function fields() {
    const result = {};
    for (const name of FIELDS) {
      const value = $(name).value;
      if (value !== "") result[name] = value;
    }
    return result;
  }

  function showSliders() {
    $("batch-value").textContent = Number($("batch").value).toLocaleString("en-US");
    $("seq_len-value").textContent = Number($("seq_len").value).toLocaleString("en-US");
  }

  function schedule() {
    showSliders();
    clearTimeout(pending);
    pending = setTimeout(calculate, 120);
  }

  async function calculate() {
    const mine = ++sequence;
    const body = { fields: fields() };
    const pasted = $("config").value.trim();
    if (pasted) {
      try {
        body.config = JSON.parse(pasted);
      } catch (error) {
        setStatus(`config.json: ${error.message}`, true);
        return;
      }
    }
    setStatus($("gpu").value === "this-machine" ? "measuring this machine…" : "calculating…");
    const response = await pagoda.apiFetch("/calc/report", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    if (mine !== sequence) return;
    if (!response.ok) {
      setStatus(await pagoda.errorText(response), true);
      return;
    }
    const report = await response.json();
    render(report);
    drawRoofline(report.roofline);
    setStatus("");
    document.body.dataset.calcSequence = String(mine);
  }

  function cell(tag, text, className) {
    const element = document.createElement(tag);
    element.textContent = text;
    if (className) element.className = className;
    return element;
  }

  function render(report) {
    $("calc-warnings").replaceChildren(...report.json.warnings.map((text) => cell("li", text)));
    const sections = report.parts.map((part) => {
      const section = document.createElement("section");
      section.className = "calc-part";
      section.dataset.key = part.key;
      section.append(cell("h2", part.title));
      const table = document.createElement("table");
      if (part.columns) {
        const head = document.createElement("tr");
        head.className = "head";
        head.append(...part.columns.map((label) => cell("th", label)));
        table.append(head);
        for (const row of part.rows) {
          const line = document.createElement("tr");
          line.append(...row.map((text) => cell("td", text)));
          table.append(line);
        }
      } else {
        for (const row of part.rows) {
          const line = document.createElement("tr");
          line.dataset.key = row.key;
          line.append(cell("th", row.label), cell("td", row.text, "value"), cell("td", row.note, "note"));
          table.append(line);
        }
      }
      section.append(table);
      return section;
    });
    $("calc-report").replaceChildren(...sections);
  }

  function svg(tag, attributes, text) {
    const element = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attributes)) element.setAttribute(name, value);
    if (text !== undefined) element.textContent = text;
    return element;
  }

  // Log-log axes over the curve's span; positions only, no figure is computed here.
  function drawRoofline(roofline) {
    const chart = $("roofline");
    const xs = roofline.curve.map((p) => Math.log10(p[0]));
    const ys = roofline.curve.map((p) => Math.log10(p[1]));
    const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys) + 0.1];
    const px = (x) => CHART.left + (Math.log10(x) - x0) / (x1 - x0) * (CHART.width - CHART.left - CHART.right);
    const py = (y) => CHART.height - CHART.bottom
      - (Math.log10(y) - y0) / (y1 - y0) * (CHART.height - CHART.top - CHART.bottom);
    const parts = [];
    for (let decade = Math.ceil(x0); decade <= Math.floor(x1); decade++) {
      const x = px(10 ** decade);
      parts.push(svg("line", { x1: x, x2: x, y1: CHART.top, y2: CHART.height - CHART.bottom, class: "grid" }));
      parts.push(svg("text", { x, y: CHART.height - CHART.bottom + 16, "text-anchor": "middle" }, `${10 ** decade}`));
    }
    for (let decade = Math.ceil(y0); decade <= Math.floor(y1); decade++) {
      const y = py(10 ** decade);
      parts.push(svg("line", { x1: CHART.left, x2: CHART.width - CHART.right, y1: y, y2: y, class: "grid" }));
      parts.push(svg("text", { x: CHART.left - 6, y: y + 4, "text-anchor": "end" }, `1e${decade}`));
    }
    parts.push(svg("text", { x: (CHART.left + CHART.width) / 2, y: CHART.height - 4, "text-anchor": "middle" },
      "arithmetic intensity (flop/byte)"));
    const middle = (CHART.top + CHART.height - CHART.bottom) / 2;
    parts.push(svg("text", { x: 12, y: middle, "text-anchor": "middle", transform: `rotate(-90 12 ${middle})` },
      "attainable flop/s"));
    parts.push(svg("polyline", { class: "roof", points: roofline.curve.map((p) => `${px(p[0])},${py(p[1])}`).join(" ") }));
    parts.push(svg("line", { class: "ridge", x1: px(roofline.ridge), x2: px(roofline.ridge), y1: CHART.top,
      y2: CHART.height - CHART.bottom }));
    for (const point of roofline.decode) {
      const dot = svg("circle", { cx: px(point.intensity), cy: py(point.flop_per_s), r: point.chosen ? 6 : 4,
        class: point.chosen ? "decode chosen" : "decode" });
      dot.append(svg("title", {}, `batch ${point.batch}`));
      parts.push(dot);
    }
    chart.replaceChildren(...parts);
  }

  async function start() {
    const response = await pagoda.apiFetch("/calc/presets");
    if (!response.ok) {
      setStatus(await pagoda.errorText(response), true);
      return;
    }
    const presets = await response.json();
    const defaults = presets.defaults;
    fillSelect($("model"), presets.models, defaults.model);
    fillSelect($("gpu"), presets.gpus, presets.gpus[0]);
    for (const name of ["num_gpus", "dtype", "batch", "seq_len", "prompt_len"]) $(name).value = defaults[name];
    $("kv_dtype").value = defaults.kv_dtype || "";
    for (const name of [...FIELDS, "config"]) $(name).addEventListener("input", schedule);
    showSliders();
    await calculate();
  }

  document.addEventListener("DOMContentLoaded", () => start().catch((error) => setStatus(error.message, true)));
})();
