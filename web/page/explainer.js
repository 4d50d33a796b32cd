// The explainer's drawing code. Every number comes from attn compiled to
// WebAssembly (attn.js): this file sends JSON requests (web/requests.hpp)
// and draws the answers as tables, heatmaps and charts. It computes nothing
// about attention itself.
"use strict";

const MODEL_PATH = "/reverse.safetensors";
const state = { wasm: null, tokens: null, example: null, perm: null, dkSeen: new Map() };
// Timings of every re-render (ms), read by the browser tests.
window.attnTimings = [];
const $ = (id) => document.getElementById(id);

function call(request) {
  const answer = JSON.parse(state.wasm.ccall("attn_web_call", "string", ["string"], [JSON.stringify(request)]));
  // The last request and answer of each kind, read by the browser tests.
  window.attnLastRequest = window.attnLastRequest || {};
  window.attnLast = window.attnLast || {};
  window.attnLastRequest[request.op] = request;
  window.attnLast[request.op] = answer;
  return answer;
}

// Runs one re-render, timed; an error from the library is shown, not thrown.
function timed(what, fn) {
  const t0 = performance.now();
  try {
    fn();
    $("status").textContent = "Computed by attn (WebAssembly).";
    $("status").className = "";
  } catch (e) {
    $("status").textContent = String(e.message || e);
    $("status").className = "error";
  }
  const ms = performance.now() - t0;
  window.attnTimings.push({ what, ms });
  $("timing").textContent = `last update (${what}): ${ms.toFixed(1)} ms`;
}

function check(answer) {
  if (answer.error) throw new Error(answer.error);
  return answer;
}

// ---- numbers and colours ------------------------------------------------------
const fmt = (x, d = 3) => (Math.abs(x) < 0.5 * 10 ** -d ? 0 : x).toFixed(d);
const fmtg = (x) => (x === 0 ? "0" : Math.abs(x) >= 1e-3 && Math.abs(x) < 1e5 ? x.toPrecision(4) : x.toExponential(2));

// Weights in [0, 1]: white to dark blue. Signed values: blue below 0, red above,
// scaled by the largest magnitude.
function colour(x, kind, scale) {
  if (!Number.isFinite(x)) return "#ddd";
  const t = kind === "weights" ? Math.min(1, Math.max(0, x)) : Math.min(1, Math.abs(x) / (scale || 1));
  const [r, g, b] = kind === "weights" || x < 0 ? [33, 102, 172] : [178, 24, 43];
  const mix = (c) => Math.round(255 + (c - 255) * t);
  return `rgb(${mix(r)}, ${mix(g)}, ${mix(b)})`;
}
const ink = (x, kind, scale) =>
  (kind === "weights" ? Math.abs(x) : Math.abs(x) / (scale || 1)) > 0.55 ? "#fff" : "#111";

// One matrix as a table of numbers on heatmap colours. `edit(i, j, value)`
// makes the cells inputs.
function matrix(title, m, rows, cols, { kind = "signed", decimals = 3, edit = null, id = "", note = "", compact = false } = {}) {
  const fig = document.createElement("figure");
  fig.className = compact ? "matrix compact" : "matrix";
  if (id) fig.id = id;
  const cap = document.createElement("figcaption");
  cap.innerHTML = `${title} <span class="shape">(${m.length} × ${m[0].length})</span>${note ? ` <span class="note">${note}</span>` : ""}`;
  fig.appendChild(cap);
  const scale = Math.max(1e-12, ...m.flat().map((x) => Math.abs(x)));
  const table = document.createElement("table");
  const header = (tr, scope, text) => {
    const th = document.createElement("th");
    th.scope = scope;
    th.textContent = text;
    tr.appendChild(th);
  };
  const head = table.insertRow();
  head.appendChild(document.createElement("th"));
  for (let j = 0; j < m[0].length; ++j) header(head, "col", cols ? cols[j] : j);
  m.forEach((row, i) => {
    const tr = table.insertRow();
    header(tr, "row", rows ? rows[i] : i);
    row.forEach((x, j) => {
      const td = tr.insertCell();
      td.style.background = colour(x, kind, scale);
      td.style.color = ink(x, kind, scale);
      if (edit) {
        const input = document.createElement("input");
        input.type = "text";
        input.inputMode = "decimal";
        input.value = String(x);
        input.setAttribute("aria-label", `${title}, row ${rows ? rows[i] : i}, column ${cols ? cols[j] : j}`);
        input.addEventListener("change", () => {
          const v = Number(input.value);
          if (input.value.trim() === "" || !Number.isFinite(v)) {
            input.value = String(x);
            return;
          }
          edit(i, j, v);
        });
        td.appendChild(input);
      } else {
        const text = kind === "mask" ? String(x) : fmt(x, decimals);
        td.textContent = compact ? text.replace(/^0\./, ".") : text;
      }
    });
  });
  const wrap = document.createElement("div");
  wrap.className = "scroll";
  wrap.appendChild(table);
  fig.appendChild(wrap);
  return fig;
}

// ---- 1. one head, step by step ----------------------------------------------
function variants() {
  const v = {};
  if (!$("scale").checked) v.scale = 1;
  if ($("causal").checked) v.causal = true;
  if ($("window-on").checked) v.window = [Number($("window-left").value), Number($("window-right").value)];
  if ($("alibi-on").checked) v.slope = Number($("alibi").value);
  if ($("softcap-on").checked) v.softcap = Number($("softcap").value);
  if ($("sink-on").checked) v.sink = Number($("sink").value);
  if (Number($("chunk").value) > 0) v.chunk_size = Number($("chunk").value);
  return v;
}

function loadInputs() {
  const which = $("example").value;
  document.querySelectorAll(".words-only").forEach((e) => (e.hidden = which !== "words"));
  if (which === "words") {
    const words = $("words").value.trim().split(/\s+/).filter(Boolean).slice(0, 16);
    state.tokens = check(call({ op: "tokens", words, dim: Number($("dim").value), dk: Number($("dk-head").value), seed: 1 }));
    state.example = null;
    $("intro").textContent = `Self-attention over ${words.length} word(s): each word's embedding is a row of X (the same word, ` +
      "the same row); Q = X W_Qᵀ, K = X W_Kᵀ, V = X W_Vᵀ. Edit any entry.";
  } else {
    state.example = check(call({ op: "example", name: which }));
    $("intro").textContent = state.example.intro + " Edit any entry of Q, K or V.";
  }
  state.perm = null;
}

function renderSteps() {
  const list = $("step-list");
  list.replaceChildren();
  const v = variants();
  let request, rows, keys;
  const edit = (obj, name) => (i, j, x) => {
    obj[name][i][j] = x;
    timed(`edit ${name}`, () => { renderSteps(); renderPermutation(); });
  };
  if (state.tokens) {
    const t = state.tokens;
    rows = keys = t.words;
    request = { op: "head", X: t.X, Wq: t.Wq, Wk: t.Wk, Wv: t.Wv, variants: v };
    const dcols = t.X[0].map((_, j) => `d${j}`);
    list.append(matrix("X (embeddings)", t.X, t.words, dcols, { edit: edit(t, "X"), id: "m-X" }));
    for (const w of ["Wq", "Wk", "Wv"])
      list.append(matrix(`W_${w[1].toUpperCase()} [out, in]`, t[w], null, dcols, { edit: edit(t, w), id: `m-${w}` }));
  } else {
    const e = state.example;
    rows = e.queries;
    keys = e.keys;
    request = { op: "head", Q: e.Q, K: e.K, V: e.V, qpos: e.qpos, variants: v };
  }
  const r = check(call(request));
  const src = state.tokens ? r : state.example;
  const opts = (name) => (state.tokens ? { id: `m-${name}` } : { edit: edit(state.example, name), id: `m-${name}` });
  list.append(matrix("Q", src.Q, rows, null, opts("Q")));
  list.append(matrix("K", src.K, keys, null, opts("K")));
  list.append(matrix("V", src.V, keys, null, opts("V")));
  list.append(matrix("S = Q Kᵀ", r.S, rows, keys, { id: "m-S" }));
  list.append(matrix(`S · scale (${fmtg(r.scale)})`, r.scaled, rows, keys, { id: "m-scaled" }));
  if (r.capped) list.append(matrix("softcap · tanh(· / softcap)", r.capped, rows, keys, { id: "m-capped" }));
  if (r.bias) {
    list.append(matrix("ALiBi bias −m |pᵢ − j|", r.bias, rows, keys, { id: "m-bias" }));
    list.append(matrix("scores + bias", r.biased, rows, keys, { id: "m-biased" }));
  }
  if (r.visible)
    list.append(matrix("visible keys (1 = may attend)", r.visible, rows, keys, { kind: "mask", id: "m-visible", note: r.rule }));
  list.append(matrix("A = softmax, row by row", r.A, rows, keys, { kind: "weights", id: "m-A" }));
  if (r.on_sink) list.append(matrix("weight on the sink", r.on_sink, rows, ["sink"], { kind: "weights", id: "m-sink" }));
  list.append(matrix("Y = A V", r.Y, rows, null, { id: "m-Y" }));
  const decimals = state.example && state.example.keys.length === 2 ? 2 : 3;
  $("result-weights").textContent = r.A[0].map((x) => fmt(x, decimals)).join(" ");
  $("result-output").textContent = `(${r.Y[0].map((x) => fmt(x, 2)).join(", ")})`;
}

// ---- 2. d_k ---------------------------------------------------------------------
const DK_SIZES = { pairs: 400, trials: 150, batch: 4, seed: 0 };

function chart(svg, series, { logy = false, ymin, ymax } = {}) {
  const W = 300, H = 190, L = 42, B = 28, T = 8, R = 8;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const xs = (x) => L + ((Math.log2(x) - 0) / 7) * (W - L - R);
  const ly = (y) => (logy ? Math.log2(y) : y);
  const ys = (y) => H - B - ((ly(y) - ly(ymin)) / (ly(ymax) - ly(ymin))) * (H - B - T);
  let s = `<rect x="${L}" y="${T}" width="${W - L - R}" height="${H - B - T}" fill="#fff" stroke="#888"/>`;
  for (let x = 1; x <= 128; x *= 2)
    s += `<text x="${xs(x)}" y="${H - B + 14}" font-size="10" text-anchor="middle">${x}</text>`;
  s += `<text x="${(W + L) / 2}" y="${H - 2}" font-size="10" text-anchor="middle">d_k</text>`;
  const ticks = logy ? [0.5, 1, 2, 4, 8, 16] : [0, 0.25, 0.5, 0.75, 1];
  for (const y of ticks.filter((y) => y >= ymin && y <= ymax))
    s += `<text x="${L - 4}" y="${ys(y) + 3}" font-size="10" text-anchor="end">${y}</text>`;
  for (const se of series) {
    const pts = se.points.filter(([x, y]) => Number.isFinite(y) && (!logy || y > 0));
    if (se.line)
      s += `<polyline fill="none" stroke="${se.colour}" stroke-width="1.5" ${se.dash ? 'stroke-dasharray="4 3"' : ""} points="${pts.map(([x, y]) => `${xs(x)},${ys(Math.min(ymax, Math.max(ymin, y)))}`).join(" ")}"/>`;
    else for (const [x, y] of pts) s += `<circle cx="${xs(x)}" cy="${ys(Math.min(ymax, Math.max(ymin, y)))}" r="${se.big ? 4.5 : 2.5}" fill="${se.colour}"/>`;
  }
  svg.innerHTML = s;
}

function renderDk() {
  const dk = Number($("dk").value);
  $("dk-value").textContent = dk;
  const r = check(call({ op: "dk", dk, ...DK_SIZES }));
  state.dkSeen.set(dk, r);
  const [, root, sd, , sdScaled] = r.variance;
  $("var-unscaled").textContent = fmtg(sd);
  $("var-scaled").textContent = fmtg(sdScaled);
  $("var-analytic").textContent = fmtg(root);
  $("sat-unscaled").textContent = fmt(r.saturation[3]);
  $("sat-scaled").textContent = fmt(r.saturation[6]);
  $("sat-keys").textContent = `${r.keys} keys`;
  $("jac-unscaled").textContent = fmtg(r.jacobian[0].median_jacobian);
  $("jac-scaled").textContent = fmtg(r.jacobian[1].median_jacobian);
  $("jac-uniform").textContent = fmtg(r.uniform_jacobian);
  $("dk-sizes").textContent = `Each point: ${DK_SIZES.pairs} pairs (variance), ${DK_SIZES.trials} draws of ${r.keys} keys ` +
    `(saturation), ${DK_SIZES.batch} sequences of ${r.tokens} tokens with D = d_k (Jacobian), seed ${DK_SIZES.seed}. ` +
    "Small dots: the d_k visited so far; the large dot: this one.";
  const seen = [...state.dkSeen.entries()].sort((a, b) => a[0] - b[0]);
  const grid = [];
  for (let x = 1; x <= 128; x *= 1.25) grid.push(x);
  grid.push(128);
  const blue = "#2166ac", red = "#b2182b", grey = "#555";
  chart($("chart-variance"), [
    { points: grid.map((x) => [x, Math.sqrt(x)]), colour: grey, line: true, dash: true },
    { points: grid.map((x) => [x, 1]), colour: grey, line: true, dash: true },
    { points: seen.map(([x, a]) => [x, a.variance[2]]), colour: red },
    { points: seen.map(([x, a]) => [x, a.variance[4]]), colour: blue },
    { points: [[dk, sd]], colour: red, big: true },
    { points: [[dk, sdScaled]], colour: blue, big: true },
  ], { logy: true, ymin: 0.5, ymax: 16 });
  chart($("chart-saturation"), [
    { points: grid.map((x) => [x, 1 / r.keys]), colour: grey, line: true, dash: true },
    { points: seen.map(([x, a]) => [x, a.saturation[3]]), colour: red },
    { points: seen.map(([x, a]) => [x, a.saturation[6]]), colour: blue },
    { points: [[dk, r.saturation[3]]], colour: red, big: true },
    { points: [[dk, r.saturation[6]]], colour: blue, big: true },
  ], { ymin: 0, ymax: 1 });
  chart($("chart-jacobian"), [
    { points: grid.map((x) => [x, r.uniform_jacobian]), colour: grey, line: true, dash: true },
    { points: seen.map(([x, a]) => [x, a.jacobian[0].median_jacobian]), colour: red },
    { points: seen.map(([x, a]) => [x, a.jacobian[1].median_jacobian]), colour: blue },
    { points: [[dk, r.jacobian[0].median_jacobian]], colour: red, big: true },
    { points: [[dk, r.jacobian[1].median_jacobian]], colour: blue, big: true },
  ], { ymin: 0, ymax: 0.5 });
}

// ---- 3. permutation ---------------------------------------------------------------
function wordsExample() {
  // The permutation view runs on the typed words (section 1's own words).
  if (state.tokens) return state.tokens;
  const words = $("words").value.trim().split(/\s+/).filter(Boolean).slice(0, 16);
  return check(call({ op: "tokens", words, dim: Number($("dim").value), dk: Number($("dk-head").value), seed: 1 }));
}

function renderPermutation() {
  const t = wordsExample();
  const n = t.words.length;
  if (!state.perm || state.perm.length !== n) state.perm = [...Array(n).keys()];
  const r = check(call({ op: "permute", X: t.X, Wq: t.Wq, Wk: t.Wk, Wv: t.Wv, perm: state.perm,
    positions: $("positions").checked, causal: $("perm-causal").checked }));
  const shuffled = state.perm.map((i) => t.words[i]);
  $("perm-order").textContent = shuffled.join(" ");
  $("perm-diff").textContent = fmtg(r.max_diff);
  const same = r.max_diff < 1e-9;
  $("perm-verdict").textContent = same ? "— the outputs permuted with the tokens" : "— the outputs changed, not just their order";
  $("perm-verdict").className = same ? "ok" : "warn";
  $("perm-list").replaceChildren(
    matrix("Attn(PX): the shuffled tokens' outputs", r.Y_of_permuted, shuffled, null, { id: "m-YP" }),
    matrix("P · Attn(X): the outputs, shuffled", r.permuted_Y, shuffled, null, { id: "m-PY" }));
}

function shuffle() {
  const n = state.perm.length;
  // A new order: each click rotates a deterministic cycle, so every order is reproducible.
  const p = state.perm.slice();
  for (let i = n - 1; i > 0; --i) {
    const j = (i * 7 + p[0] + 3) % (i + 1);
    [p[i], p[j]] = [p[j], p[i]];
  }
  if (p.every((x, i) => x === state.perm[i]) && n > 1) [p[0], p[1]] = [p[1], p[0]];
  state.perm = p;
}

// ---- 4. the trained model's heads ---------------------------------------------------
function renderHeads() {
  const letters = $("letters").value.trim().split(/\s+/).filter(Boolean);
  const info = state.modelInfo;
  const n = info.length;
  if (letters.length !== n) throw new Error(`type exactly ${n} letters, separated by spaces (from ${info.symbols.join(" ")})`);
  const words = [...letters, ":", ...Array(n).fill("_")];
  const r = check(call({ op: "model", path: MODEL_PATH, words }));
  $("model-predicted").textContent = r.predicted.slice(n + 1).join(" ");
  const list = $("head-list");
  list.replaceChildren();
  r.layers.forEach((heads, l) =>
    heads.forEach((w, h) =>
      list.append(matrix(`layer ${l} head ${h}`, w, r.labels, r.labels, { kind: "weights", decimals: 2, id: `m-head-${l}-${h}`, compact: true }))));
}

// ---- wiring ---------------------------------------------------------------------------
function wire() {
  const all = () => { renderSteps(); renderPermutation(); };
  $("example").addEventListener("change", () => timed("example", () => { loadInputs(); all(); }));
  for (const id of ["words", "dim", "dk-head"])
    $(id).addEventListener("change", () => timed(id, () => { loadInputs(); all(); }));
  for (const id of ["scale", "causal", "window-on", "window-left", "window-right", "alibi-on", "alibi", "softcap-on",
                    "softcap", "sink-on", "sink", "chunk"])
    $(id).addEventListener("change", () => timed(id, renderSteps));
  $("dk").addEventListener("input", () => timed("d_k", renderDk));
  $("shuffle").addEventListener("click", () => timed("shuffle", () => { shuffle(); renderPermutation(); }));
  $("unshuffle").addEventListener("click", () => timed("unshuffle", () => { state.perm = null; renderPermutation(); }));
  for (const id of ["positions", "perm-causal"]) $(id).addEventListener("change", () => timed(id, renderPermutation));
  $("letters").addEventListener("change", () => timed("letters", renderHeads));
}

function base64Bytes(text) {
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; ++i) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

AttnWasm().then((module) => {
  state.wasm = module;
  module.FS.writeFile(MODEL_PATH, base64Bytes(window.ATTN_MODEL_BASE64));
  const t0 = performance.now();
  wire();
  timed("load", () => {
    loadInputs();
    renderSteps();
    renderPermutation();
    renderDk();
    // The model's vocabulary and length, from the model itself.
    const probe = call({ op: "model", path: MODEL_PATH, words: [":"] });
    state.modelInfo = check(probe);
    $("letters-help").textContent = `${state.modelInfo.length} letters from ${state.modelInfo.symbols.join(" ")}`;
    renderHeads();
  });
  // Ready for the first interaction: the time since navigation started.
  window.attnReady = { sinceNavigation: performance.now(), firstRender: performance.now() - t0 };
  document.body.dataset.ready = "true";
});
