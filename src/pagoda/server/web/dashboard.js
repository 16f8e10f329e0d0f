"use strict";
// The dashboard: polls /dashboard/stats (every second; ?refresh=<ms> to change) and draws the last minutes.
// Gauges (running, waiting, KV use, prefix-cache counters) are sampled by this page, so their charts start
// when it opens; latencies and token counts come from the server's own record of the last minutes.
(() => {
  const $ = (id) => document.getElementById(id);
  const REFRESH_MS = Math.max(200, Number(new URLSearchParams(location.search).get("refresh")) || 1000);
  const samples = []; // {t, running, waiting, kv, queries, hits}: one per poll, oldest first
  let windowS = 300; // the server says how far back it looks

  function tile(id, value, sub = "") {
    $(id).querySelector(".value").textContent = value;
    $(id).querySelector(".sub").textContent = sub;
  }

  const percent = (fraction) => (fraction === null ? "–" : `${(100 * fraction).toFixed(1)} %`);
  const ms = (seconds) => (seconds === null || seconds === undefined ? null : seconds * 1000);

  function record(stats) {
    samples.push({ t: stats.time, running: stats.running, waiting: stats.waiting, kv: stats.kv_cache_usage,
      queries: stats.prefix_cache_queries, hits: stats.prefix_cache_hits });
    while (samples.length && samples[0].t < stats.time - windowS) samples.shift();
  }

  // Prefix-cache hits / lookups between two samples; null when nothing was looked up.
  function hitRate(from, to) {
    const queries = to.queries - from.queries;
    return queries > 0 ? (to.hits - from.hits) / queries : null;
  }

  // Every bucket slot of the window, newest last, empty ones included: [{t, end, bucket or null}].
  function bucketSlots(recent, now) {
    const buckets = recent.buckets;
    if (!buckets.length) return [];
    const size = recent.bucket_s, newest = buckets[buckets.length - 1].t;
    const byIndex = new Map(buckets.map((b) => [Math.round((b.t - newest) / size), b]));
    const last = Math.max(0, Math.floor((now - newest) / size));
    const slots = [];
    for (let i = last - Math.round(windowS / size) + 1; i <= last; i++) {
      const t = newest + i * size;
      slots.push({ t, end: Math.min(t + size, now), bucket: byIndex.get(i) || null });
    }
    return slots;
  }

  function renderTiles(stats) {
    const recent = stats.recent, first = samples[0], last = samples[samples.length - 1];
    const total = stats.prefix_cache_queries ? stats.prefix_cache_hits / stats.prefix_cache_queries : null;
    const windowed = samples.length > 1 ? hitRate(first, last) : null;
    const requests = recent.buckets.reduce((sum, b) => sum + b.requests, 0);
    const generated = recent.buckets.reduce((sum, b) => sum + b.generation_tokens, 0);
    const minutes = `${Math.round(recent.window_s / 60)} min`;
    tile("running", String(stats.running), `${stats.num_preemptions} preemptions since start`);
    tile("waiting", String(stats.waiting));
    tile("kv-usage", percent(stats.kv_cache_usage), `max_model_len ${stats.max_model_len}`);
    tile("prefix-hits", percent(windowed !== null ? windowed : total), `since start: ${percent(total)}`);
    tile("tokens-per-s", recent.generation_tokens_per_s.toFixed(1), `${generated} tokens in ${minutes}`);
    const latency = (p) => (p ? `p90 ${pagoda.formatSeconds(p.p90)} · p99 ${pagoda.formatSeconds(p.p99)}` : "");
    tile("ttft", pagoda.formatSeconds(recent.ttft && recent.ttft.p50), latency(recent.ttft));
    tile("itl", pagoda.formatSeconds(recent.itl && recent.itl.p50), latency(recent.itl));
    tile("requests", String(requests), `in the last ${minutes}`);
  }

  function renderCharts(stats) {
    const now = stats.time;
    const gauge = (key, scale = 1) => samples.map((s) => [s.t - now, s[key] * scale]);
    const chart = (id, series, minYMax) => pagodaCharts.lineChart($(id), series, windowS, minYMax);
    chart("chart-requests", [{ label: "running", points: gauge("running") },
      { label: "waiting", points: gauge("waiting") }], 1);
    chart("chart-kv", [{ label: "in use", points: gauge("kv", 100) }], 10);
    const hits = samples.slice(1).map((s, i) => [s.t - now, hitRate(samples[i], s)]);
    chart("chart-prefix", [{ label: "hit rate", points: hits.map(([x, y]) => [x, y === null ? null : 100 * y]) }], 10);
    const slots = bucketSlots(stats.recent, now);
    const rate = (key) => slots.map((s) => [s.end - now, s.bucket ? s.bucket[key] / Math.max(s.end - s.t, 1) : 0]);
    chart("chart-tokens", [{ label: "generated", points: rate("generation_tokens") },
      { label: "prompt", points: rate("prompt_tokens") }], 1);
    const quantiles = (kind) => ["p50", "p90", "p99"].map((p) => ({ label: p,
      points: slots.map((s) => [s.end - now, s.bucket && s.bucket[kind] ? ms(s.bucket[kind][p]) : null]) }));
    chart("chart-ttft", quantiles("ttft"), 1);
    chart("chart-itl", quantiles("itl"), 1);
  }

  function formatBytes(bytes) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = bytes, unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
    return unit ? `${value.toFixed(1)} ${units[unit]}` : `${value} B`;
  }

  // The offload tiers' counters since start-up, one row per tier (hidden without a KV connector).
  function renderTiers(kvTiers) {
    $("kv-tiers").hidden = !kvTiers;
    if (!kvTiers) return;
    const share = kvTiers.queries ? ` (${percent(kvTiers.hits / kvTiers.queries)})` : "";
    $("kv-tiers-summary").textContent = `${kvTiers.hits} of ${kvTiers.queries} looked-up prompt tokens loaded` +
      `${share} · ${kvTiers.failed_loads} failed loads`;
    const rows = kvTiers.tiers.map((tier) => {
      const row = document.createElement("tr");
      row.dataset.medium = tier.medium;
      const cells = [["medium", tier.medium], ["hit_tokens", String(tier.hit_tokens)],
        ["hit_blocks", String(tier.hit_blocks)], ["bytes_loaded", formatBytes(tier.bytes_loaded)],
        ["bytes_saved", formatBytes(tier.bytes_saved)], ["load_seconds", pagoda.formatSeconds(tier.load_seconds)],
        ["save_seconds", pagoda.formatSeconds(tier.save_seconds)], ["evicted_blocks", String(tier.evicted_blocks)],
        ["failures", `${tier.failures} · ${tier.refused_blocks}`]];
      for (const [key, text] of cells) {
        const cell = document.createElement("td");
        cell.dataset.key = key;
        cell.textContent = text;
        row.append(cell);
      }
      return row;
    });
    $("kv-tiers-rows").replaceChildren(...rows);
  }

  function status(text, isError) {
    $("dashboard-status").textContent = text;
    $("dashboard-status").classList.toggle("error", isError);
  }

  async function poll() {
    let again = true;
    try {
      const response = await pagoda.apiFetch("/dashboard/stats");
      if (!response.ok) throw await pagoda.apiError(response);
      const stats = await response.json();
      windowS = stats.recent.window_s;
      $("model-name").textContent = stats.model;
      record(stats);
      renderTiles(stats);
      renderCharts(stats);
      renderTiers(stats.kv_tiers);
      status(`Updated ${new Date(stats.time * 1000).toLocaleTimeString()} · every ${REFRESH_MS / 1000} s · ` +
        `latencies and tokens over the last ${Math.round(windowS / 60)} min, gauges since this page opened`, false);
    } catch (error) {
      again = error.status !== 401; // no key given: reloading the page asks again
      status(`Cannot read the server's stats: ${error.message}` + (again ? "" : "; reload to give an API key"), true);
    } finally {
      if (again) setTimeout(poll, REFRESH_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", poll);
})();
