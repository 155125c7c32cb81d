// asyncrl view: fetches the run folder's data from the server and draws it with Plotly.
"use strict";

const PALETTE = ["#cfe3ff", "#ffe0b3", "#d4f0d0", "#f7d0e6", "#e6dcff", "#fff3b0", "#cdeff2", "#f2d5cc"];
// Several runs on one page: ?run=INDEX picks one (asyncrl view A B, or runs sharing a generator).
const RUN = Number(new URLSearchParams(location.search).get("run") || 0);
const state = { ended: false, byTime: false, curves: null };
const layout = (extra) => Object.assign({ margin: { l: 48, r: 12, t: 8, b: 36 }, legend: { orientation: "h" } }, extra);
const config = { displaylogo: false, responsive: true };

async function get(path) {
  const response = await fetch(path + (path.includes("?") ? "&" : "?") + "run=" + RUN);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function note(lines) {
  const box = document.getElementById("notes");
  box.classList.toggle("hidden", lines.length === 0);
  box.innerHTML = lines.map((l) => `<div>${escapeHtml(l)}</div>`).join("");
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function x(c) { return state.byTime ? c.wall_s : c.step; }

function drawCurves(c) {
  const xTitle = state.byTime ? "training seconds" : "step";
  const axis = { xaxis: { title: { text: xTitle } } };
  Plotly.react("chart-reward", [{ x: x(c), y: c.reward, name: "reward", mode: "lines" }],
    layout(Object.assign({ yaxis: { title: { text: "mean reward" } } }, axis)), config);
  const ex = state.byTime ? c.eval.wall_s : c.eval.step;
  const evalTraces = [{ x: ex, y: c.eval["pass@1"], name: "pass@1", mode: "lines+markers" }];
  if (c.eval.k) evalTraces.push({ x: ex, y: c.eval["pass@k"], name: c.eval.k, mode: "lines+markers" });
  Plotly.react("chart-eval", evalTraces, layout(Object.assign({
    yaxis: { range: [0, 1] },
    annotations: c.eval.step.length ? [] : [{ text: "no held-out evaluation in this run (eval.every_steps)", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }],
  }, axis)), config);
  const rates = [{ x: x(c), y: c.rates.trained, name: "trained (learner)", mode: "lines" }];
  if (c.rates.generated.some((v) => v !== null)) rates.push({ x: x(c), y: c.rates.generated, name: "generated (generators)", mode: "lines" });
  Plotly.react("chart-throughput", rates, layout(Object.assign({ yaxis: { title: { text: `samples/s, last ${c.rates.window} steps` } } }, axis)), config);
  const waits = ["wait_rollouts_s", "wait_buffer_s", "wait_housekeeping_s", "wait_other_s"];
  Plotly.react("chart-wait", waits.map((k) => ({ x: x(c), y: c[k], name: k.replace("wait_", "").replace("_s", ""), stackgroup: "w" })),
    layout(Object.assign({ yaxis: { title: { text: "seconds per step" } } }, axis)), config);
  const s = c.staleness;
  Plotly.react("chart-staleness", s.levels.map((level, i) => ({ x: s.step, y: s.counts[i], name: `staleness ${level}`, type: "bar" })),
    layout({ barmode: "stack", xaxis: { title: { text: "step" } }, yaxis: { title: { text: "rollouts" } } }), config);
  const reasons = Object.keys(c.drops);
  Plotly.react("chart-drops", [{ x: reasons, y: reasons.map((r) => c.drops[r]), type: "bar" }],
    layout({ annotations: reasons.length ? [] : [{ text: "nothing dropped", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }] }), config);
}

function kv(id, entries) {
  document.getElementById(id).innerHTML = entries
    .map(([k, v]) => `<dt>${escapeHtml(k)}</dt><dd>${escapeHtml(typeof v === "number" ? +v.toFixed(4) : typeof v === "string" ? v : JSON.stringify(v))}</dd>`).join("");
}

async function refresh() {
  const overview = await get("api/overview");
  document.getElementById("run-name").textContent = overview.name || "asyncrl view";
  state.ended = overview.ended;
  document.getElementById("run-state").textContent = !overview.exists ? "no such folder" : overview.ended ? "ended" : "running (updates every 3 s)";
  const missing = Object.entries(overview.missing || {}).map(([f, what]) => `missing ${f}: ${what}`);
  note([...(overview.notes || []), ...missing]);
  if (!overview.exists) return;
  state.curves = await get("api/curves");
  drawCurves(state.curves);
  const pipeline = await get("api/pipeline");
  kv("pipeline-summary", pipeline.summary ? Object.entries(pipeline.summary) : [["state", "running: totals come when it ends"]]);
  kv("pipeline-weights", Object.entries(pipeline.weights || {}).filter(([, v]) => v !== null && v !== undefined));
  kv("pipeline-step", Object.entries(pipeline.latest_step || {}));
  drawLive(pipeline.live);
}

function drawLive(s) {
  const box = document.getElementById("pipeline-live");
  if (!s) {
    box.innerHTML = `<p>${state.ended ? "The run has ended." : "The learner does not answer (still starting, or stopped)."}</p>`;
    return;
  }
  const elapsed = Math.max(1e-9, s.now_s - s.started_s);
  const rows = s.generators.map((g) => `<tr><td>${escapeHtml(g.generator_id)}</td><td>${g.state}</td><td>v${g.weight_version}</td>
    <td>${g.samples_generated}</td><td>${(100 * g.busy_s / elapsed).toFixed(0)}%</td><td>${g.seen_s_ago.toFixed(1)} s</td></tr>`).join("");
  const buffer = Object.entries(s.buffer).map(([k, v]) => `${escapeHtml(k)} ${+v.toFixed(3)}`).join(", ");
  box.innerHTML = `<dl class="kv"><dt>step</dt><dd>${s.step} of ${s.total_steps}, policy v${s.version}</dd>
    <dt>in flight</dt><dd>${s.in_flight} samples admitted, not yet trained (staleness bound ${s.max_staleness})</dd>
    <dt>buffer</dt><dd>${buffer || "-"}</dd><dt>samples/s</dt><dd>${s.samples_per_s ? s.samples_per_s.toFixed(1) : "-"}</dd></dl>
    <table><thead><tr><th>generator</th><th>state</th><th>version</th><th>samples</th><th>busy</th><th>last heard</th></tr></thead>
    <tbody>${rows}</tbody></table>`;
}

async function loadEvalItem() {
  const index = document.getElementById("e-index").value || "0";
  const data = await get("api/eval_item/" + encodeURIComponent(index));
  const box = document.getElementById("eval-item");
  if (!data.versions.length) {
    box.innerHTML = `<p>No evaluation traces of prompt ${escapeHtml(index)} (eval/ holds one file per evaluated version).</p>`;
    return;
  }
  const prompt = data.versions[0].traces[0].prompt;
  const cell = (t) => `<div title="${escapeHtml(t.response)}">${escapeHtml(t.answer ?? t.response.slice(0, 40))} <b>${t.reward}</b></div>`;
  const rows = data.versions.map((v) => {
    const greedy = v.traces.filter((t) => t.greedy), sampled = v.traces.filter((t) => !t.greedy);
    return `<tr data-version="${v.version}"><td>v${v.version}</td><td>${greedy.map(cell).join("")}</td><td>${sampled.map(cell).join("")}</td></tr>`;
  }).join("");
  box.innerHTML = `<div class="prompt">${escapeHtml(prompt)}</div><table id="eval-table"><thead><tr><th>version</th>
    <th>greedy answer, reward</th><th>sampled answers, rewards</th></tr></thead><tbody>${rows}</tbody></table>`;
}

async function loadRollouts() {
  const params = new URLSearchParams();
  const step = document.getElementById("f-step").value;
  if (step) params.set("step", step);
  for (const [id, key] of [["f-min", "min_reward"], ["f-max", "max_reward"], ["f-stale", "staleness"], ["f-kept", "kept"], ["f-prompt", "prompt"]]) {
    const value = document.getElementById(id).value;
    if (value !== "") params.set(key, value);
  }
  const data = await get("api/rollouts?" + params);
  const select = document.getElementById("f-step");
  if (select.options.length <= 1) {
    for (const s of data.steps) select.add(new Option(s, s));
  }
  const kept = document.getElementById("f-kept");
  const listed = new Set([...kept.options].map((o) => o.value));
  for (const reason of data.drop_reasons || []) {
    if (!listed.has(reason)) kept.add(new Option(`dropped: ${reason}`, reason));
  }
  document.getElementById("rollout-count").textContent = `${data.rows.length + data.more} kept rollouts` + (data.more ? ` (first ${data.rows.length} shown)` : "");
  const body = document.querySelector("#rollout-table tbody");
  body.innerHTML = "";
  for (const row of data.rows) {
    const tr = document.createElement("tr");
    tr.className = "pick";
    tr.dataset.id = row.id;
    tr.dataset.at = row.at;
    tr.innerHTML = `<td>${row.step}</td><td>${(+row.reward).toFixed(3)}</td><td>${row.staleness}</td><td>${row.tokens}</td><td>${row.prompt_index}</td><td>${escapeHtml(row.drop_reason || "")}</td>`;
    tr.addEventListener("click", () => showRollout(row.id, tr, row.at));
    body.appendChild(tr);
  }
}

async function showRollout(id, row, at) {
  document.querySelectorAll("#rollout-table tr.chosen").forEach((r) => r.classList.remove("chosen"));
  if (row) row.classList.add("chosen");
  const r = await get("api/rollout/" + encodeURIComponent(id) + (at === undefined ? "" : "?at=" + at));
  const versions = [...new Set(r.tokens.map((t) => t.version))].sort((a, b) => a - b);
  const colour = (v) => PALETTE[versions.indexOf(v) % PALETTE.length];
  const multiTurn = r.tokens.some((t) => !t.mask);
  const tokens = r.tokens.map((t, i) => {
    const title = `token ${i}: ${JSON.stringify(t.text)} (id ${t.id})\nversion ${t.version}\nbehaviour log-prob ${t.logprob}\nlearner log-prob ${t.learner_logprob ?? "-"}\nadvantage ${t.advantage}\nloss mask ${t.mask}`;
    const turn = multiTurn && (i === 0 || t.mask !== r.tokens[i - 1].mask)
      ? `<span class="turn">${t.mask ? "model" : "environment (not trained on)"}</span>` : "";
    return `${turn}<span class="tok${t.mask ? "" : " env"}" data-version="${t.version}" data-id="${t.id}" style="background:${colour(t.version)}" title="${escapeHtml(title)}">${escapeHtml(t.text)}</span>`;
  }).join("");
  const legend = versions.map((v) => `<span style="background:${colour(v)}">v${v}</span>`).join("");
  document.getElementById("rollout-detail").innerHTML = `
    <dl class="kv"><dt>rollout</dt><dd id="detail-id">${escapeHtml(r.id)}</dd>
      <dt>${r.drop_reason ? "dropped before step" : "trained at step"}</dt><dd>${r.step} (its update made v${r.version})${r.drop_reason ? `: ${escapeHtml(r.drop_reason)}` : ""}</dd>
      <dt>reward</dt><dd>${r.reward}</dd><dt>staleness</dt><dd id="detail-staleness">${r.staleness}</dd>
      <dt>consumed.jsonl</dt><dd id="detail-consumed">${r.consumed ? `step ${r.consumed.step}, staleness ${r.consumed.staleness}` : "not found"}</dd>
      <dt>finish</dt><dd>${escapeHtml(r.finish_reason)}</dd></dl>
    <h3>Prompt</h3><div class="prompt">${escapeHtml(r.prompt)}</div>
    <h3>Response <span class="legend">${legend}</span></h3><div class="tokens" id="detail-tokens">${tokens}</div>`;
}

function show(view) {
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("on", b.dataset.view === view);
  for (const name of ["curves", "pipeline", "rollouts", "evaluation"]) document.getElementById("view-" + name).classList.toggle("hidden", name !== view);
  if (view === "rollouts") loadRollouts().catch((e) => note([String(e)]));
  if (view === "curves" && state.curves) drawCurves(state.curves);
}

document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => show(b.dataset.view)));
document.getElementById("e-apply").addEventListener("click", () => loadEvalItem().catch((e) => note([String(e)])));
document.getElementById("f-apply").addEventListener("click", () => loadRollouts().catch((e) => note([String(e)])));
document.getElementById("by-time").addEventListener("change", (e) => { state.byTime = e.target.checked; if (state.curves) drawCurves(state.curves); });

async function pickRun() {
  const runs = await get("api/runs");
  if (runs.length < 2) return;
  const select = document.getElementById("run-pick");
  for (const r of runs) select.add(new Option(r.name, r.index, false, r.index === RUN));
  select.classList.remove("hidden");
  select.addEventListener("change", () => { location.search = "?run=" + select.value; });
}

async function loop() {
  try { await refresh(); } catch (e) { note([String(e)]); }
  document.body.dataset.loaded = "1";
  if (!state.ended) setTimeout(loop, 3000);
}
pickRun().catch((e) => note([String(e)]));
loop();
