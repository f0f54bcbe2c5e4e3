// The built-in witcert dashboard: renders the panels the collector describes at api/layout with
// the rows api/panels/<key> returns (the same SQL as the Grafana dashboard). Read-only.
// In a report (`witcert report`) the same answers are embedded as window.WITCERT_REPORT: nothing is
// fetched, the selection is fixed, nothing refreshes.
"use strict";

const GRID_ROW_PX = 30; // Grafana's grid row height: panel heights are in these units
const REFRESH_MS = 30000;
const PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#fade2a"];

const state = { layout: null, charts: [], timer: null, generation: 0 };
// A link may fix the first view: ?from=&to= (unix seconds), tau, and model / instance as lists in
// the API's form (items percent-encoded, joined by commas). `witcert demo` prints such a link.
const LINKED = new URLSearchParams(location.search);
const EMBEDDED = window.WITCERT_REPORT || null;

function linkedValues(variable) {
  if (EMBEDDED) return EMBEDDED.selection[variable.name] || null;
  const text = LINKED.get(variable.name);
  if (!text) return null;
  return variable.multi ? text.split(",").map(decodeURIComponent) : [text];
}

function formatValue(value, unit) {
  if (value === "+Inf") return "\u221e";
  if (value === null || value === undefined || Number.isNaN(value)) return "\u2013";
  switch (unit) {
    case "percentunit": return percent(value);
    case "Bps": return compact(value) + "B/s";
    case "s": return value < 1 ? (1000 * value).toFixed(0) + " ms" : value.toFixed(2) + " s";
    case "none": return String(value);
    default: return compact(value);
  }
}

// A share as a percentage that never reads as 100% or 0% unless it is exactly that: digits are added
// until the rounded text differs from the bound it is close to.
function percent(value) {
  let digits = Math.abs(value) < 0.01 ? 3 : 1;
  let text = (100 * value).toFixed(digits);
  while (digits < 6 && ((value !== 1 && Number(text) === 100) || (value !== 0 && Number(text) === 0))) {
    digits += 1;
    text = (100 * value).toFixed(digits);
  }
  return text + "%";
}

function compact(value) {
  const magnitude = Math.abs(value);
  if (magnitude !== 0 && magnitude < 0.01) return value.toExponential(1);
  for (const [limit, suffix] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (magnitude >= limit) return (value / limit).toFixed(1) + suffix;
  }
  return Number.isInteger(value) ? String(value) : value.toPrecision(3);
}

// A colour for value in [min, max]: red to green when higher is better, the reverse otherwise.
function colorFor(value, min, max, higherIsBetter) {
  if (typeof value !== "number") return value === "+Inf" ? "#f2495c" : "#444";
  const span = max > min ? max - min : 1;
  let t = Math.min(1, Math.max(0, (value - min) / span));
  if (!higherIsBetter) t = 1 - t;
  const hue = Math.round(120 * t); // 0 = red, 120 = green
  return `hsl(${hue}, 65%, 48%)`;
}

function query() {
  const form = document.getElementById("controls");
  const params = new URLSearchParams();
  if (EMBEDDED) return params;
  if (form.range.value === "linked") {
    params.set("from", LINKED.get("from"));
    params.set("to", LINKED.get("to"));
  } else {
    const now = Math.floor(Date.now() / 1000);
    params.set("from", String(now - Number(form.range.value)));
    params.set("to", String(now));
  }
  // Grafana derives a panel's interval from its width in pixels; half the window is a typical panel.
  params.set("points", String(Math.min(2000, Math.max(100, Math.round(window.innerWidth / 2)))));
  // Lists travel as one parameter: items percent-encoded, then joined by commas.
  for (const select of document.querySelectorAll("#variables select")) {
    const values = Array.from(select.selectedOptions, (option) => option.value).filter((v) => v !== "");
    if (values.length) params.set(select.name, select.multiple ? values.map(encodeURIComponent).join(",") : values[0]);
  }
  return params;
}

async function fetchJson(url) {
  if (EMBEDDED) {
    const path = url.split("?")[0];
    if (path === "api/layout") return EMBEDDED.layout;
    return EMBEDDED.panels[decodeURIComponent(path.slice("api/panels/".length))];
  }
  const response = await fetch(url, { headers: { Accept: "application/json" } });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return body;
}

function renderVariables(variables) {
  const holder = document.getElementById("variables");
  const previous = {};
  for (const select of holder.querySelectorAll("select")) {
    previous[select.name] = Array.from(select.selectedOptions, (option) => option.value);
  }
  holder.replaceChildren();
  for (const variable of variables) {
    const label = document.createElement("label");
    label.title = variable.description;
    label.append(variable.label + " ");
    const select = document.createElement("select");
    select.name = variable.name;
    select.multiple = variable.multi;
    const kept = previous[variable.name] || linkedValues(variable) || [variable.default];
    const options = [...variable.options];
    // A single-value variable (tau) accepts any positive number, not only the listed ones.
    if (!variable.multi && kept[0] && !options.includes(kept[0])) options.push(kept[0]);
    for (const value of options) {
      const option = new Option(value, value, kept.includes(value), kept.includes(value));
      select.append(option);
    }
    select.disabled = Boolean(EMBEDDED);
    select.addEventListener("change", () => refresh(false));
    label.append(select);
    holder.append(label);
  }
}

// Panel titles may name a variable (${tau}), as Grafana titles do.
function withVariables(text) {
  return text.replace(/\$\{(\w+)\}/g, (whole, name) => {
    const select = document.querySelector(`#variables select[name="${name}"]`);
    return select && select.value ? select.value : whole;
  });
}

function renderSections(panels) {
  const main = document.getElementById("sections");
  main.replaceChildren();
  const sections = new Map();
  for (const panel of panels) {
    if (!sections.has(panel.section)) {
      const heading = document.createElement("h2");
      heading.textContent = panel.section;
      const grid = document.createElement("div");
      grid.className = "grid";
      main.append(heading, grid);
      sections.set(panel.section, grid);
    }
    const box = document.createElement("section");
    box.className = "panel";
    box.id = "panel-" + panel.key;
    box.dataset.kind = panel.kind;
    box.style.gridColumn = `span ${panel.width}`;
    const title = document.createElement("h3");
    title.textContent = withVariables(panel.title);
    title.title = panel.description;
    const body = document.createElement("div");
    body.className = "body";
    body.style.minHeight = `${(panel.height - 1) * GRID_ROW_PX}px`;
    box.append(title, body);
    sections.get(panel.section).append(box);
  }
}

function renderStat(panel, body, data) {
  const rows = data.results[0].rows;
  const value = rows.length ? rows[0][0] : null;
  const div = document.createElement("div");
  div.className = "stat";
  div.textContent = formatValue(value, panel.unit);
  div.dataset.value = String(value);
  div.style.background = colorFor(value, panel.min ?? 0, panel.max ?? 1, panel.higherIsBetter);
  body.replaceChildren(div);
  return value !== null;
}

// An interval (at least, at most, exact): one figure when both ends agree, otherwise "between a and b",
// labelled as the bucket-derived interval it is; coloured by its worse end.
function renderInterval(panel, body, data) {
  const rows = data.results[0].rows;
  if (!rows.length || rows[0][0] === null || rows[0][1] === null) return false;
  const [low, high, exact] = rows[0];
  const div = document.createElement("div");
  div.className = "stat";
  div.dataset.atLeast = String(low);
  div.dataset.atMost = String(high);
  const note = document.createElement("div");
  note.className = "note";
  if (low === high) {
    div.textContent = formatValue(low, panel.unit);
    note.textContent = exact ? "" : "sampled steps only (histogram)";
  } else {
    div.className = "stat range";
    div.textContent = `between ${formatValue(low, panel.unit)} and ${formatValue(high, panel.unit)}`;
    note.textContent = exact ? "" : "an interval from the sampled histogram, not a point value";
  }
  const worse = panel.higherIsBetter ? low : high;
  div.style.background = colorFor(worse, panel.min ?? 0, panel.max ?? 1, panel.higherIsBetter);
  body.replaceChildren(div, note);
  return true;
}

// Long rows (time, labels..., values...) -> uPlot's columnar data, one series per label set and value.
function toSeries(panel, data) {
  const times = new Set();
  const series = new Map();
  const multipleValues = panel.queries.length > 1
    || panel.queries.some((q) => q.columns.length - 1 - q.labels.length > 1);
  for (const result of data.results) {
    const labelCount = panel.queries.find((q) => q.refId === result.refId).labels.length;
    const valueColumns = result.columns.slice(1 + labelCount);
    for (const row of result.rows) {
      const time = row[0];
      times.add(time);
      const labels = row.slice(1, 1 + labelCount).join(" ");
      valueColumns.forEach((column, index) => {
        const name = [labels, multipleValues || !labels ? column : ""].filter(Boolean).join(" ");
        if (!series.has(name)) series.set(name, new Map());
        const value = row[1 + labelCount + index];
        series.get(name).set(time, typeof value === "number" ? value : null);
      });
    }
  }
  const xs = Array.from(times).sort((a, b) => a - b);
  const names = Array.from(series.keys()).sort();
  return { xs, names, columns: [xs, ...names.map((name) => xs.map((x) => series.get(name).get(x) ?? null))] };
}

// Fixed bounds where the panel has them; otherwise the data's, widened so a flat line (all zero
// fallbacks, say) still gets a readable axis.
function yRange(panel, min, max) {
  const low = panel.min ?? (min ?? 0);
  let high = panel.max ?? (max ?? 1);
  const smallest = panel.unit === "percentunit" ? 0.01 : 1;
  if (!(high - low >= smallest * 1e-3)) high = low + smallest;
  return [low, high];
}

function renderTimeseries(panel, body, data) {
  const { xs, names, columns } = toSeries(panel, data);
  if (!xs.length) return false;
  const width = Math.max(200, body.clientWidth);
  const height = (panel.height - 2) * GRID_ROW_PX;
  const options = {
    width,
    height,
    // The x axis spans the requested range, not just the data, so gaps read as gaps.
    scales: {
      x: { time: true, range: () => [data.from, data.to] },
      y: { range: (u, min, max) => yRange(panel, min, max) },
    },
    axes: [
      { stroke: "#8e8e8e", grid: { stroke: "#2c3235" } },
      { stroke: "#8e8e8e", grid: { stroke: "#2c3235" }, size: 60, values: (u, ticks) => ticks.map((t) => formatValue(t, panel.unit)) },
    ],
    series: [{}, ...names.map((name, index) => ({
      label: name,
      stroke: PALETTE[index % PALETTE.length],
      width: 1.5,
      spanGaps: false,
      value: (u, v) => formatValue(v, panel.unit),
    }))],
  };
  body.replaceChildren();
  state.charts.push(new uPlot(options, columns, body));
  return true;
}

function renderMatrix(panel, body, data) {
  const rows = data.results[0].rows;
  if (!rows.length) return false;
  const layers = Array.from(new Set(rows.map((r) => r[0]))).sort((a, b) => a - b);
  const heads = Array.from(new Set(rows.map((r) => r[1]))).sort((a, b) => a - b);
  const cells = new Map(rows.map((r) => [`${r[0]}:${r[1]}`, r[2]]));
  const finite = rows.map((r) => r[2]).filter((v) => typeof v === "number");
  const min = panel.min ?? Math.min(...finite);
  const max = panel.max ?? Math.max(...finite);
  const table = document.createElement("table");
  table.className = "matrix";
  const header = table.insertRow();
  header.append(Object.assign(document.createElement("th"), { textContent: "layer \\ head" }));
  for (const head of heads) header.append(Object.assign(document.createElement("th"), { textContent: head }));
  for (const layer of layers) {
    const tr = table.insertRow();
    tr.append(Object.assign(document.createElement("th"), { textContent: layer }));
    for (const head of heads) {
      const value = cells.get(`${layer}:${head}`);
      const td = tr.insertCell();
      td.textContent = value === undefined ? "" : formatValue(value, panel.unit);
      if (value !== undefined) td.dataset.value = String(value);
      td.style.background = value === undefined ? "transparent" : colorFor(value, min, max, panel.higherIsBetter);
      td.title = `layer ${layer}, head ${head}: ${td.textContent}`;
    }
  }
  body.replaceChildren(table);
  return true;
}

const RENDERERS = { stat: renderStat, interval: renderInterval, timeseries: renderTimeseries, matrix: renderMatrix };

async function loadPanel(panel, params, generation) {
  const box = document.getElementById("panel-" + panel.key);
  const body = box.querySelector(".body");
  try {
    const data = await fetchJson(`api/panels/${encodeURIComponent(panel.key)}?${params}`);
    if (generation !== state.generation) return;
    const filled = RENDERERS[panel.kind](panel, body, data);
    box.dataset.state = filled ? "filled" : "empty";
    if (!filled) body.replaceChildren(Object.assign(document.createElement("div"), { className: "empty", textContent: "No data in this range" }));
  } catch (error) {
    box.dataset.state = "error";
    body.replaceChildren(Object.assign(document.createElement("div"), { className: "error", textContent: error.message }));
  }
}

async function refresh(reloadLayout) {
  const generation = ++state.generation;
  const status = document.getElementById("status");
  document.body.dataset.state = "loading";
  try {
    if (reloadLayout || !state.layout) {
      state.layout = await fetchJson(`api/layout?${query()}`);
      renderVariables(state.layout.variables);
    }
    for (const chart of state.charts) chart.destroy();
    state.charts = [];
    renderSections(state.layout.panels);
    const params = query();
    await Promise.all(state.layout.panels.map((panel) => loadPanel(panel, params, generation)));
    if (generation !== state.generation) return;
    const failed = document.querySelectorAll('.panel[data-state="error"]').length;
    status.className = failed ? "error" : "";
    const updated = EMBEDDED ? "" : `Updated ${new Date().toLocaleTimeString()}`;
    status.textContent = failed ? `${failed} panel(s) failed` : updated;
    document.body.dataset.state = "ready";
  } catch (error) {
    status.className = "error";
    status.textContent = error.message;
    document.body.dataset.state = "error";
  }
}

function schedule() {
  clearInterval(state.timer);
  if (document.getElementById("controls").auto.checked) state.timer = setInterval(() => refresh(true), REFRESH_MS);
}

function start() {
  if (EMBEDDED) {
    refresh(true);
    return;
  }
  if (LINKED.get("from") && LINKED.get("to")) {
    const range = document.getElementById("controls").range;
    range.add(new Option("as linked", "linked", true, true));
  }
  document.getElementById("controls").addEventListener("submit", (event) => {
    event.preventDefault();
    refresh(true);
  });
  document.getElementById("controls").range.addEventListener("change", () => refresh(true));
  document.getElementById("controls").auto.addEventListener("change", schedule);
  refresh(true);
  schedule();
}

start();
