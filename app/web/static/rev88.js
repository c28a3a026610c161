// The rev88 web page: plain JavaScript, no build step, no libraries.
// The HTML carries no data; everything here comes from the JSON API of the same origin
// (/tasks, /tasks/{id}, /health), with the API key typed into the page sent as Bearer.
"use strict";

(() => {
  const body = document.body;
  const root = body.dataset.root || "";
  const KEY = "rev88.apiKey";
  const ACTIVE = new Set(["queued", "running"]);
  const ACTIVE_MESSAGE = new Set(["waiting", "pending"]);  // a webhook message not yet settled
  const $ = (selector) => document.querySelector(selector);

  // ------------------------------------------------------------------ helpers

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function storedKey() {
    try { return localStorage.getItem(KEY) || ""; } catch (e) { return ""; }
  }

  function storeKey(value) {
    try {
      if (value) localStorage.setItem(KEY, value); else localStorage.removeItem(KEY);
      return true;
    } catch (e) { return false; }
  }

  function api(path, options = {}) {
    const headers = new Headers(options.headers || {});
    const key = storedKey();
    if (key) headers.set("Authorization", "Bearer " + key);
    return fetch(root + path, { ...options, headers, cache: "no-store", credentials: "same-origin" });
  }

  // JSON with exact big integers (seeds go up to 2**63 - 1): where the browser hands the
  // reviver the number's source text, unsafe integers are kept as that text.
  function parseJSON(text) {
    return JSON.parse(text, (key, value, context) => {
      if (typeof value === "number" && Number.isInteger(value) && !Number.isSafeInteger(value)
          && context && typeof context.source === "string") return context.source;
      return value;
    });
  }

  async function readJSON(response) {
    const text = await response.text();
    let data = null;
    try { data = parseJSON(text); } catch (e) { data = null; }
    return { text, data };
  }

  function problem(response, data) {
    const said = data && data.error ? data.error : `HTTP ${response.status}`;
    if (response.status === 401) return `${said} — enter this server's API key at the top and press Save.`;
    return said;
  }

  const dash = "–";
  function num(value, digits) {
    if (value === null || value === undefined || value === "") return dash;
    const n = Number(value);
    if (!Number.isFinite(n)) return String(value);
    if (digits !== undefined) return n.toFixed(digits);
    const a = Math.abs(n);
    if (a === 0) return "0";
    if (a >= 1000) return n.toFixed(0);
    if (a >= 100) return n.toFixed(1);
    if (a >= 1) return n.toFixed(2);
    return n.toPrecision(3);
  }
  const ms = (value) => (value === null || value === undefined ? dash : `${num(value)} ms`);

  function when(unix) {
    if (unix === null || unix === undefined) return dash;
    const d = new Date(Number(unix) * 1000);
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} `
      + `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function bytes(n) {
    if (n === null || n === undefined) return dash;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = Number(n), i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return `${i ? v.toFixed(1) : v} ${units[i]}`;
  }

  function pill(node, status) {
    node.textContent = status;
    node.className = `pill status-${String(status).replace(/[^a-z-]/g, "")}`;
  }

  const taskURL = (id) => `${root}/ui/tasks/${encodeURIComponent(id)}`;
  const sweepURL = (id) => `${root}/ui/sweeps/${encodeURIComponent(id)}`;
  const short = (hash) => (hash ? `${hash.slice(0, 12)}…` : dash);

  // "3 of 24 finished (2 succeeded, 1 failed) · 1 running · 20 queued": a sweep's cells or an
  // evaluation's draws, from the counts by task status GET /sweeps and GET /evaluations give.
  function progressText(counts) {
    const c = counts || {};
    const n = (k) => Number(c[k] || 0);
    const total = ["queued", "running", "succeeded", "failed", "cancelled"].reduce((a, k) => a + n(k), 0);
    const finished = n("succeeded") + n("failed") + n("cancelled");
    const ended = ["succeeded", "failed", "cancelled"].filter((k) => n(k)).map((k) => `${n(k)} ${k}`).join(", ");
    const parts = [`${finished} of ${total} finished${ended ? ` (${ended})` : ""}`];
    if (n("running")) parts.push(`${n("running")} running`);
    if (n("queued")) parts.push(`${n("queued")} queued`);
    return parts.join(" · ");
  }

  function facts(list, pairs) {
    list.replaceChildren();
    for (const [name, value] of pairs) {
      if (value === undefined) continue;
      list.append(el("dt", { text: name }), el("dd", {}, value instanceof Node ? value : String(value)));
    }
  }

  // A timer that can be re-armed (a fresh load cancels the pending one).
  function poller(load) {
    let timer = null;
    const run = async () => {
      clearTimeout(timer);
      let next = null;
      try { next = await load(); } catch (e) { next = 5000; console.warn(e); }
      if (next) timer = setTimeout(run, next);
    };
    return run;
  }

  // ------------------------------------------------------------------ the API key field

  function initKey(onChange) {
    const form = $("#key-form"), input = $("#api-key"), state = $("#key-state");
    const show = () => {
      const saved = storedKey();
      state.textContent = saved ? "saved in this browser" : (body.dataset.auth === "required" ? "needed" : "");
      state.removeAttribute("data-key-name");
      if (saved && body.dataset.auth === "required") whoAmI(state);
    };
    input.value = storedKey();
    show();
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      if (!storeKey(input.value.trim())) state.textContent = "this browser refuses to store it";
      else show();
      onChange();
    });
  }

  // Which key the page sends (GET /key) and what it used today (GET /usage?days=1).
  async function whoAmI(state) {
    try {
      const me = await api("/key", { headers: { Accept: "application/json" } });
      const { data } = await readJSON(me);
      if (!me.ok || !data) { state.textContent = `key refused: ${problem(me, data)}`; return; }
      const usage = await api("/usage?days=1", { headers: { Accept: "application/json" } });
      const { data: used } = await readJSON(usage);
      const rows = (usage.ok && used && used.usage) || [];
      const mine = rows.filter((r) => data.admin || r.tenant === data.id);
      const tasks = mine.reduce((a, r) => a + r.tasks, 0), secs = mine.reduce((a, r) => a + r.device_seconds, 0);
      state.dataset.keyName = data.name;
      state.textContent = `key ${data.name} (${data.scopes.join(", ")})${data.admin ? ", admin" : ""} · today `
        + `${tasks} task${tasks === 1 ? "" : "s"}, ${num(secs)} device s${data.admin ? " (all tenants)" : ""}`;
    } catch (e) { console.warn(e); }
  }

  // ------------------------------------------------------------------ downloads (with the key)

  // The links work as plain links too; clicking fetches with the Bearer key and saves the body.
  function initDownloads(onError) {
    document.addEventListener("click", async (event) => {
      const link = event.target.closest("a[data-download]");
      if (!link || event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey) return;
      event.preventDefault();
      const response = await api(new URL(link.href).pathname.slice(root.length), {
        headers: link.id === "download-json" ? { Accept: "application/json" } : {},
      });
      if (!response.ok) {
        const { data } = await readJSON(response);
        onError(`download failed: ${problem(response, data)}`);
        return;
      }
      const blob = await response.blob();
      const url = URL.createObjectURL(blob);
      const save = el("a", { href: url, download: link.getAttribute("download") || "" });
      document.body.append(save);
      save.click();
      save.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60000);
    });
  }

  // ------------------------------------------------------------------ the index page

  const INTEGER = /^[+-]?[0-9]+$/;
  const DECIMAL = /^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$/;

  // The config overrides as JSON text; integers are written digit for digit (no float rounding).
  function configJSON(form) {
    const parts = [];
    for (const input of form.querySelectorAll("fieldset.config input")) {
      const text = input.value.trim();
      input.removeAttribute("aria-invalid");
      if (!text) continue;
      let value;
      if (input.dataset.integer === "true") {
        if (!INTEGER.test(text)) { input.setAttribute("aria-invalid", "true"); throw new Error(`${input.name} must be a whole number`); }
        value = BigInt(text).toString();
      } else {
        if (!DECIMAL.test(text) || !Number.isFinite(Number(text))) {
          input.setAttribute("aria-invalid", "true");
          throw new Error(`${input.name} must be a number`);
        }
        value = JSON.stringify(Number(text));
      }
      parts.push(`${JSON.stringify(input.name)}:${value}`);
    }
    return parts.length ? `{${parts.join(",")}}` : null;
  }

  function taskRow(task) {
    const cell = (label, content, cls) => el("td", { "data-label": label, class: cls }, content);
    const link = el("a", { href: taskURL(task.id), class: "id", title: task.id }, task.id.slice(0, 8));
    const status = el("span", {});
    pill(status, task.status);
    const hash = task.predictions_sha256
      ? el("code", { title: task.predictions_sha256, class: "hash" }, short(task.predictions_sha256)) : dash;
    const sweep = task.options && task.options.sweep;
    const evaluation = task.options && task.options.evaluation;
    const taskCell = sweep || evaluation
      ? el("span", {}, link, " ", sweep
        ? el("a", { href: sweepURL(sweep), class: "sweep-link", title: sweep }, "sweep")
        : el("a", { href: `${root}/ui/evaluations/${encodeURIComponent(evaluation)}`, class: "sweep-link evaluation-link",
          title: evaluation }, "evaluation"))
      : link;
    return el("tr", { "data-task-id": task.id, "data-status": task.status },
      cell("task", taskCell),
      cell("status", status),
      cell("created", when(task.created_at)),
      cell("train", task.train_count, "num"),
      cell("queries", task.test_count, "num"),
      cell("backend", task.kind === "measure" ? `${task.backend} (measure)` : task.backend),
      cell("run ms", num(task.run_ms), "num"),
      cell("energy J", num(task.energy_j), "num"),
      cell("predictions sha256", hash));
  }

  // The grid's keys and value counts and the seeds, in a few words: "learning_rate (4) × depth (2) × 3 seeds".
  function gridText(definition) {
    const grid = Object.entries((definition && definition.grid) || {}).map(([k, v]) => `${k} (${v.length})`);
    const seeds = definition && definition.seeds;
    const count = Array.isArray(seeds) ? seeds.length : seeds && typeof seeds === "object" ? seeds.count : 1;
    return [...grid, `${count} seed${count === 1 ? "" : "s"}`].join(" × ");
  }

  function sweepRow(sweep) {
    const cell = (label, content, cls) => el("td", { "data-label": label, class: cls }, content);
    const status = el("span", {});
    pill(status, sweep.status);
    const name = sweep.definition && sweep.definition.name;
    return el("tr", { "data-sweep-id": sweep.id, "data-status": sweep.status },
      cell("sweep", el("a", { href: sweepURL(sweep.id), title: sweep.id }, name || sweep.id.slice(0, 11))),
      cell("status", status),
      cell("cells", progressText(sweep.counts)),
      cell("grid × seeds", gridText(sweep.definition)),
      cell("dataset", el("code", { class: "hash", title: sweep.dataset }, short(sweep.dataset))),
      cell("created", when(sweep.created_at)));
  }

  function initIndex() {
    const form = $("#task-form"), result = $("#submit-result"), button = $("#submit");
    const tbody = $("#tasks-body"), message = $("#tasks-message"), empty = $("#tasks-empty");

    const loadSweeps = poller(async () => {
      const response = await api("/sweeps?limit=20");
      const { data } = await readJSON(response);
      const said = $("#sweeps-message");
      if (!response.ok || !data) {
        said.textContent = problem(response, data);
        said.className = "message error";
        return response.status === 401 ? null : 5000;
      }
      said.textContent = "";
      said.className = "message";
      $("#sweeps-body").replaceChildren(...data.sweeps.map(sweepRow));
      $("#sweeps-count").textContent = data.sweeps.length ? `(${data.sweeps.length}${data.next_cursor ? "+" : ""})` : "";
      $("#sweeps-empty").hidden = data.sweeps.length > 0;
      return data.sweeps.some((s) => ACTIVE.has(s.status)) ? 2000 : 10000;
    });

    const loadTasks = poller(async () => {
      const response = await api("/tasks?limit=25");
      const { data } = await readJSON(response);
      if (!response.ok || !data) {
        message.textContent = problem(response, data);
        message.className = "message error";
        return response.status === 401 ? null : 5000;
      }
      message.textContent = "";
      message.className = "message";
      tbody.replaceChildren(...data.tasks.map(taskRow));
      empty.hidden = data.tasks.length > 0;
      return data.tasks.some((t) => ACTIVE.has(t.status)) ? 1000 : 10000;
    });

    const loadHealth = poller(async () => {
      const response = await api("/health");
      const { data } = await readJSON(response);
      renderHealth(data, response);
      return 5000;
    });

    initKey(() => { loadTasks(); loadSweeps(); loadHealth(); });
    $("#refresh").addEventListener("click", () => { loadTasks(); loadSweeps(); });

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      result.className = "result";
      const file = $("#task-file").files[0];
      if (!file) { result.className = "result error"; result.textContent = "choose a task npz first"; return; }
      let config;
      try { config = configJSON(form); } catch (e) { result.className = "result error"; result.textContent = e.message; return; }
      const data = new FormData();
      data.append("file", file, file.name);
      if (config) data.append("config", config);
      const query = new URLSearchParams();
      const backend = $("#backend").value;
      if (backend) query.set("backend", backend);
      const asynchronous = form.elements.mode.value === "async";
      const headers = asynchronous ? { Prefer: "respond-async" } : {};
      button.disabled = true;
      result.textContent = asynchronous ? "uploading…" : "uploading and training…";
      const started = performance.now();
      setTimeout(loadTasks, 300); // show it queued/running while we wait
      try {
        const response = await api(`/tasks${query.toString() ? "?" + query : ""}`, { method: "POST", body: data, headers });
        const { data: answer } = await readJSON(response);
        const seconds = ((performance.now() - started) / 1000).toFixed(2);
        result.replaceChildren();
        if ((response.status === 200 || response.status === 202) && answer && answer.id) {
          const link = el("a", { href: taskURL(answer.id), id: "submitted-link" }, "open its page");
          if (response.status === 200) {
            result.className = "result ok";
            result.append(`succeeded in ${seconds} s (run ${ms(answer.timing && answer.timing.run_ms)}): `,
              el("code", { class: "hash", title: answer.predictions_sha256 }, short(answer.predictions_sha256)), " — ", link);
          } else {
            result.className = "result ok";
            result.append(`accepted as ${answer.status} (task ${answer.id.slice(0, 8)}) — `, link);
          }
          result.dataset.taskId = answer.id;
        } else {
          result.className = "result error";
          result.textContent = `${response.status}: ${problem(response, answer)}`;
        }
      } catch (e) {
        result.className = "result error";
        result.textContent = `the upload failed: ${e.message}`;
      } finally {
        button.disabled = false;
        loadTasks();
        loadHealth();
      }
    });

    loadTasks();
    loadSweeps();
    loadHealth();
  }

  function renderHealth(doc, response) {
    const status = $("#health-status"), out = $("#health-body");
    if (!doc || !doc.queue) {
      pill(status, "unreachable");
      out.replaceChildren(el("p", { class: "error" }, doc && doc.error ? doc.error : `HTTP ${response.status}`));
      return;
    }
    pill(status, doc.status);
    const gpu = doc.gpu;
    const gpuText = gpu
      ? [gpu.name, gpu.temperature_c != null ? `${gpu.temperature_c} °C` : null,
        gpu.power_w != null ? `${num(gpu.power_w)} W${gpu.power_limit_w ? ` of ${num(gpu.power_limit_w)}` : ""}` : null,
        gpu.utilization_percent != null ? `${gpu.utilization_percent}% busy` : null,
        gpu.memory_used_bytes != null ? `${bytes(gpu.memory_used_bytes)} / ${bytes(gpu.memory_total_bytes)}` : null,
        gpu.graphics_clock_mhz != null ? `${gpu.graphics_clock_mhz} MHz` : null].filter(Boolean).join(" · ")
      : `none: ${doc.gpu_reason || "not reported"}`;
    const q = doc.queue;
    const running = q.running ? `${q.running.kind} ${String(q.running.id).slice(0, 8)} for ${num(q.running.seconds)} s` : "idle";
    const ledger = doc.ledger && doc.ledger.ok
      ? Object.entries(doc.ledger.tasks || {}).map(([k, v]) => `${v} ${k}`).join(", ")
      : (doc.ledger ? `unavailable: ${doc.ledger.error}` : dash);
    const energy = doc.energy
      ? (doc.energy.per_request ? `per request (idle ${num(doc.energy.idle_baseline_w)} W)`
        : (doc.energy.reason === doc.gpu_reason ? "none (no GPU, see above)" : `none: ${doc.energy.reason}`))
      : dash;
    const list = el("dl", { class: "facts" });
    facts(list, [
      ["ready", doc.ready ? "yes" : "no"],
      ["device", doc.device],
      ["backend", doc.backend],
      ["GPU", gpuText],
      ["energy", energy],
      ["queue", `${q.depth} waiting of ${q.capacity} · ${q.running_jobs} running · ${running}`],
      ["since start", `${q.completed} completed · ${q.failed} failed · ${q.cancelled} cancelled · ${q.refused_full} refused (full)`],
      ["in the ledger", ledger],
      ["uptime", `${num(doc.uptime_s, 0)} s`],
      ["versions", Object.entries(doc.versions || {}).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`).join(" · ")],
    ]);
    const workers = el("table", { class: "workers" },
      el("thead", {}, el("tr", {}, ...["worker", "state", "tasks", "launches", "busy s"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...(q.workers || []).map((w) => el("tr", {},
        el("td", {}, w.device),
        el("td", {}, w.busy ? `busy: ${String(w.running && w.running.id).slice(0, 8)}` : "idle"),
        el("td", { class: "num" }, w.tasks),
        el("td", { class: "num" }, w.launches),
        el("td", { class: "num" }, num(w.busy_seconds))))));
    const shared = doc.ledger && doc.ledger.engine && doc.ledger.engine !== "sqlite";
    const note = el("p", { class: "hint health-note" }, "Since start: the runs this server process has finished on "
      + "its devices since it started (its warm-up runs too). In the ledger: every task recorded and still kept, "
      + `from before a restart as well${shared ? " and from every replica that shares it" : ""}; so the two differ.`);
    out.replaceChildren(list, note, el("h3", {}, "Workers ", el("span", { class: "muted" }, doc.workers ? doc.workers.rule || "" : "")),
      el("div", { class: "table-wrap" }, workers));
  }

  // ------------------------------------------------------------------ the task page

  function timingChart(timing) {
    const t = (name) => (typeof timing[name] === "number" ? Math.max(0, timing[name]) : 0);
    const total = Math.max(t("total_ms"), 1e-9);
    const device = t("device_ms");
    const phases = [
      ["receive", t("receive_ms"), "receive"],
      ["parse + validate", t("parse_ms"), "parse"],
      ["queue wait", t("queue_wait_ms"), "queue"],
      ["on the device", device, "device"],
    ];
    const rows = [];
    let at = 0;
    for (const [label, value, cls] of phases) {
      rows.push({ label, value, cls, start: at });
      if (cls === "device" && typeof timing.run_ms === "number") {
        rows.push({ label: "of which run", value: Math.min(timing.run_ms, device || timing.run_ms), cls: "run", start: at });
      }
      at += value;
    }
    rows.push({ label: "answer + ledger", value: Math.max(0, t("total_ms") - at), cls: "rest", start: at });
    rows.push({ label: "total", value: t("total_ms"), cls: "total", start: 0 });
    const chart = $("#timing-chart");
    chart.replaceChildren(...rows.map((row) => {
      const bar = el("span", { class: `bar ${row.cls}` });
      bar.style.marginLeft = `${Math.min(100, (100 * row.start) / total)}%`;
      bar.style.width = `${Math.min(100, (100 * row.value) / total)}%`;
      return el("div", { class: "bar-row", "data-phase": row.cls },
        el("span", { class: "bar-label" }, row.label),
        el("span", { class: "bar-track" }, bar),
        el("span", { class: "bar-value" }, ms(row.value)));
    }));
    $("#timing-total").textContent = `${ms(timing.total_ms)} in all${timing.run_clock ? ` · run clock: ${timing.run_clock}` : ""}`;
  }

  function energyBlock(answer) {
    const out = $("#energy-body");
    const energy = answer.energy;
    if (!energy) {
      out.replaceChildren(el("p", { class: "muted" }, `No figure: ${answer.energy_reason || "not measured"}`));
      return;
    }
    const rows = Object.entries(energy).filter(([, v]) => v === null || typeof v !== "object");
    const headline = energy.gross_j !== undefined
      ? el("p", { class: "big" }, `${num(energy.gross_j)} J`,
        energy.idle_adjusted_j != null ? el("span", { class: "muted" }, ` · ${num(energy.idle_adjusted_j)} J above idle`) : null)
      : null;
    out.replaceChildren(...[headline, el("table", { class: "kv" }, ...rows.map(([k, v]) =>
      el("tr", {}, el("th", { text: k }), el("td", {}, typeof v === "number" ? num(v) : String(v)))))].filter(Boolean));
  }

  function hashBlock(answer) {
    const meta = answer.metadata || {};
    const pairs = [
      ["predictions", answer.predictions_sha256],
      ["scores", answer.scores_sha256],
      ["state vector", meta.state_vector_sha256],
      ...Object.entries(meta.input_hashes || {}).map(([k, v]) => [`input ${k}`, v]),
    ].filter(([, v]) => v);
    const list = $("#hash-list");
    list.replaceChildren();
    for (const [name, value] of pairs) {
      list.append(el("dt", { text: name }), el("dd", {}, el("code", { class: "hash", "data-hash": name }, value)));
    }
  }

  function configBlock(answer) {
    const meta = answer.metadata || answer.measurement || {};
    const config = meta.config || {};
    const extra = [["backend", meta.backend], ["device", meta.device || answer.device], ["dtype", meta.dtype],
      ["parameters", meta.parameter_count],
      ["versions", Object.entries(answer.versions || meta.versions || {}).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`).join(" · ")]];
    $("#config-table").replaceChildren(
      ...Object.entries(config).map(([k, v]) => el("tr", {}, el("th", { text: k }), el("td", { class: "mono" }, String(v)))),
      ...extra.filter(([, v]) => v !== undefined && v !== "").map(([k, v]) => el("tr", { class: "meta" }, el("th", { text: k }), el("td", {}, String(v)))));
  }

  function predictionBlock(answer) {
    const predictions = Array.isArray(answer.predictions) ? answer.predictions : [];
    const counts = new Array(10).fill(0);
    for (const p of predictions) if (p >= 0 && p < 10) counts[p] += 1;
    const most = Math.max(1, ...counts);
    $("#predictions-count").textContent = `${predictions.length} queries`;
    $("#prediction-histogram").replaceChildren(...counts.map((count, digit) => {
      const bar = el("span", { class: "column-bar" });
      bar.style.height = `${(100 * count) / most}%`;
      return el("div", { class: "column", title: `${count} predicted ${digit}` },
        el("span", { class: "column-count" }, count), el("span", { class: "column-track" }, bar), el("span", { class: "column-label" }, digit));
    }));
    const shown = predictions.slice(0, 120).join(" ");
    $("#prediction-list").textContent = predictions.length > 120 ? `${shown} … (${predictions.length - 120} more)` : shown;
  }

  // A task's webhook messages (GET /tasks/<id>/deliveries): one row each, its last attempt's
  // status or error beside its state. Hidden for a task without a webhook.
  async function webhookBlock(id) {
    const section = $("#webhooks"), rows = $("#webhooks-body");
    let log;
    try {
      const response = await api(`/tasks/${encodeURIComponent(id)}/deliveries`);
      if (!response.ok) return;
      log = await response.json();
    } catch (error) {
      return;  // (the page's own load says what is wrong with the server)
    }
    section.hidden = !log.messages.length;
    rows.replaceChildren(...log.messages.map((m) => {
      const last = m.attempts.length ? m.attempts[m.attempts.length - 1] : null;
      const result = last ? (last.status_code != null ? `${last.status_code}` : last.error || "") : "";
      const state = el("span", { class: "pill" });
      pill(state, m.state);
      return el("tr", { "data-state": m.state, "data-message-id": m.id },
        el("td", { text: m.event }), el("td", { text: m.type || dash }), el("td", { class: "mono", text: m.url }),
        el("td", {}, state),
        el("td", { text: `${m.attempt_count}${result ? ` (last: ${result})` : ""}` }), el("td", { text: m.next }));
    }));
  }

  function initTask() {
    const id = body.dataset.taskId;
    const status = $("#task-status"), message = $("#task-message"), list = $("#task-facts");
    const cancel = $("#cancel"), npy = $("#download-npy"), json = $("#download-json");
    const say = (text, error) => { message.textContent = text; message.className = error ? "message error" : "message"; };

    const load = poller(async () => {
      const { data, retry } = await pageDocument(`/tasks/${encodeURIComponent(id)}`, status, say);
      if (!data) return retry;
      const active = ACTIVE.has(data.status);
      cancel.hidden = !active;
      const succeeded = data.status === "succeeded";
      npy.hidden = !(succeeded && Array.isArray(data.predictions));
      json.hidden = !succeeded;
      for (const section of document.querySelectorAll("[data-when=answer]")) section.hidden = !succeeded;
      if (succeeded) {
        const meta = data.metadata || {};
        const timing = data.timing || {};
        say(data.measure ? "the energy measurement is done" : "");
        facts(list, [
          ["kind", data.measure ? `measure (${data.measure})` : "task"],
          ["backend", meta.backend || (data.measurement && data.measurement.backend)],
          ["device", data.device],
          ["train / queries", meta.train_count !== undefined ? `${meta.train_count} / ${meta.test_count}` : undefined],
          ["run", timing.run_ms !== undefined ? ms(timing.run_ms) : undefined],
          ["total", ms(timing.total_ms)],
          ["energy", data.energy && data.energy.gross_j != null ? `${num(data.energy.gross_j)} J` : "none"],
          ["predictions sha256", el("code", { class: "hash", id: "predictions-sha256" }, data.predictions_sha256 || dash)],
        ]);
        timingChart(timing);
        energyBlock(data);
        hashBlock(data);
        configBlock(data);
        predictionBlock(data);
        await webhookBlock(id);
        const waiting = [...document.querySelectorAll("#webhooks-body tr")].some(
          (row) => ACTIVE_MESSAGE.has(row.dataset.state));
        return waiting ? 2000 : null;  // (a message still to be delivered: look again)
      }
      const error = data.error && data.error.error;
      say(active ? `${data.status}… this page refreshes by itself` : (error || data.status), !active && data.status !== "succeeded");
      const seconds = (a, b) => (a && b ? `${num(b - a)} s` : undefined);
      facts(list, [
        ["kind", data.kind], ["mode", data.mode], ["backend", data.backend], ["device", data.device || dash],
        ["train / queries", `${data.train_count} / ${data.test_count}`],
        ["created", when(data.created_at)], ["started", when(data.started_at)], ["finished", when(data.finished_at)],
        ["waited", seconds(data.created_at, data.started_at)], ["attempts", data.attempts],
        ["upload", data.body_sha256 ? `${bytes(data.body_bytes)} · sha256 ${short(data.body_sha256)}`
                                    : `${bytes(data.body_bytes)} · body not hashed (its input hashes name the arrays)`],
        ["config", Object.entries(data.config || {}).map(([k, v]) => `${k}=${v}`).join(" ")],
      ]);
      await webhookBlock(id);
      return active ? 1000 : null;
    });

    wireCancel(cancel, `/tasks/${encodeURIComponent(id)}/cancel`, say, load);
  }

  // A task's, sweep's or evaluation's page for an id the server does not know: only the message and
  // the ways back (the page's own cards, its downloads and chart, hidden by body[data-missing]).
  // A later load that finds it (another key saved) shows the page again.
  function showMissing(text) {
    let card = $("#missing");
    if (!card) {
      card = el("section", { class: "card missing", id: "missing" });
      $("main").append(card);
    }
    const what = { task: "task", sweep: "sweep", evaluation: "evaluation" }[body.dataset.page] || "page";
    card.replaceChildren(el("h2", {}, `No such ${what}`), el("p", { class: "message error" }, text),
      el("p", { class: "ways" }, el("a", { href: `${root}/` }, "← the tasks"), " · ",
        el("a", { href: `${root}/ui/evaluations` }, "leaderboard"), " · ", el("a", { href: `${root}/docs` }, "API docs")));
    body.dataset.missing = "true";
  }

  // The document a task's or a sweep's page shows, its status pill set; or, with nothing to show,
  // what went wrong said and when to try again (null: not at all, for a 401 or a 404).
  async function pageDocument(path, status, say) {
    const response = await api(path, { headers: { Accept: "application/json" } });
    const { data } = await readJSON(response);
    if (!response.ok || !data) {
      pill(status, response.status === 404 ? "not found" : "error");
      if (response.status === 404) showMissing(problem(response, data));
      else say(problem(response, data), true);
      return { data: null, retry: response.status === 401 || response.status === 404 ? null : 5000 };
    }
    delete body.dataset.missing;
    pill(status, data.status);
    body.dataset.status = data.status;
    return { data };
  }

  // A Cancel button that POSTs ``path``, says what went wrong, and loads the page again; then the
  // key field, the downloads and the first load (what a task's and a sweep's page share).
  function wireCancel(button, path, say, load) {
    button.addEventListener("click", async () => {
      button.disabled = true;
      const response = await api(path, { method: "POST" });
      const { data } = await readJSON(response);
      if (!response.ok) say(`cancel: ${problem(response, data)}`, true);
      button.disabled = false;
      load();
    });
    initKey(load);
    initDownloads((text) => say(text, true));
    load();
  }

  // What the evaluation pages' and the sweep page's scripts (static/evaluations.js, static/sweep.js,
  // loaded after this one) share.
  window.rev88 = { el, api, readJSON, problem, num, when, pill, facts, poller, initKey, initDownloads,
    pageDocument, wireCancel, short, taskURL, dash, progressText };

  if (body.dataset.page === "index") initIndex();
  else if (body.dataset.page === "task") initTask();
  else if (!["sweep", "evaluation", "evaluations"].includes(body.dataset.page)) initKey(() => {});
})();
