// kvfsm inspect: shows what Python computed (the JSON in #kvfsm-data). It only marks the diagram,
// steps through each trace's snapshots and polls /live; nothing is fetched from anywhere else.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("kvfsm-data").textContent);
  const $ = (id) => document.getElementById(id);
  const el = (tag, text, cls) => {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  };

  // Graphviz names each node, edge and cluster in a <title>: index them by it.
  const nodes = new Map(), edges = new Map(), clusters = new Map();
  document.querySelectorAll("#diagram g.node, #diagram g.edge, #diagram g.cluster").forEach((g) => {
    const title = g.querySelector("title");
    if (!title) return;
    const name = title.textContent;
    if (g.classList.contains("node")) { nodes.set(name, g); g.dataset.state = name; }
    else if (g.classList.contains("edge")) { edges.set(name, g); g.dataset.edge = name; }
    else clusters.set(name, g);
  });
  const targets = (f) => [
    ...f.nodes.map((n) => nodes.get(n)),
    ...f.edges.map(([a, b]) => edges.get(a + "->" + b)),
    ...f.clusters.map((c) => clusters.get(c)),
  ].filter(Boolean);

  // Findings: mark what each names; a click on one (in the list or the diagram) shows its other half.
  data.findings.forEach((f, i) => {
    const item = document.querySelector(`[data-finding="${i}"]`);
    targets(f).forEach((g) => {
      g.classList.add("finding");
      const tip = document.createElementNS("http://www.w3.org/2000/svg", "title");
      tip.textContent = `${f.code} ${f.message}`;
      g.appendChild(tip);
      g.addEventListener("click", () => { focus(i); if (item) item.scrollIntoView({ block: "nearest" }); });
    });
    if (item) item.addEventListener("click", () => focus(i));
  });
  function focus(i) {
    document.querySelectorAll(".focus").forEach((e) => e.classList.remove("focus"));
    const item = document.querySelector(`[data-finding="${i}"]`);
    if (item) item.classList.add("focus");
    targets(data.findings[i]).forEach((g) => {
      g.classList.add("focus");
      g.scrollIntoView({ block: "nearest", inline: "nearest" });
    });
  }

  // Traces: one counterexample, or a trace set chosen one at a time. Snapshot i of the chosen trace is
  // everything after its move i (0: the start).
  const traces = data.traces;
  if (traces.length) {
    document.body.classList.add("has-trace");
    if (traces.length > 1) document.body.classList.add("has-traces");
    const choice = $("trace-choice");
    traces.forEach((t, k) => {
      const option = el("option", t.label);
      option.value = String(k);
      choice.appendChild(option);
    });
    const boxes = document.querySelectorAll("#sequence .trace");
    let t = 0, trace = traces[0], snaps = trace.snapshots, rows = [], at = 0;
    const choose = (k, i) => {
      t = Math.max(0, Math.min(traces.length - 1, k));
      trace = traces[t];
      snaps = trace.snapshots;
      choice.value = String(t);
      boxes.forEach((b) => { b.hidden = Number(b.dataset.trace) !== t; });
      rows = document.querySelectorAll(`#sequence .trace[data-trace="${t}"] .row`);
      $("covers").textContent = trace.covers.length ? `covers: ${trace.covers.join(" · ")}` : "";
      show(i);
    };
    const show = (i) => {
      at = Math.max(0, Math.min(snaps.length - 1, i));
      const s = snaps[at];
      $("counter").textContent = at === 0 ? `start / ${snaps.length - 1}` : `step ${at} / ${snaps.length - 1}`;
      $("counter").dataset.step = String(at);
      $("counter").dataset.trace = String(t);
      // A composition's move names its role and request; one machine's timeline has a lane per key, named in the text.
      const who = !s.role || s.role === s.request ? "" : `${s.role} (${s.request}): `;
      $("move").textContent = who + s.text;
      const v = $("violation");
      v.hidden = !s.violation;
      v.textContent = !s.violation ? "" : s.problem ? `✗ ${s.problem}` :
        `✗ ${trace.property} (${trace.request}): ${trace.violation}` +
        (trace.loop !== null ? ` — repeats forever from move ${trace.loop + 1}` : "");
      nodes.forEach((g) => g.classList.remove("current"));
      edges.forEach((g) => g.classList.remove("taken"));
      const body = $("instances").tBodies[0];
      body.replaceChildren();
      s.instances.forEach((inst) => {
        const tr = el("tr");
        [inst.request, inst.role, inst.state, inst.holds.join(", ") || "nothing",
          inst.freed.map(([r, n]) => `${r} (move ${n})`).join(", ")].forEach((x) => tr.appendChild(el("td", x)));
        tr.dataset.instance = inst.role;
        tr.dataset.request = inst.request;
        if (inst.role === s.role && inst.request === s.request) tr.className = "current";
        body.appendChild(tr);
        if (inst.request === s.request) {
          const g = nodes.get(`${inst.base}/${inst.state}`) || nodes.get(inst.state);
          if (g) g.classList.add("current");
        }
      });
      const flight = $("flight");
      flight.replaceChildren();
      Object.entries(s.in_flight).forEach(([req, msgs]) => {
        flight.appendChild(el("li", `${req}: ${msgs.length ? msgs.join(", ") : "nothing"}`));
      });
      if (at > 0) {
        const prev = snaps[at - 1].instances.find((x) => x.role === s.role && x.request === s.request);
        const now = s.instances.find((x) => x.role === s.role && x.request === s.request);
        if (prev && now) {
          const g = edges.get(`${now.base}/${prev.state}->${now.base}/${now.state}`) ||
            edges.get(`${prev.state}->${now.state}`);
          if (g) g.classList.add("taken");
        }
      }
      document.querySelectorAll("#sequence .row.current, #sequence .row.future")
        .forEach((r) => r.classList.remove("current", "future"));
      rows.forEach((r) => {
        const n = Number(r.dataset.step);
        r.classList.toggle("current", n === at);
        r.classList.toggle("future", n > at);
      });
      const where = traces.length > 1 ? `#trace=${t + 1}&step=${at}` : `#step=${at}`;
      try { history.replaceState(null, "", where); } catch (e) { /* a sandboxed frame: no history */ }
    };
    $("first").onclick = () => show(0);
    $("prev").onclick = () => show(at - 1);
    $("next").onclick = () => show(at + 1);
    $("last").onclick = () => show(snaps.length - 1);
    $("prev-trace").onclick = () => choose(t - 1, 0);
    $("next-trace").onclick = () => choose(t + 1, 0);
    choice.addEventListener("change", () => { choose(Number(choice.value), 0); choice.blur(); });
    document.querySelectorAll("#sequence .row")
      .forEach((r) => r.addEventListener("click", () => show(Number(r.dataset.step))));
    document.addEventListener("keydown", (e) => {
      if (e.ctrlKey || e.metaKey || e.altKey) return;
      const other = { PageDown: t + 1, n: t + 1, PageUp: t - 1, p: t - 1 }[e.key];
      if (other !== undefined && traces.length > 1) { e.preventDefault(); choose(other, 0); return; }
      if (e.target === choice) return; // the chooser's own keys pick a trace
      const go = { ArrowRight: at + 1, ArrowDown: at + 1, ArrowLeft: at - 1, ArrowUp: at - 1, Home: 0, End: snaps.length - 1 }[e.key];
      if (go !== undefined) { e.preventDefault(); show(go); }
    });
    const k = /trace=(\d+)/.exec(location.hash), m = /step=(\d+)/.exec(location.hash);
    choose(k ? Number(k[1]) - 1 : 0, m ? Number(m[1]) : 0);
  }

  // The live view: the server reads the tracker endpoint; this polls the server.
  if (data.live) {
    const every = Math.max(250, data.live.interval * 1000);
    const poll = async () => {
      try {
        const answer = await fetch("live", { cache: "no-store" });
        drawLive(await answer.json());
      } catch (err) {
        $("live-status").textContent = `cannot reach the inspect server: ${err}`;
        $("live-status").className = "down";
      }
      setTimeout(poll, every);
    };
    poll();
  }
  function drawLive(doc) {
    // One status line per endpoint; each endpoint's trackers, named with its URL when the page watches several.
    const status = $("live-status");
    status.replaceChildren();
    status.dataset.reads = String(doc.reads);
    const down = doc.endpoints.filter((e) => e.error);
    status.className = down.length ? "down" : "";
    doc.endpoints.forEach((e) => {
      status.appendChild(el("div", e.error ? `${e.url}: ${e.error} (reading again)` :
        `${e.url} · read ${doc.reads} time(s) · ${new Date().toLocaleTimeString()}`, e.error ? "down" : ""));
    });
    const box = $("live-trackers");
    box.replaceChildren();
    const several = doc.endpoints.length > 1;
    doc.endpoints.filter((e) => !e.error).forEach((e) => {
      Object.entries(e.state.trackers || {}).forEach(([name, dump]) => box.appendChild(drawTracker(e, name, dump, several)));
    });
  }
  function drawTracker(endpoint, name, dump, several) {
    const div = el("div", undefined, "tracker");
    div.dataset.tracker = name;
    div.dataset.endpoint = endpoint.url;
    div.appendChild(el("h2", `${name} — ${dump.live} live` + (several ? ` · ${endpoint.url}` : "")));
    const most = Math.max(1, ...Object.values(dump.states).map((r) => r.count));
    const table = el("table");
    table.innerHTML = "<thead><tr><th>state</th><th>count</th><th></th><th>oldest (age s)</th><th>stuck at / timeout</th></tr></thead>";
    const body = el("tbody");
    Object.entries(dump.states).forEach(([state, row]) => {
      const tr = el("tr");
      tr.dataset.state = state;
      const stuck = row.oldest.some((o) => o.stuck);
      tr.className = stuck ? "stuck" : row.count ? "" : "empty";
      const bar = el("span", undefined, "bar");
      bar.style.width = `${Math.round((120 * row.count) / most)}px`;
      const oldest = row.oldest.map((o) => `${o.key} ${o.age === null ? "?" : o.age.toFixed(1)}${o.stuck ? " STUCK" : ""} (${o.held.join(", ") || "nothing"})`).join("; ");
      const limits = row.stuck_after === null && row.timeout === null ? "" : `${row.stuck_after ?? "-"} / ${row.timeout ?? "-"}`;
      [state + (row.final ? " (final)" : ""), String(row.count)].forEach((t) => tr.appendChild(el("td", t)));
      const cell = el("td"); cell.appendChild(bar); tr.appendChild(cell);
      tr.appendChild(el("td", oldest));
      tr.appendChild(el("td", limits));
      tr.children[1].className = "count";
      body.appendChild(tr);
    });
    table.appendChild(body);
    div.appendChild(table);
    const anomalies = (endpoint.anomalies || {})[dump.machine] || {};
    const kinds = Object.entries(anomalies);
    div.appendChild(el("h3", "anomalies"));
    div.appendChild(el("p", kinds.length ? kinds.map(([k, n]) => `${k}: ${n}`).join(", ") : (endpoint.metrics ? "none" : "no /metrics at this endpoint"), "anomalies"));
    return div;
  }
})();
