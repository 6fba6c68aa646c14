// rollouts view: the page of a run directory (training/viewer/site.py writes it).
// Data arrive as <script src="data/*.js"> files calling RV_DATA(kind, payload): file:// allows
// scripts, not fetch(). Every text of the run (prompts, responses, tool output, errors) is model
// or user output: it goes into the page through textContent only, never as HTML.
"use strict";

const RV = {
  manifest: null, steps: new Map(), waiting: new Map(), sft: null, sftWaiting: [],
  state: {}, live: location.protocol.startsWith("http"), pollMs: 2000,
};

function RV_DATA(kind, payload) {
  if (kind === "manifest") { RV.manifest = payload; onManifest(); }
  else if (kind === "step") {
    RV.steps.set(payload.step, payload);
    (RV.waiting.get(payload.step) || []).forEach((resolve) => resolve(payload));
    RV.waiting.delete(payload.step);
  } else if (kind === "sft") { RV.sft = payload; RV.sftWaiting.splice(0).forEach((r) => r(payload)); }
}
window.RV_DATA = RV_DATA;

// ----- small helpers ---------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.appendChild(typeof child === "string" || typeof child === "number"
      ? document.createTextNode(String(child)) : child);
  }
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  return x.toPrecision(digits || 3);
}

function pad6(n) { return String(n).padStart(6, "0"); }

function loadScript(src, onerror) {
  const s = document.createElement("script");
  s.src = src;
  s.onload = () => s.remove();
  s.onerror = () => { s.remove(); onerror && onerror(); };
  document.head.appendChild(s);
}

function loadStep(step) {
  if (RV.steps.has(step)) return Promise.resolve(RV.steps.get(step));
  return new Promise((resolve) => {
    if (RV.waiting.has(step)) { RV.waiting.get(step).push(resolve); return; }
    RV.waiting.set(step, [resolve]);
    loadScript("data/step_" + pad6(step) + ".js" + (RV.live ? "?v=" + Date.now() : ""), () => {
      RV.waiting.delete(step);
      resolve(null);
    });
  });
}

function loadSft() {
  if (RV.sft) return Promise.resolve(RV.sft);
  return new Promise((resolve) => { RV.sftWaiting.push(resolve); loadScript("data/sft_evals.js", () => resolve([])); });
}

// ----- state in the URL hash: #step=3&filter=failed&color=logprob ----------------------------

const DEFAULTS = { tab: "rollouts", step: "", filter: "all", color: "logprob", rmin: "", rmax: "",
  from: "", to: "", diff: "", sft: "" };

function readHash() {
  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  const state = {};
  for (const k of Object.keys(DEFAULTS)) state[k] = params.has(k) ? params.get(k) : DEFAULTS[k];
  return state;
}

function setState(changes) {
  const next = Object.assign({}, RV.state, changes);
  const params = new URLSearchParams();
  for (const [k, v] of Object.entries(next)) if (v !== DEFAULTS[k] && v !== "") params.set(k, v);
  const hash = "#" + params.toString();
  if (hash === location.hash || (hash === "#" && !location.hash)) { RV.state = next; render(); }
  else location.hash = hash; // hashchange renders
}

window.addEventListener("hashchange", () => { RV.state = readHash(); render(); });

// ----- filters ---------------------------------------------------------------------------------

function sampleMatches(s, st) {
  if (st.filter === "failed" && s.status !== "failed") return false;
  if (st.filter === "truncated" && s.status !== "truncated") return false;
  if (st.filter === "tools" && !s.tools.length) return false;
  if (st.rmin !== "" && !(s.reward !== null && s.reward >= Number(st.rmin))) return false;
  if (st.rmax !== "" && !(s.reward !== null && s.reward <= Number(st.rmax))) return false;
  return true;
}

function stepInRange(step, st) {
  return (st.from === "" || step >= Number(st.from)) && (st.to === "" || step <= Number(st.to));
}

function stepMayMatch(summary, st) {
  if (st.filter === "failed") return summary.failed > 0;
  if (st.filter === "truncated") return summary.truncated > 0;
  if (st.filter === "tools") return summary.tools > 0;
  return true;
}

function visibleSteps() {
  const st = RV.state;
  return (RV.manifest ? RV.manifest.steps : []).filter((s) => stepInRange(s.step, st) && stepMayMatch(s, st));
}

function currentStep() {
  const steps = visibleSteps();
  if (!steps.length) return null;
  const want = Number(RV.state.step);
  if (RV.state.step !== "" && steps.some((s) => s.step === want)) return want;
  return steps[steps.length - 1].step;
}

// ----- token colouring -------------------------------------------------------------------------

// [shade, css colour]: logprob: the hue, 0 (p = 0, red) … 120 (p = 1, green); mismatch: the
// level, 0 (|Δ logprob| ≤ 1e-6, white) … 1 (≥ 1 nat, red), on a log scale (numerics sit near
// 1e-7 … 1e-3, a wrong template or stale weights near 1).
function tokenColour(s, t, mode) {
  if (mode === "logprob" && s.lp.length && s.lp[t] !== null) {
    const hue = Math.round(120 * Math.exp(s.lp[t]));
    return [hue, "hsl(" + hue + ", 75%, 82%)"];
  }
  if (mode === "mismatch" && s.tlp && s.lp.length && s.tlp[t] !== null && s.lp[t] !== null) {
    const d = Math.abs(s.lp[t] - s.tlp[t]);
    const level = Math.max(0, Math.min(1, (Math.log10(Math.max(d, 1e-12)) + 6) / 6));
    return [level.toFixed(3), "hsl(0, 85%, " + Math.round(100 - 35 * level) + "%)"];
  }
  return null;
}

function tokenSpan(s, t, mode) {
  const lp = s.lp.length ? s.lp[t] : null;
  const parts = ["token " + s.ids[t]];
  if (lp !== null) parts.push("engine logprob " + fmt(lp, 4) + " (p " + fmt(Math.exp(lp), 3) + ")");
  if (s.tlp) parts.push("trainer logprob " + fmt(s.tlp[t], 4) + ", |Δ| " + fmt(Math.abs(lp - s.tlp[t]), 3));
  if (!s.mask[t]) parts.push("not trained (tool / environment token)");
  const span = el("span", { class: s.mask[t] ? "tok" : "tok env", title: parts.join(" · "),
    "data-lp": lp === null ? null : lp, "data-tlp": s.tlp ? s.tlp[t] : null, text: s.toks[t] });
  const colour = s.mask[t] ? tokenColour(s, t, mode) : null;
  if (colour) { span.dataset.shade = colour[0]; span.style.background = colour[1]; }
  return span;
}

// A response as turns: runs of model tokens (loss mask 1) and of tool / environment tokens (0).
function responseNode(s, mode) {
  const box = el("div", { class: "response" });
  if (!s.toks.length) { box.appendChild(el("span", { class: "legend", text: "(empty response)" })); return box; }
  const multi = s.mask.some((m) => !m);
  let turn = null, kind = null, n = 0;
  for (let t = 0; t < s.toks.length; t++) {
    const k = s.mask[t] ? "model" : "env";
    if (k !== kind) {
      kind = k; n += k === "model" ? 1 : 0;
      turn = el("span", { class: "turn " + k });
      if (multi) turn.appendChild(el("span", { class: "turn-label", text: k === "model" ? "model turn " + n : "tool / environment" }));
      box.appendChild(turn);
    }
    turn.appendChild(tokenSpan(s, t, mode));
  }
  return box;
}

function toolsNode(s) {
  if (!s.tools.length) return null;
  return el("div", { class: "tools" }, s.tools.map((c, k) => el("div", { class: c.ok ? "tool" : "tool bad" },
    "tool call " + (k + 1) + ": " + c.name + "(" + c.args + ") → " + c.out +
    (c.ok ? "" : "  [failed: " + (c.err || "") + "]") + "  " + fmt(c.s, 3) + " s")));
}

function factsNode(s, manifest) {
  const comps = Object.entries(s.comps || {}).map(([k, v]) => k + " " + fmt(v)).join(", ");
  return el("div", { class: "facts" },
    el("span", {}, el("b", { text: "#" + s.i + (s.sub ? "." + s.sub : "") })),
    el("span", { class: "reward" }, "reward ", el("b", { text: fmt(s.reward, 4) }), comps ? " (" + comps + ")" : ""),
    el("span", {}, "advantage ", el("b", { text: manifest.advantages ? fmt(s.adv, 3) : "n/a" })),
    el("span", { class: "status-" + s.status, text: s.status }),
    el("span", { text: "finish " + (s.finish || "–") }),
    el("span", { text: "weights v" + s.wv }),
    el("span", { text: "staleness " + s.stale }),
    el("span", { text: s.mask.reduce((a, b) => a + b, 0) + "/" + s.toks.length + " tokens trained" }),
    s.tools.length ? el("span", { text: s.tools.length + " tool call(s)" }) : null);
}

function sampleNode(s, st, branch) {
  const node = el("div", { class: "sample" + (branch ? " branch" : "") + (sampleMatches(s, st) ? "" : " dim"),
    "data-status": s.status, "data-reward": s.reward, "data-adv": s.adv });
  if (branch) node.appendChild(el("div", { class: "legend", text: "branch " + s.sub + " of sample #" + s.i }));
  node.appendChild(factsNode(s, RV.manifest));
  if (s.err) node.appendChild(el("div", { class: "error", text: s.err }));
  node.appendChild(responseNode(s, st.color));
  const tools = toolsNode(s);
  if (tools) node.appendChild(tools);
  return node;
}

function groupNode(step, g, st) {
  const head = el("div", { class: "group-head" },
    el("b", { text: "group " + g.g }), el("span", { text: "id " + g.gid }), el("span", { text: "prompt " + g.key }),
    g.meta && g.meta !== "{}" ? el("span", { text: "metadata " + g.meta }) : null,
    el("button", { class: "link", text: "this prompt across steps",
      onclick: () => setState({ diff: g.key }) }));
  const box = el("div", { class: "group", "data-group": g.g, "data-prompt": g.key },
    head, el("div", { class: "prompt", text: g.prompt || "(no tokenizer: prompt text not shown)" }));
  const mains = g.samples.filter((s) => !s.sub);
  for (const s of mains) {
    box.appendChild(sampleNode(s, st, false));
    for (const b of g.samples.filter((x) => x.sub && x.i === s.i)) box.appendChild(sampleNode(b, st, true));
  }
  return box;
}

// ----- curves (inline SVG) ---------------------------------------------------------------------

const CURVE_KEYS = ["reward_mean", "eval_accuracy", "accuracy", "loss", "eval_loss", "kl_to_old",
  "logprob_diff_mean_abs", "staleness_max", "rollout_tokens_per_s", "tokens_per_s", "grad_norm",
  "truncation_rate", "samples_failed"];

function curvesNode(stepNow) {
  const m = RV.manifest.metrics, box = el("div", {});
  const W = 340, H = 56;
  for (const key of CURVE_KEYS) {
    const col = m.cols[key];
    if (!col) continue;
    const pts = m.steps.map((x, i) => [x, col[i]]).filter((p) => typeof p[1] === "number");
    if (!pts.length) continue;
    const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    const sx = (x) => 4 + (W - 8) * (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5);
    const sy = (y) => H - 4 - (H - 8) * (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5);
    const svg = svgEl("svg", { width: W, height: H, "data-key": key });
    svg.appendChild(svgEl("polyline", { points: pts.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ") }));
    if (stepNow !== null && stepNow >= x0 && stepNow <= x1) {
      svg.appendChild(svgEl("line", { class: "now", x1: sx(stepNow), x2: sx(stepNow), y1: 0, y2: H }));
    }
    svg.addEventListener("click", (ev) => {
      const r = svg.getBoundingClientRect(), want = x0 + (x1 - x0) * (ev.clientX - r.left - 4) / (W - 8);
      const steps = RV.manifest.steps.map((s) => s.step);
      if (steps.length) setState({ step: String(steps.reduce((a, b) => Math.abs(b - want) < Math.abs(a - want) ? b : a)), diff: "" });
    });
    const last = ys[ys.length - 1];
    box.appendChild(el("div", { class: "curve" },
      el("div", { class: "label" }, el("span", { text: key }), el("span", { text: "last " + fmt(last, 4) + "  [" + fmt(y0, 3) + ", " + fmt(y1, 3) + "]" })), svg));
  }
  if (!box.childNodes.length) box.appendChild(el("div", { class: "legend", text: "no metrics.jsonl rows yet" }));
  return box;
}

function stepListNode(stepNow) {
  const rows = visibleSteps().map((s) => el("tr", { class: s.step === stepNow ? "sel" : "", "data-step": s.step,
    onclick: () => setState({ step: String(s.step), diff: "", tab: "rollouts" }) },
    el("td", { text: s.step }), el("td", { text: s.groups }), el("td", { text: fmt(s.reward, 3) }),
    el("td", { text: s.failed }), el("td", { text: s.truncated }), el("td", { text: s.tools }),
    el("td", { text: s.stale_max })));
  return el("table", {}, el("thead", {}, el("tr", {}, ["step", "groups", "reward", "failed", "trunc", "tools", "stale"].map((h) => el("th", { text: h })))),
    el("tbody", {}, rows));
}

// ----- controls ----------------------------------------------------------------------------------

function controlsNode(stepNow) {
  const st = RV.state;
  const select = (name, options) => el("select", { name, onchange: (e) => setState({ [name]: e.target.value }) },
    options.map(([v, text]) => el("option", { value: v, selected: st[name] === v ? "selected" : null, text })));
  const number = (name, placeholder) => el("input", { type: "number", step: "any", name, placeholder, value: st[name],
    onchange: (e) => setState({ [name]: e.target.value }) });
  const steps = visibleSteps().map((s) => s.step), at = steps.indexOf(stepNow);
  return [
    el("button", { name: "prev", disabled: at <= 0 ? "disabled" : null, text: "◀ step",
      onclick: () => setState({ step: String(steps[at - 1]), diff: "" }) }),
    el("b", { id: "step-now", text: stepNow === null ? "no step" : "step " + stepNow }),
    el("button", { name: "next", disabled: at < 0 || at >= steps.length - 1 ? "disabled" : null, text: "step ▶",
      onclick: () => setState({ step: String(steps[at + 1]), diff: "" }) }),
    el("label", {}, "show ", select("filter", [["all", "all samples"], ["failed", "failed"], ["truncated", "truncated"], ["tools", "with tool calls"]])),
    el("label", {}, "reward ≥ ", number("rmin", "min")), el("label", {}, "≤ ", number("rmax", "max")),
    el("label", {}, "steps ", number("from", "from"), " – ", number("to", "to")),
    el("label", {}, "colour tokens by ", select("color", [["none", "nothing"], ["logprob", "engine logprob"], ["mismatch", "engine/trainer mismatch"]])),
  ];
}

// ----- views -------------------------------------------------------------------------------------

async function renderStep(content, stepNow, status) {
  if (stepNow === null) { status.textContent = "No step matches (or the run has not dumped one yet: train.dump_rollouts)."; return; }
  const data = await loadStep(stepNow);
  if (RV.renderToken !== content.dataset.token) return; // a newer render started meanwhile
  if (!data) { status.textContent = "step " + stepNow + ": data file not found"; return; }
  const st = RV.state;
  const groups = data.groups.filter((g) => g.samples.some((s) => sampleMatches(s, st)));
  const hasTrainer = data.groups.some((g) => g.samples.some((s) => s.tlp));
  const m = data.metrics;
  status.textContent = "step " + stepNow + ": showing " + groups.length + " of " + data.groups.length + " groups" +
    " · reward mean " + fmt(m.reward_mean, 3) + " · failed samples " + fmt(m.samples_failed || 0) +
    " · truncation " + fmt(m.truncation_rate, 3) + (Object.keys(data.failures).length ? " · rejected-group errors: " +
    Object.entries(data.failures).map(([k, v]) => v + "× " + k).join("; ") : "") +
    (st.color === "mismatch" && !hasTrainer ? " · this dump has no trainer logprobs: no mismatch colouring (rollouts view --mismatch computes them)" : "") +
    (RV.manifest.tokenizer ? "" : " · no tokenizer found: tokens shown as ids");
  content.replaceChildren(...groups.map((g) => groupNode(stepNow, g, st)));
}

function lcsDiff(a, b) {
  // token-level diff of b against a: [[op, token]] with op "=", "+", "-"
  if (a.length * b.length > 1e6) return b.map((t) => ["+", t]);
  const n = a.length, m = b.length, L = Array.from({ length: n + 1 }, () => new Int32Array(m + 1));
  for (let i = n - 1; i >= 0; i--) for (let j = m - 1; j >= 0; j--)
    L[i][j] = a[i] === b[j] ? L[i + 1][j + 1] + 1 : Math.max(L[i + 1][j], L[i][j + 1]);
  const out = []; let i = 0, j = 0;
  while (i < n && j < m) {
    if (a[i] === b[j]) { out.push(["=", b[j]]); i++; j++; }
    else if (L[i + 1][j] >= L[i][j + 1]) out.push(["-", a[i++]]);
    else out.push(["+", b[j++]]);
  }
  while (i < n) out.push(["-", a[i++]]);
  while (j < m) out.push(["+", b[j++]]);
  return out;
}

async function renderDiff(content, status) {
  const key = RV.state.diff;
  const steps = RV.manifest.steps.filter((s) => s.prompts.includes(key) && stepInRange(s.step, RV.state)).map((s) => s.step);
  const datas = await Promise.all(steps.map(loadStep));
  if (RV.renderToken !== content.dataset.token) return;
  status.textContent = "prompt " + key + " in " + steps.length + " step(s); each response is diffed against the same sample of the previous step (green: new tokens, red: gone)";
  const nodes = [el("button", { class: "link", text: "← back to the step", onclick: () => setState({ diff: "" }) })];
  let previous = null;
  datas.forEach((data, k) => {
    if (!data) return;
    const g = data.groups.find((x) => x.key === key);
    if (!g) return;
    const box = el("div", { class: "diff-step", "data-step": steps[k] }, el("b", { text: "step " + steps[k] }));
    if (!previous) box.appendChild(el("div", { class: "prompt", text: g.prompt }));
    for (const s of g.samples) {
      const before = previous && previous.samples.find((x) => x.i === s.i && x.sub === s.sub);
      const ops = before ? lcsDiff(before.toks, s.toks) : s.toks.map((t) => ["=", t]);
      box.appendChild(el("div", { class: "sample" }, factsNode(s, RV.manifest),
        el("div", { class: "response" }, ops.map(([op, t]) => el("span", { class: op === "+" ? "ins" : op === "-" ? "del" : "", text: t })))));
    }
    nodes.push(box);
    previous = g;
  });
  content.replaceChildren(...nodes);
}

async function renderSft(content, status) {
  const rows = await loadSft();
  if (RV.renderToken !== content.dataset.token) return;
  const steps = [...new Set(rows.map((r) => r.step))].sort((a, b) => a - b);
  const want = RV.state.sft !== "" ? Number(RV.state.sft) : steps[steps.length - 1];
  const shown = rows.filter((r) => r.step === want);
  const right = shown.filter((r) => r.correct).length;
  status.textContent = "held-out greedy generations at step " + want + ": " + right + " of " + shown.length + " correct";
  const picker = el("div", { class: "facts" }, "evaluation at step ", steps.map((s) => el("button", { class: "link", "data-sft-step": s,
    text: s === want ? "[" + s + "]" : String(s), onclick: () => setState({ sft: String(s) }) })));
  content.replaceChildren(picker, ...shown.map((r) => el("div", { class: "sft-row", "data-correct": r.correct ? 1 : 0 },
    el("div", { class: "prompt", text: r.prompt }),
    el("div", { class: "facts" }, el("span", { class: r.correct ? "ok" : "bad", text: r.correct ? "correct" : "wrong" }), "expected " + r.answer),
    el("div", { class: "response", text: r.completion }))));
}

function render() {
  if (!RV.manifest) return;
  const st = RV.state, m = RV.manifest;
  const content = document.getElementById("content"), status = document.getElementById("status-line");
  RV.renderToken = String(Date.now()) + Math.random();
  content.dataset.token = RV.renderToken;
  const tabs = document.getElementById("tabs");
  tabs.replaceChildren(...[el("button", { class: st.tab !== "sft" ? "on" : "", text: "rollouts (" + m.steps.length + " steps)", onclick: () => setState({ tab: "rollouts" }) }),
    m.sft_evals ? el("button", { class: st.tab === "sft" ? "on" : "", name: "sft-tab", text: "SFT evaluations", onclick: () => setState({ tab: "sft" }) }) : null].filter(Boolean));
  document.getElementById("run-info").textContent = m.run + " · generated " + m.generated + (m.live ? " · live" : "");
  const stepNow = currentStep();
  document.getElementById("curves").replaceChildren(curvesNode(stepNow));
  document.getElementById("step-list").replaceChildren(stepListNode(stepNow));
  document.getElementById("controls").replaceChildren(...(st.tab === "sft" ? [] : controlsNode(stepNow)));
  const done = st.tab === "sft" ? renderSft(content, status) : st.diff ? renderDiff(content, status) : renderStep(content, stepNow, status);
  return done.then(() => {
    if (!document.body.dataset.readyMs) document.body.dataset.readyMs = performance.now().toFixed(1);
    document.body.dataset.stepsLoaded = String(RV.steps.size);
    document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
  });
}

function onManifest() {
  const first = !RV.started;
  RV.started = true;
  if (first) {
    RV.state = readHash();
    // an SFT run has no rollout steps: open on its evaluations
    if (!RV.manifest.steps.length && RV.manifest.sft_evals && !/tab=/.test(location.hash)) RV.state.tab = "sft";
  }
  const stamp = RV.manifest.generated + ":" + RV.manifest.steps.length + ":" + RV.manifest.metrics.steps.length;
  if (stamp !== RV.stamp) { RV.stamp = stamp; render(); }
  if (first && RV.live) setInterval(() => loadScript("data/manifest.js?v=" + Date.now()), RV.pollMs);
}

loadScript("data/manifest.js", () => {
  document.getElementById("status-line").textContent = "data/manifest.js not found: run `rollouts view RUN_DIR` again";
});
