// The explorer page (reports/explorer_page.py): one step slider moves every view. The data (JSON) and
// Plotly's bundle come gzipped and base64-encoded in #explorer-data and #plotly-bundle, unpacked here by
// the browser's own DecompressionStream; arrays inside the JSON come as base64 little-endian float32.
// No request leaves the file.
async function unpackText(id) {
  const text = atob(document.getElementById(id).textContent);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return new Response(stream).text();
}

(async function () {
  "use strict";
  const status = document.getElementById("unpacking");
  if (typeof DecompressionStream === "undefined") {
    status.textContent = "This browser cannot unpack the page (it needs DecompressionStream: Chrome 80, Firefox 113, Safari 16.4 or later).";
    return;
  }
  const data = JSON.parse(await unpackText("explorer-data"));
  const bundle = document.createElement("script");
  bundle.textContent = await unpackText("plotly-bundle");
  document.head.appendChild(bundle); // runs now: defines Plotly
  status.remove();
  const byId = (id) => document.getElementById(id);
  const steps = data.steps;
  const onStep = []; // each view's update, called with the slider's step
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];
  const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["toImage"] };

  function unpack(packed) {
    const text = atob(packed.b64);
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    return { shape: packed.shape, values: new Float32Array(bytes.buffer) };
  }

  // the index of the last entry of the sorted `xs` at or before `step` (-1: none)
  function at(xs, step) {
    let lo = 0, hi = xs.length - 1, found = -1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (xs[mid] <= step) { found = mid; lo = mid + 1; } else hi = mid - 1;
    }
    return found;
  }

  const finite = (v) => v !== null && v !== undefined && !Number.isNaN(v);
  const shown = (v) => (finite(v) ? Number(v).toPrecision(4) : "–");

  function section(id, title, wide) {
    const el = document.createElement("section");
    el.className = "view" + (wide ? " wide" : "");
    el.id = "view-" + id;
    const h = document.createElement("h2");
    h.textContent = title;
    el.appendChild(h);
    byId("views").appendChild(el);
    return el;
  }

  function why(el, text) {
    const p = document.createElement("div");
    p.className = "why";
    p.textContent = text;
    el.appendChild(p);
  }

  function chartDiv(el, id, cls) {
    const div = document.createElement("div");
    div.className = cls || "chart";
    div.id = id;
    el.appendChild(div);
    return div;
  }

  function select(el, label, options, onChange) {
    const wrap = document.createElement("label");
    wrap.textContent = label + " ";
    const s = document.createElement("select");
    for (const o of options) {
      const opt = document.createElement("option");
      opt.value = o;
      opt.textContent = o;
      s.appendChild(opt);
    }
    s.addEventListener("change", onChange);
    wrap.appendChild(s);
    el.appendChild(wrap);
    return s;
  }

  // ---- line charts with a marker at the step, interventions shaded, stage boundaries dashed ----
  function baseShapes() {
    const shapes = [];
    for (const w of data.interventions || []) {
      shapes.push({ type: "rect", xref: "x", yref: "paper", x0: w.from, x1: w.until === null ? steps[steps.length - 1] : w.until,
        y0: 0, y1: 1, fillcolor: "rgba(255,165,0,0.12)", line: { width: 0 }, layer: "below" });
    }
    const change = data.phase_change || {};
    if (change.onset !== undefined) {  // the run report's phase change, onset to end (or the run's end)
      shapes.push({ type: "rect", xref: "x", yref: "paper", x0: change.onset, x1: change.end === undefined ? steps[steps.length - 1] : change.end,
        y0: 0, y1: 1, fillcolor: "rgba(31,119,180,0.10)", line: { width: 0 }, layer: "below", name: "phase change" });
    }
    for (const b of data.boundaries || []) {
      shapes.push({ type: "line", xref: "x", yref: "paper", x0: b.step, x1: b.step, y0: 0, y1: 1, line: { color: "#555", dash: "dash", width: 1 } });
    }
    return shapes;
  }

  function lineChart(el, id, traces, ytitle) {
    const div = chartDiv(el, id);
    const base = baseShapes();
    const marker = (step) => ({ type: "line", xref: "x", yref: "paper", x0: step, x1: step, y0: 0, y1: 1, line: { color: "#000", width: 1.5 } });
    const layout = {
      // the top margin holds the toolbar, above the legend's first entry
      margin: { l: 50, r: 10, t: 32, b: 35 }, xaxis: { title: { text: "step" } }, yaxis: { title: { text: ytitle } },
      legend: { font: { size: 10 } }, shapes: base.concat([marker(steps[0] || 0)]), hovermode: "x unified",
    };
    Plotly.newPlot(div, traces, layout, CONFIG);
    onStep.push((step) => Plotly.relayout(div, { shapes: base.concat([marker(step)]) }));
    return div;
  }

  function curves() {
    for (const panel of data.panels || []) {
      const el = section(panel.id, panel.title, false);
      const traces = panel.keys.map((key, i) => {
        const trace = { x: data.series[key].x, y: data.series[key].y, name: key, mode: "lines", line: { width: 1.5, color: PALETTE[i % PALETTE.length] } };
        const heads = (data.top_heads || {})[key]; // the top head at each step, named on hover
        return heads ? { ...trace, customdata: heads, hovertemplate: `${key}: %{y:.4g} (%{customdata})<extra></extra>` } : trace;
      });
      if (panel.id === "llc") for (const c of data.llc) traces.push({ x: c.x, y: c.y, name: c.name, mode: "lines+markers" });
      for (const level of panel.levels || []) {
        const xs = [].concat(...panel.keys.map((key) => data.series[key].x));
        traces.push({ x: [Math.min(...xs), Math.max(...xs)], y: [level.y, level.y], name: level.name, mode: "lines",
          line: { color: "#000", dash: "dash", width: 1 } });
      }
      lineChart(el, "chart-" + panel.id, traces, panel.y);
    }
    if ((data.llc || []).length && !(data.panels || []).some((p) => p.id === "llc")) {
      const el = section("llc", "local learning coefficient (stage analyses)", false);
      lineChart(el, "chart-llc", data.llc.map((c, i) => ({ x: c.x, y: c.y, name: c.name, mode: "lines+markers", line: { color: PALETTE[i % PALETTE.length] } })), "λ̂");
    }
    for (const [view, text] of Object.entries(data.missing || {})) {
      if (["curves", "strategies", "llc"].includes(view)) why(section(view, view, false), text);
    }
  }

  // ---- the numbers at the step, each as the run's CSV holds it ----
  function readouts() {
    const box = byId("readouts");
    for (const r of data.readouts || []) {
      const span = document.createElement("span");
      span.innerHTML = `${r.label}: <span class="value" id="readout-${r.id}"></span> <span class="at" id="readout-${r.id}-at"></span>`;
      box.appendChild(span);
      const s = data.series[r.key];
      onStep.push((step) => {
        const i = at(s.x, step);
        const v = byId("readout-" + r.id);
        v.textContent = i < 0 ? "–" : shown(s.y[i]);
        v.dataset.value = i < 0 || s.y[i] === null ? "" : String(s.y[i]);
        v.dataset.step = i < 0 ? "" : String(s.x[i]);
        byId("readout-" + r.id + "-at").textContent = i >= 0 && s.x[i] !== step ? `(step ${s.x[i]})` : "";
      });
    }
    if (data.stages) {  // the strategy in use: the run's switch record, each switch with its interval
      const st = data.stages;
      const span = document.createElement("span");
      span.innerHTML = 'strategy: <span class="value" id="readout-closest"></span> <span class="at" id="readout-closest-at"></span>';
      box.appendChild(span);
      onStep.push((step) => {
        const past = st.switches.filter((w) => w.step <= step);
        const last = past[past.length - 1], next = st.switches[past.length];
        const v = byId("readout-closest");
        v.textContent = last ? last.to : st.first;
        v.dataset.value = v.textContent;
        const when = (w) => `step ${w.step} [${w.low}, ${w.high}]`;
        byId("readout-closest-at").textContent = last ? `(since ${when(last)})` : next ? `(until ${when(next)})` : "";
      });
    }
  }

  // ---- every head's scores and type at the step ----
  function heads() {
    const el = section("heads", "every head at the step (hover a head for its scores)", false);
    if (!data.heads) return why(el, data.missing.heads);
    const H = data.heads;
    const maps = Object.fromEntries(Object.entries(H.maps).map(([k, v]) => [k, { steps: v.steps, ...unpack(v.values) }]));
    const types = H.types ? { steps: H.types.steps, names: H.types.names, ...unpack(H.types.codes) } : null;
    const names = Object.keys(maps);
    const choice = select(el, "colour by", types ? ["type", ...names] : names, () => draw(current));
    choice.value = names.includes("induction") ? "induction" : choice.options[0].value;
    const div = chartDiv(el, "chart-heads");
    const L = H.layers, N = H.heads;
    let current = steps[0] || 0;
    function slice(m, step) {
      const i = at(m.steps, step);
      return i < 0 ? null : { step: m.steps[i], values: m.values.subarray(i * L * N, (i + 1) * L * N) };
    }
    function draw(step) {
      current = step;
      const now = Object.fromEntries(names.map((n) => [n, slice(maps[n], step)]));
      const type = types ? slice(types, step) : null;
      const z = [], text = [];
      const chosen = choice.value;
      let measuredAt = null;
      for (let l = 0; l < L; l++) {
        const row = [], tips = [];
        for (let h = 0; h < N; h++) {
          const k = l * N + h;
          const lines = [`L${l}H${h}`];
          if (type) lines.push(`type: ${type.values[k] >= 0 ? types.names[type.values[k]] : "–"}`);
          for (const n of names) if (now[n]) lines.push(`${n}: ${shown(now[n].values[k])}`);
          tips.push(lines.join("<br>"));
          if (chosen === "type") { row.push(type ? type.values[k] : null); measuredAt = type && type.step; }
          else { row.push(now[chosen] ? (finite(now[chosen].values[k]) ? now[chosen].values[k] : null) : null); measuredAt = now[chosen] && now[chosen].step; }
        }
        z.push(row);
        text.push(tips);
      }
      const trace = {
        z, text, type: "heatmap", hoverinfo: "text", x: Array.from({ length: N }, (_, h) => "H" + h), y: Array.from({ length: L }, (_, l) => "L" + l),
        colorscale: chosen === "type" ? "Portland" : "Viridis", zmin: chosen === "type" ? 0 : undefined,
        zmax: chosen === "type" ? types.names.length - 1 : undefined,
      };
      const title = measuredAt === null ? "not measured yet" : `${chosen} (measured at step ${measuredAt})`;
      Plotly.react(div, [trace], { margin: { l: 40, r: 10, t: 30, b: 30 }, title: { text: title, font: { size: 12 } }, yaxis: { autorange: "reversed" } }, CONFIG);
    }
    onStep.push(draw);
  }

  // ---- the composition (and the ablation's truth) of every earlier -> later pair at the step ----
  function pairs() {
    const el = section("pairs", "every earlier → later head pair at the step (hover a pair)", false);
    if (!data.pairs) return why(el, data.missing.pairs);
    const P = data.pairs;
    const tensors = Object.fromEntries(Object.entries(P.tensors).map(([k, v]) => [k, { steps: v.steps, ...unpack(v.values) }]));
    const first = Object.values(tensors)[0];
    const [L, N] = [first.shape[1], first.shape[2]];
    const options = [...P.measures, ...P.extra];
    const row = document.createElement("div");
    row.className = "choices";
    el.appendChild(row);
    const measure = select(row, "measure", options, () => draw(current));
    measure.value = P.measures.includes(data.measure) ? data.measure : options[0];
    const kind = select(row, "composition", P.kinds, () => draw(current));
    kind.value = "K";
    const div = chartDiv(el, "chart-pairs");
    let current = steps[0] || 0;
    const name = () => (P.extra.includes(measure.value) ? measure.value : `comp/${kind.value}/${measure.value}`);
    const readers = [], writers = [];
    for (let l = 0; l < L; l++) for (let h = 0; h < N; h++) { if (l > 0) readers.push([l, h]); if (l < L - 1) writers.push([l, h]); }
    const flat = (lw, hw, lr, hr) => ((lw * N + hw) * L + lr) * N + hr;
    const ranges = {};
    function range(key, t) { // [min(0, lowest), highest] over every measured step
      if (!t) return [0, 1];
      if (!ranges[key]) {
        let lo = 0, hi = -Infinity;
        for (const v of t.values) if (finite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
        ranges[key] = [lo, hi > lo ? hi : lo + 1];
      }
      return ranges[key];
    }
    function baselineAt(m, step) { // the measure's random baseline (mean) at the step, or null
      const b = (P.baselines || {})[m];
      if (!b) return null;
      const k = at(b.steps, step);
      return k < 0 ? b.mean_sd[0][0] : b.mean_sd[k][0];
    }
    function draw(step) {
      current = step;
      kind.disabled = P.extra.includes(measure.value);
      const t = tensors[name()];
      const truth = tensors["ablation/loss_change"];
      const i = t ? at(t.steps, step) : -1;
      const j = truth ? at(truth.steps, step) : -1;
      const size = L * N * L * N;
      const z = [], text = [];
      for (const [lr, hr] of readers) {
        const zr = [], tr = [];
        for (const [lw, hw] of writers) {
          const v = i < 0 ? null : t.values[i * size + flat(lw, hw, lr, hr)];
          const ok = lw < lr && finite(v);
          zr.push(ok ? v : null);
          let tip = `L${lw}H${hw} → L${lr}H${hr}: ${ok ? shown(v) : "–"}`;
          if (truth && j >= 0 && lw < lr) tip += `<br>ablation Δloss (step ${truth.steps[j]}): ${shown(truth.values[j * size + flat(lw, hw, lr, hr)])}`;
          tr.push(tip);
        }
        z.push(zr);
        text.push(tr);
      }
      // one colour scale for the whole run (from 0, or the run's lowest value), the random baseline marked on it
      const [zmin, zmax] = range(name(), t);
      const base = P.extra.includes(measure.value) ? null : baselineAt(measure.value, step);
      const colorbar = base === null ? {} : { tickvals: [zmin, base, zmax], ticktext: [shown(zmin), `random ${shown(base)}`, shown(zmax)] };
      let title = i < 0 ? `${name()}: not measured yet` : `${name()} (measured at step ${t.steps[i]})`;
      if (base !== null) title += ` · random baseline ${shown(base)}`;
      Plotly.react(div, [{ z, text, type: "heatmap", hoverinfo: "text", colorscale: "Viridis", zmin, zmax, colorbar,
        x: writers.map(([l, h]) => `L${l}H${h}`), y: readers.map(([l, h]) => `L${l}H${h}`) }],
        { margin: { l: 55, r: 10, t: 30, b: 50 }, title: { text: title, font: { size: 12 } }, xaxis: { title: { text: "writer (earlier head)" } },
          yaxis: { title: { text: "reader" }, autorange: "reversed" } }, CONFIG);
    }
    onStep.push(draw);
  }

  // ---- every drawn head's attention on the probe sequence, from the weights saved nearest before the step ----
  function patterns() {
    const el = section("patterns", "attention patterns on a probe sequence (query row → key column)", true);
    if (!data.patterns) return why(el, data.missing.patterns);
    const P = data.patterns;
    const T = P.tokens.length, size = (T * (T + 1)) / 2;
    const all = unpack(P.tril).values;
    const label = document.createElement("div");
    label.id = "patterns-step";
    el.appendChild(label);
    const grid = document.createElement("div");
    grid.className = "patterns";
    el.appendChild(grid);
    const divs = P.heads.map((h) => chartDiv(grid, "pattern-" + h, "pattern"));
    const axis = P.tokens.map((tok, i) => `${i}:${tok}`);
    let shownIndex = -2;
    function draw(step) {
      const i = Math.max(at(P.steps, step), 0);
      label.textContent = `weights saved at step ${P.steps[i]}` + (P.steps[i] !== step ? ` (the last saved at or before step ${step})` : "");
      label.dataset.step = String(P.steps[i]);
      if (i === shownIndex) return;
      shownIndex = i;
      P.heads.forEach((head, k) => {
        const base = (i * P.heads.length + k) * size;
        const z = [];
        let offset = base;
        for (let q = 0; q < T; q++) {
          const row = new Array(T).fill(null);
          for (let key = 0; key <= q; key++) row[key] = all[offset++];
          z.push(row);
        }
        Plotly.react(divs[k], [{ z, x: axis, y: axis, type: "heatmap", colorscale: [[0, "#ffffff"], [1, "#08306b"]], zmin: 0, zmax: 1, showscale: false,
          hovertemplate: "query %{y} → key %{x}: %{z:.4f}<extra>" + head + "</extra>" }],
          { margin: { l: 20, r: 4, t: 22, b: 14 }, title: { text: head, font: { size: 11 } },
            xaxis: { showticklabels: false }, yaxis: { showticklabels: false, autorange: "reversed" } }, { displayModeBar: false });
      });
    }
    onStep.push(draw);
  }

  // ---- a sweep: the members overlaid, coloured by group, each linking to its own page ----
  function sweep() {
    const groups = [...new Set(data.members.map((m) => m.group))];
    const colour = (m) => PALETTE[groups.indexOf(m.group) % PALETTE.length];
    for (const key of data.keys) {
      const el = section(key.replace(/\W/g, "_"), key + (data.grouped_by.length ? ` (colour: ${data.grouped_by.join(", ")})` : ""), false);
      const seen = new Set();
      const traces = data.members.filter((m) => m.series[key]).map((m) => {
        const first = !seen.has(m.group);
        seen.add(m.group);
        return { x: m.series[key].x, y: m.series[key].y, name: m.group || m.name, legendgroup: m.group, showlegend: first,
          mode: "lines", line: { width: 1.3, color: colour(m) }, hovertemplate: `${m.name}: %{y:.4g}<extra></extra>` };
      });
      lineChart(el, "chart-" + key.replace(/\W/g, "_"), traces, key);
    }
    const el = section("members", "members (each links to its own page)", true);
    const table = document.createElement("table");
    table.className = "members";
    table.innerHTML = "<tr><th>run</th><th>group</th><th>seed</th><th>status</th><th>phase change (onset / midpoint / end)</th>" +
      data.keys.map((k) => `<th>${k}</th>`).join("") + "</tr>";
    data.members.forEach((m, r) => {
      const tr = document.createElement("tr");
      const change = (m.phase_change || []).some((x) => x !== null) ? m.phase_change.map((x) => (x === null ? "–" : x.toFixed(0))).join(" / ") : "none";
      tr.innerHTML = `<td><a href="${encodeURI(m.href)}">${m.name}</a></td><td>${m.group}</td><td>${m.seed}</td><td>${m.status}</td>` +
        `<td class="phase-change">${change}</td>` +
        data.keys.map((k, c) => `<td id="member-${r}-${c}"></td>`).join("");
      table.appendChild(tr);
    });
    el.appendChild(table);
    if (data.emergence) emergence(data.emergence);
    onStep.push((step) => data.members.forEach((m, r) => data.keys.forEach((k, c) => {
      const s = m.series[k], cell = byId(`member-${r}-${c}`);
      const i = s ? at(s.x, step) : -1;
      cell.textContent = i < 0 ? "–" : shown(s.y[i]);
      cell.dataset.value = i < 0 || s.y[i] === null ? "" : String(s.y[i]);
    })));
  }

  // ---- a sweep's emergence law: every exponent, and the step against each variable on log axes ----
  function emergence(law) {
    const el = section("emergence", "when the phase change comes: the emergence law (90 % intervals; reports/emergence.py)", true);
    const table = document.createElement("table");
    table.className = "members";
    table.id = "emergence-table";
    table.innerHTML = "<tr><th>event</th><th>unit</th><th>stratum</th><th>variable</th><th>exponent [90 %]</th><th>bends</th><th>published (95 %)</th></tr>";
    for (const r of law.rows) {
      const tr = document.createElement("tr");
      tr.innerHTML = `<td>${r.event}</td><td>${r.unit}</td><td>${r.stratum}</td><td>${r.variable}</td>` +
        `<td>${r.exponent.toFixed(3)} [${r.low90.toFixed(3)}, ${r.high90.toFixed(3)}]</td><td>${r.bends ? "yes" : "no"}</td><td>${r.predictions}</td>`;
      table.appendChild(tr);
    }
    el.appendChild(table);
    for (const [variable, strata] of Object.entries(law.charts)) {
      const id = "chart-emergence-" + variable.replace(/\W/g, "_");
      const traces = [];
      strata.forEach((s, i) => {
        const colour = PALETTE[i % PALETTE.length], name = s.stratum || "all jobs";
        traces.push({ x: s.x, y: s.y, name, mode: "markers", legendgroup: name, marker: { color: colour,
          symbol: s.censored.map((c) => (c ? "triangle-up-open" : "circle")) }, hovertemplate: `${variable} %{x}: step %{y:.0f}<extra></extra>` });
        traces.push({ x: s.fit.x, y: s.fit.y, name: name + ": fit", mode: "lines", legendgroup: name, showlegend: false,
          line: { color: colour, width: 1.5 } });
      });
      const div = chartDiv(el, id);
      Plotly.newPlot(div, traces, { margin: { l: 60, r: 10, t: 10, b: 40 }, xaxis: { type: "log", title: { text: variable } },
        yaxis: { type: "log", title: { text: `${law.event} (${law.unit}; open triangles: censored)` } }, legend: { font: { size: 10 } } }, CONFIG);
    }
  }

  // ---- the slider, play/pause and the keys ----
  const slider = byId("slider"), play = byId("play");
  let timer = null;
  function setIndex(i) {
    const index = Math.min(Math.max(i, 0), Math.max(steps.length - 1, 0));
    slider.value = String(index);
    const step = steps.length ? steps[index] : 0;
    byId("step-label").textContent = steps.length ? `step ${step} (${index + 1}/${steps.length})` : "no steps";
    byId("step-label").dataset.step = String(step);
    for (const update of onStep) update(step);
  }
  function toggle() {
    if (timer) { clearInterval(timer); timer = null; play.textContent = "▶"; return; }
    if (Number(slider.value) >= steps.length - 1) setIndex(0);
    play.textContent = "❚❚";
    timer = setInterval(() => {
      if (Number(slider.value) >= steps.length - 1) return toggle();
      setIndex(Number(slider.value) + 1);
    }, 120);
  }

  document.title = data.title + " · explorer";
  byId("title").textContent = (data.kind === "sweep" ? "sweep " : "run ") + data.title;
  byId("identity").textContent = data.identity || "";  // what the run is: the overrides that made it
  byId("happened").textContent = data.happened || "";  // what happened: the phase change, the circuit, heads, strategies
  for (const note of data.notes || []) {
    const li = document.createElement("li");
    li.textContent = note;
    byId("notes").appendChild(li);
  }
  if (data.kind === "sweep") sweep();
  else { curves(); readouts(); heads(); pairs(); patterns(); }
  slider.max = String(Math.max(steps.length - 1, 0));
  slider.addEventListener("input", () => setIndex(Number(slider.value)));
  play.addEventListener("click", toggle);
  document.addEventListener("keydown", (event) => {
    if (event.target.tagName === "SELECT") return;
    const i = Number(slider.value);
    const moves = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: steps.length - 1 };
    if (event.key in moves) { setIndex(moves[event.key]); event.preventDefault(); }
    else if (event.key === " ") { toggle(); event.preventDefault(); }
  });
  setIndex(steps.length - 1);
  window.explorer = { data, setIndex, steps }; // for a test driving the page
  document.body.dataset.ready = "true";
})().catch((error) => {
  const note = document.getElementById("unpacking") || document.body.appendChild(document.createElement("p"));
  note.textContent = `The page could not be drawn: ${error}`;
  throw error;
});
