// The evaluation pages: one evaluation's report (/ui/evaluations/{id}, /evaluations/{id}/report)
// and the leaderboard (/ui/evaluations). Plain JavaScript over the JSON API (/evaluations), with
// the helpers of rev88.js (window.rev88, loaded first).
"use strict";

(() => {
  const body = document.body;
  const { el, api, readJSON, problem, num, when, pill, facts, poller, initKey, initDownloads,
    pageDocument, wireCancel, short, taskURL, dash, progressText } = window.rev88;
  const $ = (selector) => document.querySelector(selector);
  const root = body.dataset.root || "";
  const reportURL = (id) => `${root}/ui/evaluations/${encodeURIComponent(id)}`;
  const pct = (x, digits = 3) => (typeof x === "number" ? `${(100 * x).toFixed(digits)} %` : dash);
  const changes = (c) => Object.entries(c || {}).map(([k, v]) => `${k}=${v}`).join(" ") || "default";

  // ------------------------------------------------------------------ one evaluation's report

  function energyText(e) {
    if (!e) return dash;
    if (typeof e.mj_per_task === "number") return `${num(e.mj_per_task)}${e.valid ? "" : " (not valid)"}`;
    return e.status === "succeeded" ? "no meter" : e.status;
  }

  function gatesText(e) {
    if (!e) return dash;
    if (e.valid === true) return "all passed";
    if (e.valid === false) {
      const failed = (e.failed_gates || []).join(", ");
      return failed ? `failed: ${failed}` : (e.predictions_match_task === false ? "predictions differ" : "failed");
    }
    return e.gates_reason ? "none (no meter)" : dash;
  }

  function drawRow(row) {
    const cell = (label, content, cls) => el("td", { "data-label": label, class: cls }, content);
    const status = el("span", {});
    pill(status, row.status);
    const counted = typeof row.correct === "number";
    return el("tr", { "data-draw": row.draw, "data-status": row.status, "data-correct": counted ? row.correct : null },
      cell("draw", el("a", { href: taskURL(row.task_id), title: row.task_id },
        typeof row.seed === "number" ? `${row.draw} · seed ${row.seed}` : String(row.draw)), "num"),
      cell("dataset seed", row.dataset_seed, "num"),
      cell("status", status),
      cell("correct / total", counted ? `${row.correct.toLocaleString("en")} / ${row.total.toLocaleString("en")}` : dash, "num"),
      cell("accuracy", counted ? pct(row.accuracy, 2) : dash, "num"),
      cell("run ms", num(row.run_ms), "num"),
      cell("mJ / task", energyText(row.energy), "num"),
      cell("gates", gatesText(row.energy)),
      cell("predictions sha256", row.predictions_sha256
        ? el("code", { class: "hash", title: row.predictions_sha256 }, short(row.predictions_sha256)) : dash));
  }

  function totalsFacts(data) {
    const t = data.totals;
    if (!t) {
      facts($("#totals"), [["status", data.status === "completed" ? "graded" : `${data.status}: not graded`]]);
      $("#bands").replaceChildren();
      return;
    }
    const [lo, hi] = t.pooled_accuracy_interval_95 || [];
    const sdText = t.sd_accuracy_pp === null ? "(one draw: no SD)" : `± ${num(t.sd_accuracy_pp, 2)} pp`;
    const time = data.time || {};
    const energy = data.energy;
    facts($("#totals"), [
      ["correct", t.correct_over_total],
      ["pooled accuracy", `${pct(t.pooled_accuracy)} (95 % interval ${pct(lo)} – ${pct(hi)})`],
      ["mean accuracy", `${num(t.mean_accuracy_percent, 3)} % ${sdText} over ${t.draws} draw(s)`],
      ["mean error", `${num(t.mean_error_percent, 3)} % (exactly ${t.mean_error_exact})`],
      ...(data.seeds && data.seeds.by_seed ? [["across seeds", `${data.seeds.seeds.length} seeds, each draw's `
        + `accuracy the mean of its seeds'; the seeds' means vary by ${data.seeds.sd_across_seeds_pp === null ? dash
          : `${num(data.seeds.sd_across_seeds_pp, 2)} pp (SD)`}`]] : []),
      ["time per task", time.ms_per_task === undefined ? dash
        : `${num(time.ms_per_task)} ms${time.ms_sd ? ` ± ${num(time.ms_sd)}` : ""} (${(time.clock || []).join(", ")})`],
      ["energy per task", energy === null || energy === undefined ? "not measured"
        : (energy.valid ? `${num(energy.mj_per_task)} mJ (every draw's gates passed)`
          : `not valid: ${energy.draws_valid} of ${data.draws.length} draws passed (${energy.reason})`)],
    ]);
    $("#bands").replaceChildren(...t.error_bands.map((b) => el("li", { class: b.met ? "met" : "not-met", "data-band": b.band_percent },
      `${b.band_percent} % ${b.met ? "met" : "not met"} (mean accuracy ≥ ${b.min_mean_accuracy_percent} %)`)));
  }

  let chartShown = null;
  async function showChart(id, data) {
    const img = $("#accuracy-chart");
    if (!data.totals || chartShown === id) return;
    const response = await api(`/evaluations/${encodeURIComponent(id)}/accuracy.svg`);
    if (!response.ok) return;
    img.src = URL.createObjectURL(await response.blob());
    img.hidden = false;
    $("#download-chart").hidden = false;
    $("#chart-note").hidden = true;
    chartShown = id;
  }

  function initEvaluation() {
    const id = body.dataset.evaluationId;
    const status = $("#evaluation-status"), message = $("#evaluation-message"), cancel = $("#evaluation-cancel");
    const say = (text, error) => { message.textContent = text; message.className = error ? "message error" : "message"; };
    const load = poller(async () => {
      const { data, retry } = await pageDocument(`/evaluations/${encodeURIComponent(id)}`, status, say);
      if (!data) return retry;
      const active = data.status === "queued" || data.status === "running";
      cancel.hidden = !active;
      $("#evaluation-name").textContent = data.name || "Evaluation";
      const c = data.counts;
      facts($("#evaluation-facts"), [
        ["draws", data.definition.draws.join(", ")],
        ...(data.definition.seeds ? [["seeds", data.definition.seeds.length > 12
          ? `${data.definition.seeds.length} (${data.definition.seeds[0]}…${data.definition.seeds.at(-1)})`
          : data.definition.seeds.join(", ")]] : []),
        ["config", changes(data.config_changes)],
        ["backend", `${data.backend.requested}${data.backend.used ? ` (used: ${data.backend.used.join(", ")})` : ""}`],
        ["device", data.device === null ? dash : String(data.device)],
        ["compared with", data.comparison || dash],
        ["progress", `${c.succeeded} succeeded, ${c.failed} failed, ${c.cancelled} cancelled, ${c.running} running, ${c.queued} queued`],
        ["created", when(data.created_at)],
        ["finished", when(data.finished_at)],
      ]);
      say(active ? `${data.status}… this page refreshes by itself` : "");
      totalsFacts(data);
      $("#draw-count").textContent = `(${data.draws.length})`;
      $("#draw-rows").replaceChildren(...data.draws.map(drawRow));
      await showChart(id, data);
      return active ? 1000 : null;
    });
    wireCancel(cancel, `/evaluations/${encodeURIComponent(id)}/cancel`, say, load);
  }

  // ------------------------------------------------------------------ the leaderboard

  // The rows not beaten on both axes: no other row at most as slow (or costly) and at least as
  // accurate, better on one. x: lower is better; y: higher is better.
  function paretoFront(points) {
    return points.filter((p) => !points.some((q) => q !== p && q.x <= p.x && q.y >= p.y && (q.x < p.x || q.y > p.y)));
  }

  // Accuracy against time (or energy) for one group, as wide as the board (``width`` px): round
  // ends on both axes, each point named when there are few; a single point (or points all alike on
  // an axis) gets a range around it, so that it sits on a drawn scale rather than in an empty box.
  function boardChart(rows, xName, width) {
    const key = xName === "energy" ? "mj_per_task" : "ms_per_task";
    const points = rows.filter((r) => typeof r[key] === "number" && typeof r.mean_accuracy === "number"
      && (xName !== "energy" || r.energy_valid))
      .map((r) => ({ x: r[key], y: 100 * r.mean_accuracy, row: r }));
    const box = el("div", { class: "sweep-chart board-chart" });
    if (!points.length) {
      box.append(el("p", { class: "muted", text: xName === "energy" ? "no evaluation with a valid energy figure" : "nothing graded yet" }));
      return box;
    }
    const front = new Set(paretoFront(points));
    const W = Math.max(300, Math.floor(width || 660)), H = W < 560 ? 240 : 280, P = 60, G = 20, R = W < 560 ? 24 : 60;
    const xs = points.map((p) => p.x), ys = points.map((p) => p.y);
    let xMin = Math.min(...xs), xMax = Math.max(...xs), yMin = Math.min(...ys), yMax = Math.max(...ys);
    if (xMax === xMin) { const pad = Math.abs(xMin) * 0.5 || 1; xMin = Math.max(0, xMin - pad); xMax += pad; }
    if (yMax === yMin) { yMin -= 0.5; yMax += 0.5; }  // (percentage points)
    const sx = (x) => P + G + ((x - xMin) / (xMax - xMin)) * (W - P - R - 2 * G);
    const sy = (y) => H - P - G - ((y - yMin) / (yMax - yMin)) * (H - 2 * P - 2 * G);
    const NS = "http://www.w3.org/2000/svg";
    const node = (tag, attrs, text) => {
      const n = document.createElementNS(NS, tag);
      for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
      if (text !== undefined) n.textContent = text;
      return n;
    };
    const svg = node("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "data-width": W });
    const xLabel = xName === "energy" ? "mJ per task" : "ms per task";
    svg.append(node("line", { x1: P, y1: H - P, x2: W - R, y2: H - P, class: "axis" }),
      node("line", { x1: P, y1: P, x2: P, y2: H - P, class: "axis" }),
      node("text", { x: (P + W - R) / 2, y: H - 12, class: "axis-label", "text-anchor": "middle" }, xLabel),
      node("text", { x: 12, y: P - 14, class: "axis-label" }, "mean accuracy %"),
      node("text", { x: P - 6, y: sy(yMax) + 4, class: "tick", "text-anchor": "end" }, num(yMax, 3)),
      node("text", { x: P - 6, y: sy(yMin) + 4, class: "tick", "text-anchor": "end" }, num(yMin, 3)),
      node("text", { x: sx(xMin), y: H - P + 16, class: "tick", "text-anchor": "middle" }, num(xMin)),
      node("text", { x: sx(xMax), y: H - P + 16, class: "tick", "text-anchor": "middle" }, num(xMax)));
    const frontLine = [...front].sort((a, b) => a.x - b.x);
    svg.append(node("polyline", { points: frontLine.map((p) => `${sx(p.x)},${sy(p.y)}`).join(" "), class: "pareto-line series-1" }));
    const named = points.length <= 3;  // (a few points: each named beside it)
    for (const p of points) {
      const onFront = front.has(p);
      if (named) {  // beside its point, on the side with room (the far side from the nearer edge), else above it
        const text = `${p.row.name || p.row.id.slice(0, 11)}: ${num(p.y, 3)} %, ${num(p.x)} ${xName === "energy" ? "mJ" : "ms"}`;
        const wide = 6.8 * text.length;  // (12px text: an upper estimate of its width)
        const x0 = sx(p.x), y0 = sy(p.y);
        const fitsRight = x0 + 10 + wide <= W - 4, fitsLeft = x0 - 10 - wide >= P + 6;
        const preferRight = x0 <= (P + W - R) / 2 + 1;
        let x = x0 + 10, y = y0 + 4;
        if (!(fitsRight && (preferRight || !fitsLeft))) {
          if (fitsLeft) x = x0 - 10 - wide;
          else { x = Math.max(4, Math.min(x0 - wide / 2, W - 4 - wide)); y = y0 - 12; }
        }
        svg.append(node("text", { x, y, class: "point-label" }, text));
      }
      const dot = node("circle", { cx: sx(p.x), cy: sy(p.y), r: onFront ? 6 : 4, class: onFront ? "point pareto series-1" : "point series-0",
        "data-id": p.row.id, "data-pareto": onFront ? "true" : "false" });
      dot.append(node("title", {}, `${p.row.name || p.row.id}: ${num(p.y, 3)} %, ${num(p.x)} ${xName === "energy" ? "mJ" : "ms"}${onFront ? " (Pareto front)" : ""}`));
      svg.append(dot);
    }
    box.append(svg, el("p", { class: "hint", text: "Large red points, joined by the dashed line: the Pareto front "
      + "(no other row of this group is both at least as accurate and at least as fast"
      + (xName === "energy" ? ", or as frugal" : "") + ", and better in one)." }));
    return box;
  }

  function boardRow(row, rank) {
    const cell = (label, content, cls) => el("td", { "data-label": label, class: cls }, content);
    const energy = typeof row.mj_per_task === "number" && row.energy_valid ? num(row.mj_per_task)
      : (row.measure ? "not valid" : dash);
    const sdText = typeof row.sd_accuracy_pp === "number" ? ` ± ${num(row.sd_accuracy_pp, 2)}` : "";
    const status = el("span", {});
    pill(status, row.status);
    return el("tr", { "data-id": row.id, "data-status": row.status, "data-rank": rank },
      cell("rank", rank === null ? dash : rank, "num"),
      cell("name", el("a", { href: reportURL(row.id), title: row.id }, row.name || row.id.slice(0, 11))),
      cell("status", status),
      cell("draws", (row.draw_set || row.draws.join(",")) + (row.seed_set ? ` × seeds ${row.seed_set}` : ""), "num"),
      cell("config", changes(row.config_changes)),
      cell("backend", row.backend),
      cell("correct", row.correct_over_total
        || el("span", { class: "muted", "data-progress": "" }, progressText(row.counts)), "num"),
      cell("mean ± SD", typeof row.mean_accuracy === "number" ? `${num(100 * row.mean_accuracy, 3)} %${sdText}` : dash, "num"),
      cell("ms / task", num(row.ms_per_task), "num"),
      cell("mJ / task", energy, "num"),
      cell("created", when(row.created_at)));
  }

  function boardGroup(label, rows, xName, width) {
    const graded = rows.filter((r) => r.status === "completed");
    let rank = 0;
    const table = el("table", { class: "tasks board-table" },
      el("thead", {}, el("tr", {}, ...["rank", "name", "status", "draws", "config", "backend", "correct",
        "mean ± SD", "ms / task", "mJ / task", "created"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...rows.map((r) => boardRow(r, r.status === "completed" ? (rank += 1) : null))));
    const n = rows[0].draws.length;
    return el("section", { class: "board-group", "data-comparison": label, "data-draws": rows[0].draw_set },
      el("h3", {}, ...(label === "" ? ["not graded yet"]
        : [label, " ", el("span", { class: "muted" }, `(${n} draw${n === 1 ? "" : "s"} each, ranked among themselves)`)])),
      el("div", { class: "table-wrap" }, table), graded.length ? boardChart(graded, xName, width) : null);
  }

  function initLeaderboard() {
    const message = $("#board-message"), sortBox = $("#board-sort"), xBox = $("#board-x");
    const say = (text, error) => { message.textContent = text; message.className = error ? "message error" : "message"; };
    const load = poller(async () => {
      const rows = [];
      let cursor = null, pages = 0;
      do {  // every page (the server's pages are 500 rows at most; ten of them here)
        const query = new URLSearchParams({ sort: sortBox.value, limit: "500" });
        if (cursor) query.set("cursor", cursor);
        const response = await api(`/evaluations?${query}`, { headers: { Accept: "application/json" } });
        const { data } = await readJSON(response);
        if (!response.ok || !data) { say(problem(response, data), true); return response.status === 401 ? null : 5000; }
        rows.push(...data.evaluations);
        cursor = data.next_cursor;
        pages += 1;
      } while (cursor && pages < 10);
      // one group per device, versions and draws (row.comparison): rows are ranked only within
      // their group; the groups over more draws first, the ones not graded yet last
      const groups = new Map();
      for (const row of rows) {
        const label = row.status === "completed" ? (row.comparison || `unknown device · draws ${row.draw_set}`
          + (row.seed_set ? ` · seeds ${row.seed_set}` : "")) : "";
        if (!groups.has(label)) groups.set(label, []);
        groups.get(label).push(row);
      }
      const order = ([label, list]) => (label === "" ? -1 : list[0].draws.length);
      const ordered = [...groups.entries()].sort((a, b) => order(b) - order(a));
      const width = $("#board-groups").clientWidth;
      $("#board-groups").replaceChildren(...ordered.map(([label, list]) => boardGroup(label, list, xBox.value, width)));
      $("#board-count").textContent = `(${rows.length})`;
      say(rows.length ? "" : "no evaluations yet: POST /evaluations, or rev88 evaluate --url");
      return rows.some((r) => r.status === "queued" || r.status === "running") ? 2000 : null;
    });
    sortBox.addEventListener("change", load);
    xBox.addEventListener("change", load);
    let resized = null, shownWidth = $("#board-groups").clientWidth;  // the charts follow the board's width
    window.addEventListener("resize", () => {
      clearTimeout(resized);
      resized = setTimeout(() => {
        if ($("#board-groups").clientWidth !== shownWidth) { shownWidth = $("#board-groups").clientWidth; load(); }
      }, 200);
    });
    initKey(load);
    initDownloads((text) => say(text, true));
    load();
  }

  if (body.dataset.page === "evaluation") initEvaluation();
  else if (body.dataset.page === "evaluations") initLeaderboard();
})();
