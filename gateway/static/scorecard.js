// understudy's scorecard: reads the admin API with the operator's token and draws its
// plots as inline SVG. No build step and no library: everything here is this file.
//
// The token: typed into the form, or given once in the URL's fragment (#token=...), which
// never reaches a server; it is kept in this tab's sessionStorage and sent as a bearer
// header. Every value from the API is put on the page as text (textContent), never as HTML.
"use strict";

const API = "/admin/v1";
const TOKEN_KEY = "understudy.admin.token";
const SVG_NS = "http://www.w3.org/2000/svg";
const MAX_CANDIDATES = 20; // candidates drawn in detail, in name order (the table lists all)
const PLOT_W = 420;
const PLOT_H = 240;
const MARGIN = { left: 52, right: 14, top: 42, bottom: 40 };
const TABLE_REASONS = 2; // reasons shown in the table; the candidate's section lists all

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// -- token and requests -----------------------------------------------------------------

function takeTokenFromFragment() {
  const params = new URLSearchParams(window.location.hash.slice(1));
  const token = params.get("token");
  if (token !== null) {
    sessionStorage.setItem(TOKEN_KEY, token.trim());
    history.replaceState(null, "", window.location.pathname + window.location.search);
  }
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

async function api(path) {
  const headers = { Accept: "application/json" };
  if (token()) headers.Authorization = "Bearer " + token();
  let response;
  try {
    response = await fetch(API + path, { headers, cache: "no-store", credentials: "omit" });
  } catch (err) {
    throw new ApiError(0, "The admin API did not answer (" + err.message + ").");
  }
  let body = null;
  try {
    body = await response.json();
  } catch (err) {
    body = null;
  }
  if (!response.ok) {
    const said = body && body.error && body.error.message ? body.error.message : response.statusText;
    throw new ApiError(response.status, said);
  }
  return body;
}

// -- small DOM and SVG builders -----------------------------------------------------------

function el(tag, attrs, parent, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function svgEl(tag, attrs, parent, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

function showMessage(text, isError) {
  const box = document.getElementById("message");
  box.textContent = text;
  box.className = isError ? "error" : "";
  box.hidden = !text;
}

function fmt(value, unit) {
  if (value === null || value === undefined || Number.isNaN(value)) return "n/a";
  if (unit === "s") {
    if (value < 1) return (value * 1000).toPrecision(3) + " ms";
    return value.toPrecision(3) + " s";
  }
  if (Math.abs(value) >= 1000 || Number.isInteger(value)) return String(Math.round(value));
  return value.toPrecision(3);
}

function timeOfDay(epochSeconds) {
  const d = new Date(epochSeconds * 1000);
  return d.toTimeString().slice(0, 5);
}

// A plot: an <svg class="plot"> with a title, a legend under it and axes; the caller adds
// the series. data-kind names the plot, data-points counts the data points drawn in it.
// opts.log: a log10 x axis (latencies span orders of magnitude); opts.width: its width.
function plot(parent, kind, title, xRange, yRange, xLabel, yLabel, series, opts) {
  const width = (opts && opts.width) || PLOT_W;
  const log = Boolean(opts && opts.log) && xRange[0] > 0;
  const svg = svgEl("svg", {
    class: "plot", width, height: PLOT_H, viewBox: `0 0 ${width} ${PLOT_H}`,
    "data-kind": kind, role: "img", "aria-label": title,
  }, parent);
  svgEl("text", { class: "title", x: 8, y: 16 }, svg, title);
  const x0 = MARGIN.left, x1 = width - MARGIN.right, y0 = PLOT_H - MARGIN.bottom, y1 = MARGIN.top;
  const tx = log ? Math.log10 : (x) => x;
  let [xmin, xmax] = [tx(xRange[0]), tx(xRange[1])];
  if (xmin === xmax) [xmin, xmax] = [xmin - 1, xmax + 1];
  const [ymin, ymax] = yRange[0] === yRange[1] ? [yRange[0], yRange[1] + 1] : yRange;
  const sx = (x) => x0 + ((tx(x) - xmin) / (xmax - xmin)) * (x1 - x0);
  const sy = (y) => y0 - ((y - ymin) / (ymax - ymin)) * (y0 - y1);
  for (let i = 0; i <= 4; i++) {
    const y = y0 - (i / 4) * (y0 - y1);
    svgEl("line", { class: "grid", x1: x0, x2: x1, y1: y, y2: y }, svg);
  }
  svgEl("line", { class: "axis", x1: x0, x2: x1, y1: y0, y2: y0 }, svg);
  svgEl("line", { class: "axis", x1: x0, x2: x0, y1: y0, y2: y1 }, svg);
  svgEl("text", { x: x0, y: y0 + 14 }, svg, xLabel.min);
  svgEl("text", { x: x1, y: y0 + 14, "text-anchor": "end" }, svg, xLabel.max);
  svgEl("text", { x: (x0 + x1) / 2, y: y0 + 30, "text-anchor": "middle" }, svg,
    xLabel.name + (log ? " (log scale)" : ""));
  svgEl("text", { x: x0 - 4, y: y0, "text-anchor": "end" }, svg, yLabel.min);
  svgEl("text", { x: x0 - 4, y: y1 + 8, "text-anchor": "end" }, svg, yLabel.max);
  let legendX = 8;
  for (const s of series) {
    svgEl("rect", { class: s.cls, x: legendX, y: 22, width: 10, height: 10 }, svg);
    svgEl("text", { x: legendX + 14, y: 31 }, svg, s.label);
    legendX += 24 + s.label.length * 6;
  }
  return { svg, sx, sy, points: 0 };
}

function finish(p) {
  p.svg.setAttribute("data-points", String(p.points));
}

function line(p, cls, label, xs, ys) {
  const pts = xs.map((x, i) => `${p.sx(x).toFixed(1)},${p.sy(ys[i]).toFixed(1)}`);
  svgEl("polyline", { class: cls + " line series", points: pts.join(" "), "data-series": label }, p.svg);
  if (xs.length < 3) {
    xs.forEach((x, i) => svgEl("circle", { class: cls + " series", cx: p.sx(x), cy: p.sy(ys[i]), r: 3.5 }, p.svg));
  }
  p.points += xs.length;
}

// -- the plots ----------------------------------------------------------------------------

function cdfPlot(parent, dist, name) {
  const sides = [
    ["primary", "s-primary", "primary"], ["candidate", "s-candidate", name],
    ["floor", "s-floor", "noise floor"],
  ].filter(([key]) => dist[key]);
  const values = sides.flatMap(([key]) => dist[key]);
  const xmin = Math.min(...values), xmax = Math.max(...values);
  const counts = sides.map(([key]) => dist.samples[key]).join(" / ");
  const p = plot(parent, "cdf", `${dist.metric}: CDF (n = ${counts})`, [xmin, xmax], [0, 1],
    { min: fmt(xmin, dist.unit), max: fmt(xmax, dist.unit), name: dist.unit === "s" ? "latency" : dist.unit },
    { min: "0", max: "1" }, sides.map(([, cls, label]) => ({ cls, label })),
    { log: xmin > 0 && xmax / xmin > 20 });
  for (const [key, cls, label] of sides) line(p, cls, label, dist[key], dist.quantiles);
  finish(p);
}

function histogramPlot(parent, hist, name) {
  const sides = [["candidate", "s-candidate", name], ["floor", "s-floor", "noise floor"]]
    .filter(([key]) => hist[key] && hist.samples[key] > 0);
  const shares = sides.map(([key]) => {
    const total = hist[key].reduce((a, b) => a + b, 0) || 1;
    return hist[key].map((n) => n / total);
  });
  const top = Math.max(0.01, ...shares.flat());
  const means = sides.map(([key, , label]) => `${label} mean ${fmt(hist[key + "_mean"])}`).join(", ");
  const p = plot(parent, "histogram", `${hist.metric} (${means})`, [0, 1], [0, top],
    { min: "0", max: "1", name: "similarity to the primary's answer" },
    { min: "0", max: (top * 100).toFixed(0) + " %" }, sides.map(([, cls, label]) => ({ cls, label })));
  const width = (p.sx(hist.edges[1]) - p.sx(hist.edges[0])) / Math.max(1, sides.length);
  sides.forEach(([, cls, label], s) => {
    shares[s].forEach((share, i) => {
      if (share <= 0) return;
      const x = p.sx(hist.edges[i]) + s * width;
      svgEl("rect", {
        class: cls + " series bar", x: x.toFixed(1), y: p.sy(share).toFixed(1),
        width: Math.max(1, width - 1).toFixed(1), height: (p.sy(0) - p.sy(share)).toFixed(1),
        "data-series": label, "data-bin": i,
      }, p.svg);
      p.points += 1;
    });
  });
  finish(p);
}

function dropsPlot(parent, traffic) {
  if (!traffic.windows.length) {
    el("p", { class: "note" }, parent, "No traffic counted in the last hour yet (counts are stored every 10 s, per minute).");
    return;
  }
  const xs = traffic.windows;
  const series = [{ cls: "s-seen", label: "seen", counts: traffic.seen }].concat(
    traffic.drops.map((d, i) => ({ cls: "s-drop-" + (i % 6), label: `${d.candidate}: ${d.reason}`, counts: d.counts })));
  const top = Math.max(1, ...series.flatMap((s) => s.counts));
  const p = plot(parent, "drops", `Requests seen and mirror drops per ${traffic.window_s} s`,
    [xs[0], xs[xs.length - 1]], [0, top],
    { min: timeOfDay(xs[0]), max: timeOfDay(xs[xs.length - 1]), name: "time (window start)" },
    { min: "0", max: String(top) }, series.map((s) => ({ cls: s.cls, label: s.label })),
    { width: PLOT_W * 2 });
  for (const s of series) line(p, s.cls, s.label, xs, s.counts);
  finish(p);
}

function canaryPlot(parent, canary) {
  clear(parent);
  if (!canary) {
    el("p", { class: "note", id: "no-canary" }, parent, "No canary is running.");
    return;
  }
  const now = Date.now() / 1000;
  const elapsed = Math.min(1, Math.max(0, (now - canary.step_started_at) / canary.interval_s));
  const svg = svgEl("svg", {
    class: "plot", width: PLOT_W * 2, height: 90, viewBox: `0 0 ${PLOT_W * 2} 90`,
    "data-kind": "canary", role: "img", "aria-label": "canary progress",
  }, parent);
  svgEl("text", { class: "title", x: 10, y: 16 }, svg,
    `${canary.backend.name}: ${canary.percent} % of sessions, step ${canary.step + 1} of ${canary.steps.length} ` +
    `(${Math.round(elapsed * 100)} % of its ${fmt(canary.interval_s)} s)`);
  const left = 10, right = PLOT_W * 2 - 10, width = (right - left) / canary.steps.length;
  canary.steps.forEach((percent, i) => {
    const x = left + i * width;
    const cls = i < canary.step ? "step-done" : "step-todo";
    svgEl("rect", { class: cls + " series", x: x + 1, y: 28, width: width - 2, height: 26, "data-step": i }, svg);
    if (i === canary.step) {
      svgEl("rect", { class: "step-now series", x: x + 1, y: 28, width: Math.max(2, (width - 2) * elapsed), height: 26 }, svg);
    }
    svgEl("text", { x: x + width / 2, y: 72, "text-anchor": "middle" }, svg, percent + " %");
  });
  svg.setAttribute("data-points", String(canary.steps.length));
}

// -- sections -----------------------------------------------------------------------------

function showRouting(routing) {
  const dl = document.getElementById("routing-body");
  clear(dl);
  const rows = [["version", String(routing.version)], ["primary", `${routing.primary.name} (${routing.primary.url})`],
    ["rollback target", routing.previous ? routing.previous.name : "none"]];
  for (const [k, v] of rows) {
    el("dt", {}, dl, k);
    el("dd", {}, dl, v);
  }
  canaryPlot(document.getElementById("canary"), routing.canary);
}

function verdictBadge(parent, verdict) {
  return el("span", { class: "verdict verdict-" + verdict }, parent, verdict);
}

function showCandidateRow(tbody, c, report) {
  const tr = el("tr", { "data-candidate": c.name }, tbody);
  el("td", {}, tr, c.name);
  el("td", {}, tr, c.role);
  el("td", {}, tr, c.url);
  el("td", {}, tr, String(c.sample_rate));
  el("td", {}, tr, c.paused ? "paused" : "mirroring");
  el("td", {}, tr, String(c.queued));
  el("td", {}, tr, String(c.in_flight));
  const td = el("td", {}, tr);
  const reasons = el("td", {}, tr);
  if (report.error) {
    el("span", { class: "note" }, td, "no verdict");
    reasons.textContent = report.error;
  } else {
    verdictBadge(td, report.verdict);
    const shown = report.reasons.slice(0, TABLE_REASONS);
    const more = report.reasons.length - shown.length;
    reasons.textContent = shown.join("; ") + (more > 0 ? ` (and ${more} more, below)` : "");
  }
}

function showCandidateDetail(parent, c, report, dist) {
  const section = el("section", { class: "candidate", "data-candidate": c.name }, parent);
  const h = el("h2", {}, section, c.name + " ");
  if (!report.error) verdictBadge(h, report.verdict);
  if (report.error) {
    el("p", { class: "note" }, section, report.error);
  } else {
    const samples = Object.entries(report.samples || {}).map(([m, n]) => `${m} ${n}`).join(", ");
    const floor = c.role === "secondary" ? "this is the noise-floor replica: compared with the primary only"
      : `noise floor from ${report.noise_floor_from || "none (no secondary replica mirrored)"}`;
    el("p", { class: "note" }, section, `${floor}; samples: ${samples || "none"}`);
    if (report.reasons.length) {
      const box = el("details", {}, section);
      el("summary", {}, box, `Reasons (${report.reasons.length})`);
      const list = el("ul", {}, box);
      for (const reason of report.reasons) el("li", {}, list, reason);
    }
  }
  if (dist.error) {
    el("p", { class: "note" }, section, dist.error);
    return;
  }
  el("h3", {}, section, "Latency distributions");
  const lat = el("div", { class: "plots" }, section);
  if (!dist.latency.length) el("p", { class: "note" }, lat, "No latency scores stored yet.");
  for (const d of dist.latency) cdfPlot(lat, d, c.name);
  el("h3", {}, section, "Quality against the noise floor");
  const qual = el("div", { class: "plots" }, section);
  if (!dist.quality.length) el("p", { class: "note" }, qual, "No quality scores stored yet.");
  for (const q of dist.quality) histogramPlot(qual, q, c.name);
}

async function orError(promise) {
  try {
    return await promise;
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) throw err;
    return { error: err.message };
  }
}

// -- loading ------------------------------------------------------------------------------

async function load() {
  const content = document.getElementById("content");
  document.body.dataset.state = "loading";
  showMessage("Loading…", false);
  try {
    const routing = await api("/routing");
    const { candidates } = await api("/candidates");
    candidates.sort((a, b) => a.name.localeCompare(b.name));
    showRouting(routing);
    const tbody = document.querySelector("#candidate-table tbody");
    const details = document.getElementById("details");
    clear(tbody);
    clear(details);
    for (const [i, c] of candidates.entries()) {
      const name = encodeURIComponent(c.name);
      const report = await orError(api(`/candidates/${name}/report`));
      showCandidateRow(tbody, c, report);
      if (i < MAX_CANDIDATES) {
        const dist = await orError(api(`/candidates/${name}/distributions`));
        showCandidateDetail(details, c, report, dist);
      }
    }
    if (!candidates.length) el("tr", {}, tbody).appendChild(el("td", { colspan: "9" }, null, "No candidates are mirrored."));
    const drops = document.getElementById("drops");
    clear(drops);
    const traffic = await orError(api("/traffic"));
    if (traffic.error) el("p", { class: "note" }, drops, traffic.error);
    else dropsPlot(drops, traffic);
    content.hidden = false;
    showMessage("", false);
    document.body.dataset.state = "ready";
  } catch (err) {
    content.hidden = true;
    document.body.dataset.state = "error";
    if (err instanceof ApiError && err.status === 401) {
      const how = token() ? "The admin API refused this token (401: " + err.message + ")."
        : "This gateway's admin API needs a token (401).";
      showMessage(how + " Enter the admin token (admin.token, or UNDERSTUDY_ADMIN_TOKEN where the gateway runs) above.", true);
      document.body.dataset.state = "unauthorized";
      document.getElementById("token").focus();
    } else {
      showMessage("Could not load the scorecard: " + err.message, true);
    }
  }
}

function start() {
  takeTokenFromFragment();
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("token");
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    load();
  });
  document.getElementById("forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showMessage("Token forgotten for this tab.", false);
    document.getElementById("content").hidden = true;
  });
  document.getElementById("refresh").addEventListener("click", load);
  load();
}

document.addEventListener("DOMContentLoaded", start);
