"use strict";
// Line charts on <canvas>, drawn here (no chart library): x is seconds before now, y from 0 up.
const pagodaCharts = (() => {
  const COLORS = ["#0b6bcb", "#e8710a", "#1e8e3e", "#a142f4"];
  const PAD = { left: 46, right: 10, top: 22, bottom: 20 };

  // A round y axis: its top is 1, 2 or 5 times a power of ten, cut into 5, 4 or 5 round steps.
  function yAxis(value) {
    const top = value > 0 ? value : 1;
    const power = 10 ** Math.floor(Math.log10(top));
    for (const [step, ticks] of [[1, 5], [2, 4], [5, 5], [10, 5]]) {
      if (top <= step * power * (1 + 1e-9)) return { max: step * power, ticks };
    }
    return { max: 10 * power, ticks: 5 };
  }

  function shortNumber(value) {
    if (value >= 1000) return `${(value / 1000).toFixed(value >= 10000 ? 0 : 1)}k`;
    return value >= 10 || value === 0 ? value.toFixed(0) : value.toPrecision(2);
  }

  function sized(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const context = canvas.getContext("2d");
    context.setTransform(ratio, 0, 0, ratio, 0, 0);
    context.clearRect(0, 0, width, height);
    return { context, width, height };
  }

  function drawAxes(context, box, windowS, axis, ink) {
    context.strokeStyle = ink.grid;
    context.fillStyle = ink.text;
    context.font = "11px system-ui, sans-serif";
    context.lineWidth = 1;
    context.textAlign = "right";
    context.textBaseline = "middle";
    for (let i = 0; i <= axis.ticks; i++) {
      const y = box.bottom - (box.bottom - box.top) * i / axis.ticks;
      context.beginPath();
      context.moveTo(box.left, y);
      context.lineTo(box.right, y);
      context.stroke();
      context.fillText(shortNumber(axis.max * i / axis.ticks), box.left - 6, y);
    }
    context.textAlign = "center";
    context.textBaseline = "top";
    const stepS = windowS >= 240 ? 60 : windowS >= 60 ? 30 : 10;
    for (let s = 0; s <= windowS; s += stepS) {
      const x = box.right - (box.right - box.left) * s / windowS;
      context.fillText(s === 0 ? "now" : s % 60 === 0 ? `-${s / 60}m` : `-${s}s`, x, box.bottom + 4);
    }
  }

  function drawSeries(context, box, windowS, yMax, series, color) {
    const px = (x) => box.right + (box.right - box.left) * x / windowS;
    const py = (y) => box.bottom - (box.bottom - box.top) * Math.min(y, yMax) / yMax;
    context.strokeStyle = color;
    context.fillStyle = color;
    context.lineWidth = 1.8;
    let open = false;
    context.beginPath();
    series.points.forEach(([x, y], i) => {
      if (y === null || y === undefined || x < -windowS) {
        open = false;
        return;
      }
      const previous = series.points[i - 1], next = series.points[i + 1];
      const lonely = (!previous || previous[1] === null) && (!next || next[1] === null);
      if (lonely) context.fillRect(px(x) - 2, py(y) - 2, 4, 4); // a single point still shows
      if (open) context.lineTo(px(x), py(y));
      else context.moveTo(px(x), py(y));
      open = true;
    });
    context.stroke();
  }

  function drawLegend(context, box, series, ink) {
    context.font = "11px system-ui, sans-serif";
    context.textAlign = "left";
    context.textBaseline = "middle";
    let x = box.left;
    series.forEach((s, i) => {
      context.fillStyle = COLORS[i % COLORS.length];
      context.fillRect(x, 6, 9, 9);
      context.fillStyle = ink.text;
      context.fillText(s.label, x + 13, 11);
      x += 13 + context.measureText(s.label).width + 14;
    });
  }

  // series: [{label, points: [[seconds before now (<= 0), value or null], ...]}]
  function lineChart(canvas, series, windowS, minYMax = 1) {
    const { context, width, height } = sized(canvas);
    const style = getComputedStyle(document.body);
    const ink = { text: style.color, grid: style.getPropertyValue("--border") || "#ddd" };
    const box = { left: PAD.left, right: width - PAD.right, top: PAD.top, bottom: height - PAD.bottom };
    const values = series.flatMap((s) => s.points.map((p) => p[1])).filter((v) => v !== null && v !== undefined);
    canvas.dataset.points = String(values.length); // what a canvas cannot tell: how many values it shows
    const axis = yAxis(Math.max(minYMax, ...values));
    drawAxes(context, box, windowS, axis, ink);
    series.forEach((s, i) => drawSeries(context, box, windowS, axis.max, s, COLORS[i % COLORS.length]));
    drawLegend(context, box, series, ink);
    if (!values.length) {
      context.fillStyle = ink.text;
      context.textAlign = "center";
      context.fillText("no data yet", (box.left + box.right) / 2, (box.top + box.bottom) / 2);
    }
  }

  return { lineChart };
})();
