// The sweep page (/ui/sweeps/{id}): what the sweep is (name, dataset, base config, grid, seeds,
// backend, device), its cells' progress and table, and a chart of accuracy (or run time) against
// the first swept parameter. Plain JavaScript over the JSON API (/sweeps/{id}), with the helpers
// of rev88.js (window.rev88, loaded first).
"use strict";

(() => {
  const body = document.body;
  const { el, num, when, pill, facts, poller, pageDocument, wireCancel, short, taskURL, dash,
    progressText } = window.rev88;
  const $ = (selector) => document.querySelector(selector);

  const mean = (xs) => xs.reduce((a, b) => a + b, 0) / xs.length;
  const sd = (xs) => {
    if (xs.length < 2) return 0;
    const m = mean(xs);
    return Math.sqrt(xs.reduce((a, b) => a + (b - m) ** 2, 0) / (xs.length - 1));
  };
  const pairs = (object) => Object.entries(object || {}).map(([k, v]) => `${k}=${v}`).join(" ");
  const unique = (values) => [...new Set(values.filter((v) => v !== null && v !== undefined && v !== ""))];

  // The swept keys: the grid's, in its order (the seeds are averaged over).
  function sweptKeys(doc) {
    return Object.keys((doc.definition && doc.definition.grid) || {});
  }

  function seedsText(seeds) {
    if (Array.isArray(seeds)) return `${seeds.join(", ")} (${seeds.length})`;
    if (seeds && typeof seeds === "object") return `${seeds.start} to ${seeds.start + seeds.count - 1} (${seeds.count})`;
    return "0 (the default)";
  }

  // Points of the chart: x = the first swept key's value, one series per value of the second
  // (one series when there is none), y = mean ± SD over the seeds of accuracy in % (or run ms).
  function chartSeries(doc) {
    const keys = sweptKeys(doc);
    const rows = doc.cells.filter((r) => r.status === "succeeded");
    const labelled = rows.some((r) => typeof r.accuracy === "number");
    const value = (r) => (labelled ? (typeof r.accuracy === "number" ? 100 * r.accuracy : null) : r.timing && r.timing.run_ms);
    const xKey = keys[0] || "seed", groupKey = keys[1];
    const groups = new Map();
    for (const row of rows) {
      const y = value(row);
      if (typeof y !== "number") continue;
      const g = groupKey ? `${groupKey}=${row.config[groupKey]}` : "all cells";
      const x = xKey === "seed" ? "all seeds" : row.config[xKey];
      if (!groups.has(g)) groups.set(g, new Map());
      const points = groups.get(g);
      if (!points.has(x)) points.set(x, []);
      points.get(x).push(y);
    }
    const series = [...groups.entries()].map(([name, points]) => ({
      name,
      points: [...points.entries()].map(([x, ys]) => ({ x, mean: mean(ys), sd: sd(ys), n: ys.length })),
    }));
    return { series, xKey, yName: labelled ? "accuracy" : "run ms", yUnit: labelled ? "%" : "ms" };
  }

  // Round ticks (steps of 1, 2, 2.5 or 5 times a power of ten) from below ``lo`` to above ``hi``,
  // about ``count`` of them, and the decimals that show each step exactly.
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) {
      const pad = Math.abs(lo) * 0.005 || 0.5;
      lo -= pad; hi += pad;
    }
    const raw = (hi - lo) / count;
    const power = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw * 0.999);
    const first = Math.floor(lo / step + 1e-9) * step, last = Math.ceil(hi / step - 1e-9) * step;
    const ticks = [];
    for (let i = 0; first + i * step <= last + step / 2; i += 1) ticks.push(first + i * step);
    const digits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9) + (Math.round(step / power * 10) === 25 ? 1 : 0));
    return { ticks, digits, lo: first, hi: last };
  }

  const NS = "http://www.w3.org/2000/svg";
  function node(tag, attrs, text) {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
    if (text !== undefined) n.textContent = text;
    return n;
  }

  // The chart, as wide as its card: the grid's values evenly spaced on x (a grid is a list of
  // chosen values, often on a log scale), round y ticks with light grid lines, and the series
  // side by side around each x so that their error bars do not cover each other.
  function sweepChart(doc) {
    const { series, xKey, yName, yUnit } = chartSeries(doc);
    const box = $("#sweep-chart");
    $("#chart-title").textContent = `${yName} by ${xKey}`;
    box.replaceChildren();
    const all = series.flatMap((s) => s.points);
    if (!all.length) { box.append(el("p", { class: "muted", text: "no finished cells yet" })); return; }
    const W = Math.max(320, Math.floor(box.clientWidth || 640));
    const H = Math.round(Math.min(440, Math.max(260, W * 0.4)));
    const L = 70, R = 16, T = 14, B = 50;  // room for the y ticks, the x ticks and the x axis' name
    const xs = [...new Set(all.map((p) => p.x))].sort((a, b) => (typeof a === "number" && typeof b === "number" ? a - b : 0));
    const [floor, ceiling] = yUnit === "%" ? [0, 100] : [0, Infinity];  // (a bar is cut at what can be)
    const clamp = (v) => Math.min(ceiling, Math.max(floor, v));
    const y = niceTicks(clamp(Math.min(...all.map((p) => p.mean - p.sd))), clamp(Math.max(...all.map((p) => p.mean + p.sd))),
      W < 560 ? 4 : 6);
    const plotW = W - L - R, plotH = H - T - B;
    const slot = plotW / xs.length;
    const sx = (x) => L + slot * (xs.indexOf(x) + 0.5);
    const sy = (v) => T + plotH - ((v - y.lo) / (y.hi - y.lo)) * plotH;
    const spread = Math.min(16, slot / (series.length + 1));  // px between series at one x
    const dx = (i) => (i - (series.length - 1) / 2) * spread;
    const svg = node("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "data-width": W,
      "aria-label": `${yName} by ${xKey}` });
    for (const v of y.ticks) {
      svg.append(node("line", { x1: L, y1: sy(v), x2: W - R, y2: sy(v), class: "grid-line" }),
        node("text", { x: L - 8, y: sy(v) + 4, class: "tick y-tick", "text-anchor": "end" }, v.toFixed(y.digits)));
    }
    svg.append(node("line", { x1: L, y1: T + plotH, x2: W - R, y2: T + plotH, class: "axis" }),
      node("line", { x1: L, y1: T, x2: L, y2: T + plotH, class: "axis" }),
      node("text", { x: L + plotW / 2, y: H - 8, class: "axis-label", "text-anchor": "middle" }, xKey),
      node("text", { x: 14, y: T + plotH / 2, class: "axis-label", "text-anchor": "middle",
        transform: `rotate(-90 14 ${T + plotH / 2})` }, `${yName} (${yUnit})`));
    for (const x of xs) {
      svg.append(node("line", { x1: sx(x), y1: T + plotH, x2: sx(x), y2: T + plotH + 5, class: "axis" }),
        node("text", { x: sx(x), y: T + plotH + 20, class: "tick x-tick", "text-anchor": "middle" }, x));
    }
    series.forEach((s, i) => {
      const cls = `series series-${i % 6}`;
      const px = (p) => sx(p.x) + dx(i);
      const ordered = [...s.points].sort((a, b) => xs.indexOf(a.x) - xs.indexOf(b.x));
      svg.append(node("polyline", { points: ordered.map((p) => `${px(p)},${sy(p.mean)}`).join(" "), class: cls,
        "data-series": s.name }));
      for (const p of ordered) {
        const x = px(p), top = sy(clamp(p.mean + p.sd)), bottom = sy(clamp(p.mean - p.sd));
        svg.append(node("line", { x1: x, y1: top, x2: x, y2: bottom, class: `${cls} error-bar`, "data-x": p.x }),
          node("line", { x1: x - 4, y1: top, x2: x + 4, y2: top, class: `${cls} error-bar` }),
          node("line", { x1: x - 4, y1: bottom, x2: x + 4, y2: bottom, class: `${cls} error-bar` }));
        const dot = node("circle", { cx: x, cy: sy(p.mean), r: 4, class: cls, "data-x": p.x, "data-mean": p.mean,
          "data-n": p.n, "data-series": s.name });
        dot.append(node("title", {}, `${s.name}, ${xKey}=${p.x}: ${num(p.mean, 3)} ± ${num(p.sd, 3)} ${yUnit} `
          + `(${p.n} seed${p.n === 1 ? "" : "s"})`));
        svg.append(dot);
      }
    });
    box.append(svg, el("ul", { class: "chart-legend" }, ...series.map((s, i) => el("li", { "data-series": s.name },
      el("span", { class: `swatch swatch-${i % 6}` }), s.name))));
  }

  function cellRow(row, keys) {
    const cell = (label, content, cls) => el("td", { "data-label": label, class: cls }, content);
    const status = el("span", {});
    pill(status, row.status);
    const swept = keys.map((k) => `${k}=${row.config[k]}`).join(" ") || dash;
    return el("tr", { "data-task-id": row.task_id, "data-status": row.status },
      cell("task", el("a", { href: taskURL(row.task_id), class: "id", title: row.task_id }, row.task_id.slice(0, 8))),
      cell("status", status),
      cell("config", swept),
      cell("seed", row.config.seed, "num"),
      cell("accuracy", typeof row.accuracy === "number" ? `${num(100 * row.accuracy, 2)} %` : dash, "num"),
      cell("run ms", num(row.timing && row.timing.run_ms), "num"),
      cell("predictions sha256", row.predictions_sha256
        ? el("code", { class: "hash", title: row.predictions_sha256 }, short(row.predictions_sha256)) : dash));
  }

  function sweepFacts(data) {
    const definition = data.definition || {};
    const base = pairs(definition.config);
    const backends = unique(data.cells.map((c) => c.backend));
    const devices = unique(data.cells.map((c) => c.device));
    facts($("#sweep-facts"), [
      ["name", definition.name || dash],
      ["dataset", el("code", { class: "hash", title: data.dataset }, short(data.dataset))],
      ["base config", base ? `${base} (the rest: the defaults)` : "the defaults"],
      ["grid", Object.entries(definition.grid || {}).map(([k, v]) => `${k}: ${v.join(", ")}`).join("; ") || "none"],
      ["seeds", seedsText(definition.seeds)],
      ["backend", `${backends.join(", ") || dash}${definition.backend ? "" : " (the server's default)"}`],
      ["device", devices.join(", ") || "– (no cell has finished yet)"],
      ["cells", progressText(data.counts)],
      ["scores", definition.include_scores ? "kept with each cell's answer" : undefined],
      ["created", when(data.created_at)],
      ["cancelled", data.cancelled_at ? when(data.cancelled_at) : undefined],
    ]);
  }

  function initSweep() {
    const id = body.dataset.sweepId;
    const status = $("#sweep-status"), message = $("#sweep-message"), cancel = $("#sweep-cancel");
    const say = (text, error) => { message.textContent = text; message.className = error ? "message error" : "message"; };
    let shown = null;
    const load = poller(async () => {
      const { data, retry } = await pageDocument(`/sweeps/${encodeURIComponent(id)}`, status, say);
      if (!data) return retry;
      const active = data.status === "queued" || data.status === "running";
      cancel.hidden = !active;
      const name = data.definition && data.definition.name;
      $("#sweep-name").textContent = name ? `Sweep “${name}”` : "Sweep";
      sweepFacts(data);
      say(active ? `${data.status}… this page refreshes by itself` : "");
      const keys = sweptKeys(data);
      $("#cell-count").textContent = `(${data.cells.length})`;
      $("#cell-rows").replaceChildren(...data.cells.map((row) => cellRow(row, keys)));
      sweepChart(data);
      shown = data;
      return active ? 1000 : null;
    });
    let resized = null;  // the chart follows the card's width
    window.addEventListener("resize", () => {
      clearTimeout(resized);
      resized = setTimeout(() => { if (shown) sweepChart(shown); }, 150);
    });
    wireCancel(cancel, `/sweeps/${encodeURIComponent(id)}/cancel`, say, load);
  }

  if (body.dataset.page === "sweep") initSweep();
})();
