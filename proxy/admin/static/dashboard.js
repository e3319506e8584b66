/* prefixgate dashboard: polls ../stats and draws it as SVG. No dependencies, no external requests.
 *
 * Every value that comes from the server is inserted with textContent or as an SVG attribute,
 * never as markup: prefix labels can carry prompt text.
 */
"use strict";

(function () {
  // Long windows change slowly (hourly points) and cost the store more to read: poll less often.
  const REFRESH_MS = { "5m": 5000, "1h": 5000, "24h": 30000, "7d": 60000 };
  const WINDOWS = { "5m": "last 5 minutes", "1h": "last hour", "24h": "last 24 hours", "7d": "last 7 days" };
  const SVGNS = "http://www.w3.org/2000/svg";
  const COLORS = {
    measured: "var(--measured)", predicted: "var(--predicted)",
    p50: "var(--p50)", p90: "var(--p90)", p99: "var(--p99)",
    good: "var(--good)", bad: "var(--bad)", neutral: "var(--neutral)",
    cached: "var(--cached)", computed: "var(--computed)",
  };
  const CAUSES = [
    ["new", "new", "var(--miss-new)"],
    ["breaker", "breaker", "var(--miss-breaker)"],
    ["routing", "routing", "var(--miss-routing)"],
    ["evicted", "evicted", "var(--miss-evicted)"],
    ["unexplained", "unexplained", "var(--miss-unexplained)"],
  ];

  const params = new URLSearchParams(location.search);
  const state = {
    window: WINDOWS[params.get("window")] ? params.get("window") : "1h",
    model: params.get("model") || "",
    backend: params.get("backend") || "",
    data: null,
    renders: 0,
    models: new Set(),
    backends: new Set(),
    timer: null,
    inFlight: false,
  };

  // ---- small DOM helpers ------------------------------------------------------------------
  function $(id) { return document.getElementById(id); }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    for (const c of children) append(node, c);
    return node;
  }

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVGNS, tag);
    setAttrs(node, attrs);
    for (const c of children) append(node, c);
    return node;
  }

  function setAttrs(node, attrs) {
    if (!attrs) return;
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.setAttribute("class", v);
      else if (k === "text") node.textContent = String(v);
      else if (k === "style") Object.assign(node.style, v);
      else node.setAttribute(k, String(v));
    }
  }

  function append(node, child) {
    if (child === null || child === undefined || child === false) return;
    node.appendChild(typeof child === "string" || typeof child === "number"
      ? document.createTextNode(String(child)) : child);
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  // ---- number formatting ------------------------------------------------------------------
  const isNum = (v) => typeof v === "number" && isFinite(v);

  const NB = "\u00a0"; // between a number and its unit, so they never wrap apart
  const trimZeros = (text) => text.replace(/\.0+$/, "").replace(/(\.\d*[1-9])0+$/, "$1");

  function pct(v, digits) {
    if (!isNum(v)) return "—";
    return (v * 100).toFixed(digits === undefined ? 1 : digits) + NB + "%";
  }

  function ms(v) {
    if (!isNum(v)) return "—";
    if (v < 10) return trimZeros(v.toFixed(1)) + NB + "ms";
    if (v < 1000) return Math.round(v) + NB + "ms";
    if (v < 60000) return trimZeros((v / 1000).toFixed(v < 10000 ? 2 : 1)) + NB + "s";
    return trimZeros((v / 60000).toFixed(1)) + NB + "min";
  }

  function compact(v) {
    if (!isNum(v)) return "—";
    const a = Math.abs(v);
    const trim = trimZeros;
    if (a >= 1e9) return trim((v / 1e9).toFixed(1)) + NB + "B";
    if (a >= 1e6) return trim((v / 1e6).toFixed(a >= 1e7 ? 1 : 2)) + NB + "M";
    if (a >= 1e4) return trim((v / 1e3).toFixed(1)) + NB + "k";
    if (a >= 1000) return trim((v / 1e3).toFixed(2)) + NB + "k";
    return String(Math.round(v * 100) / 100);
  }

  function usd(v) {
    if (!isNum(v)) return "—";
    if (v === 0) return "$0";
    if (v < 0.01) return "$" + v.toPrecision(2);
    if (v < 1000) return "$" + v.toFixed(2);
    return "$" + compact(v);
  }

  function duration(seconds) {
    if (!isNum(seconds)) return "—";
    if (seconds < 60) return trimZeros(seconds.toFixed(seconds < 10 ? 2 : 1)) + NB + "s";
    if (seconds < 3600) return trimZeros((seconds / 60).toFixed(1)) + NB + "min";
    if (seconds < 86400 * 2) return trimZeros((seconds / 3600).toFixed(1)) + NB + "h";
    return trimZeros((seconds / 86400).toFixed(1)) + NB + "d";
  }

  function rate(v) {
    if (!isNum(v)) return "—";
    if (v === 0) return "0/min";
    if (v >= 1) return v.toFixed(v >= 100 ? 0 : 1) + "/s";
    if (v * 60 >= 1) return (v * 60).toFixed(1) + "/min";
    return (v * 3600).toFixed(1) + "/h";
  }

  function ago(epochS, nowS) {
    if (!isNum(epochS) || epochS <= 0) return "—";
    const d = Math.max(0, nowS - epochS);
    if (d < 60) return Math.round(d) + " s ago";
    if (d < 3600) return Math.round(d / 60) + " min ago";
    if (d < 86400) return Math.round(d / 3600) + " h ago";
    return Math.round(d / 86400) + " d ago";
  }

  const pad2 = (n) => String(n).padStart(2, "0");
  const DAYS = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
  function clock(epochS, withDay) {
    const d = new Date(epochS * 1000);
    const hm = pad2(d.getHours()) + ":" + pad2(d.getMinutes());
    return withDay ? DAYS[d.getDay()] + " " + d.getDate() + (d.getHours() || d.getMinutes() ? " " + hm : "") : hm;
  }

  // ---- scales -----------------------------------------------------------------------------
  function niceStep(span, target) {
    const raw = span / Math.max(target, 1);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
    return 10 * mag;
  }

  function yTicks(max, target) {
    if (!(max > 0)) max = 1;
    const step = niceStep(max, target);
    const top = Math.ceil(max / step - 1e-9) * step;
    const ticks = [];
    for (let v = 0; v <= top + step / 2; v += step) ticks.push(Math.round(v / step) * step);
    return { top, ticks };
  }

  const TIME_STEPS = [60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800];
  function xTicks(since, until, target) {
    const span = until - since;
    const step = TIME_STEPS.find((s) => span / s <= target) || 172800;
    const offset = new Date(since * 1000).getTimezoneOffset() * 60;
    const ticks = [];
    let t = Math.ceil((since - offset) / step) * step + offset;
    for (; t <= until; t += step) ticks.push(t);
    return { ticks, step, withDay: step >= 86400 || span > 86400 };
  }

  // ---- the chart ----------------------------------------------------------------------------
  /* spec: {id, kind: "line"|"bars", series: [{key, label, color, dashed, get(p)}], yFormat,
   *        yMax (fixed top or null), threshold: {value, label}, axisTitle} */
  function drawChart(container, data, spec) {
    clear(container);
    const points = data.series || [];
    const width = Math.max(container.clientWidth || 600, 320);
    const height = 240;
    const m = { l: 70, r: 14, t: 10, b: 28 };
    const iw = width - m.l - m.r;
    const ih = height - m.t - m.b;
    const res = data.resolution_s || 60;
    const since = data.since, until = data.until;
    const legend = el("div", { class: "legend" });
    for (const s of spec.series) {
      legend.appendChild(el("span", null,
        spec.kind === "bars"
          ? el("i", { class: "swatch", style: { background: s.color } })
          : el("i", { class: "line" + (s.dashed ? " dashed" : ""), style: { borderColor: s.color } }),
        s.label));
    }
    if (spec.threshold && isNum(spec.threshold.value)) {
      legend.appendChild(el("span", null,
        el("i", { class: "line dashed", style: { borderColor: "var(--slo)" } }), spec.threshold.label));
    }
    container.appendChild(legend);

    // y domain
    let dataMax = 0;
    let drawn = 0;
    for (const p of points) {
      if (spec.kind === "bars") {
        let sum = 0;
        for (const s of spec.series) { const v = s.get(p); if (isNum(v)) sum += v; }
        dataMax = Math.max(dataMax, sum);
        if (sum > 0) drawn++;
      } else {
        for (const s of spec.series) {
          const v = s.get(p);
          if (isNum(v)) { dataMax = Math.max(dataMax, v); drawn++; }
        }
      }
    }
    const threshold = spec.threshold && isNum(spec.threshold.value) ? spec.threshold.value : null;
    let yMax = spec.yMax || 0;
    let thresholdShown = false;
    if (!yMax) {
      yMax = dataMax * 1.08;
      if (threshold !== null && threshold <= dataMax * 2.5) { yMax = Math.max(yMax, threshold * 1.08); }
    }
    if (threshold !== null && threshold <= yMax) thresholdShown = true;
    const yt = spec.yMax ? { top: spec.yMax, ticks: [0, .25, .5, .75, 1].map((f) => f * spec.yMax) } : yTicks(yMax, 4);
    const top = yt.top || 1;
    const x = (t) => m.l + ((t - since) / Math.max(until - since, 1)) * iw;
    const y = (v) => m.t + ih - (Math.min(v, top) / top) * ih;

    const root = svg("svg", {
      viewBox: `0 0 ${width} ${height}`, width, height, role: "img",
      "aria-label": spec.title, "data-points": drawn,
    });
    root.appendChild(svg("title", { text: spec.title }));
    // grid and y axis
    for (const v of yt.ticks) {
      root.appendChild(svg("line", { class: "gridline", x1: m.l, x2: m.l + iw, y1: y(v), y2: y(v) }));
      root.appendChild(svg("text", { x: m.l - 8, y: y(v) + 3.5, "text-anchor": "end", text: spec.yFormat(v, top) }));
    }
    root.appendChild(svg("text", {
      class: "axis-title", transform: `translate(11 ${m.t + ih / 2}) rotate(-90)`, "text-anchor": "middle",
      text: spec.axisTitle,
    }));
    // x axis
    const xt = xTicks(since, until, Math.max(3, Math.floor(iw / 90)));
    root.appendChild(svg("line", { class: "baseline", x1: m.l, x2: m.l + iw, y1: m.t + ih, y2: m.t + ih }));
    for (const t of xt.ticks) {
      root.appendChild(svg("line", { class: "baseline", x1: x(t), x2: x(t), y1: m.t + ih, y2: m.t + ih + 4 }));
      root.appendChild(svg("text", { x: x(t), y: m.t + ih + 17, "text-anchor": "middle", text: clock(t, xt.withDay) }));
    }

    // Hourly points can start before the window: clip what falls outside the plot area.
    const clipId = "clip-" + container.id;
    root.appendChild(svg("defs", null, svg("clipPath", { id: clipId },
      svg("rect", { x: m.l, y: m.t - 4, width: iw, height: ih + 8 }))));
    const plot = svg("g", { class: "plot", "clip-path": `url(#${clipId})` });
    root.appendChild(plot);
    if (spec.kind === "bars") {
      const bw = Math.max((iw * res) / Math.max(until - since, 1) - 2, 1.5);
      for (const p of points) {
        let acc = 0;
        for (const s of spec.series) {
          const v = s.get(p);
          if (!isNum(v) || v <= 0) continue;
          const y0 = y(acc), y1 = y(acc + v);
          plot.appendChild(svg("rect", {
            class: "bar " + s.key, x: x(p.ts) + 1, y: y1, width: bw, height: Math.max(y0 - y1, 0.5),
            style: { fill: s.color }, rx: bw > 6 ? 2 : 0,
          }));
          acc += v;
        }
      }
    } else {
      for (const s of spec.series) {
        let d = "";
        let run = [];
        const flush = () => {
          if (run.length === 1) {
            plot.appendChild(svg("circle", { class: "point " + s.key, cx: run[0][0], cy: run[0][1], r: 3, style: { fill: s.color } }));
          } else if (run.length > 1) {
            const line = run.map(([px, py], i) => (i ? "L" : "M") + px.toFixed(1) + " " + py.toFixed(1)).join("");
            d += line;
            if (s.area) {
              const base = (m.t + ih).toFixed(1);
              plot.appendChild(svg("path", {
                class: "area " + s.key,
                d: line + "L" + run[run.length - 1][0].toFixed(1) + " " + base + "L" + run[0][0].toFixed(1) + " " + base + "Z",
                style: { fill: s.color },
              }));
            }
          }
          run = [];
        };
        for (const p of points) {
          const v = s.get(p);
          if (isNum(v)) run.push([x(p.ts + res / 2), y(v)]);
          else flush();
        }
        flush();
        if (d) {
          plot.appendChild(svg("path", {
            class: "series " + s.key + (s.dashed ? " dashed" : ""), d, style: { stroke: s.color },
          }));
        }
        if (points.length <= 40) {
          for (const p of points) {
            const v = s.get(p);
            if (isNum(v)) plot.appendChild(svg("circle", { class: "point " + s.key, cx: x(p.ts + res / 2), cy: y(v), r: 2.4, style: { fill: s.color } }));
          }
        }
      }
    }
    if (thresholdShown) {
      root.appendChild(svg("line", { class: "slo", x1: m.l, x2: m.l + iw, y1: y(threshold), y2: y(threshold) }));
      root.appendChild(svg("text", { class: "slo-label", x: m.l + iw - 4, y: y(threshold) - 5, "text-anchor": "end", text: spec.threshold.label }));
    }

    // hover: a guide line and a tooltip for the nearest interval
    const guide = svg("line", { class: "guide hidden", y1: m.t, y2: m.t + ih });
    root.appendChild(guide);
    const hit = svg("rect", { class: "hit", x: m.l, y: m.t, width: iw, height: ih });
    root.appendChild(hit);
    const nearest = (evt) => {
      const box = root.getBoundingClientRect();
      const px = ((evt.clientX - box.left) / box.width) * width;
      const t = since + ((px - m.l) / iw) * (until - since);
      let best = null, bestD = Infinity;
      for (const p of points) {
        const dd = Math.abs(p.ts + res / 2 - t);
        if (dd < bestD) { bestD = dd; best = p; }
      }
      return best;
    };
    hit.addEventListener("mousemove", (evt) => {
      const p = nearest(evt);
      if (!p) return;
      const gx = x(p.ts + res / 2);
      guide.setAttribute("x1", gx); guide.setAttribute("x2", gx);
      guide.classList.remove("hidden");
      const rows = spec.series.map((s) => [s.label, s.color, spec.tipFormat(s.get(p), s)]);
      rows.push(...(spec.tipExtra ? spec.tipExtra(p) : [["requests", null, compact(p.requests)]]));
      showTooltip(evt, clock(p.ts, xt.withDay) + "–" + clock(p.ts + res, false), rows);
    });
    hit.addEventListener("mouseleave", () => { guide.classList.add("hidden"); hideTooltip(); });
    container.appendChild(root);
    if (!drawn) container.appendChild(el("div", { class: "nodata", text: "no data in this window" }));
  }

  function showTooltip(evt, title, rows) {
    const tip = $("tooltip");
    clear(tip);
    tip.appendChild(el("div", { class: "t", text: title }));
    for (const [k, color, v] of rows) {
      tip.appendChild(el("div", { class: "row" },
        el("span", { class: "k" }, color ? el("i", { class: "swatch", style: { background: color } }) : null, k),
        el("b", { text: v })));
    }
    tip.classList.remove("hidden");
    const w = tip.offsetWidth, h = tip.offsetHeight;
    let left = evt.clientX + 14, topY = evt.clientY + 14;
    if (left + w > window.innerWidth - 8) left = evt.clientX - w - 14;
    if (topY + h > window.innerHeight - 8) topY = evt.clientY - h - 14;
    tip.style.left = left + "px";
    tip.style.top = topY + "px";
  }
  function hideTooltip() { $("tooltip").classList.add("hidden"); }

  // ---- KPI cards --------------------------------------------------------------------------
  /* lines: an array of lines, each an array of strings and elements */
  function kpi(label, value, unit, lines, meter) {
    const card = el("div", { class: "kpi" },
      el("div", { class: "label", text: label }),
      el("div", { class: "value" }, value, unit ? el("span", { class: "unit", text: unit }) : null));
    for (const line of lines) {
      const sub = el("div", { class: "sub" });
      for (const part of line) append(sub, part);
      card.appendChild(sub);
    }
    if (meter) {
      const bar = el("span", { style: { width: Math.max(0, Math.min(1, meter.value || 0)) * 100 + "%", background: meter.color } });
      card.appendChild(el("div", { class: "meter" }, bar));
    }
    return card;
  }

  function splitValue(text) {
    // "412 ms" -> ["412", "ms"]; "61.2 %" -> ["61.2", "%"]
    const i = text.lastIndexOf(NB);
    return i > 0 ? [text.slice(0, i), text.slice(i + 1)] : [text, ""];
  }

  function renderKpis(data) {
    const t = data.totals;
    const lat = t.latency_ms || {};
    const g = data.goodput || {};
    const sv = data.savings || {};
    const box = $("kpis");
    clear(box);
    const [hv, hu] = splitValue(pct(t.hit_rate_token_weighted));
    box.appendChild(kpi("Cache hit rate", hv, hu,
      [["predicted ", el("b", { text: pct(t.predicted_hit_rate) })],
       ["per-request mean ", el("b", { text: pct(t.hit_rate_per_request_mean) })]],
      { value: t.hit_rate_token_weighted, color: COLORS.measured }));
    box.appendChild(kpi("Requests", compact(t.requests), "",
      [[el("b", { text: rate(data.requests_per_s) }), " on average"],
       ["errors ", el("b", { text: pct(t.error_rate) }), " (" + compact(t.errors || 0) + ")"]]));
    const [gv, gu] = splitValue(pct(g.share));
    const slo = g.slo || {};
    const sloText = [isNum(slo.ttft_ms) ? "TTFT" + NB + "≤" + NB + ms(slo.ttft_ms) : null, isNum(slo.tpot_ms) ? "TPOT" + NB + "≤" + NB + ms(slo.tpot_ms) : null].filter(Boolean).join(", ");
    box.appendChild(kpi("Goodput", gv, gu,
      [[sloText || "no SLO configured"], [el("b", { text: rate(g.rate_per_s) }), " within the SLO"]],
      { value: g.share, color: COLORS.good }));
    const ttft = lat.ttft || {};
    const [tv, tu] = splitValue(ms(ttft.p50));
    box.appendChild(kpi("TTFT p50", tv, tu,
      [["p90 ", el("b", { text: ms(ttft.p90) })], ["p99 ", el("b", { text: ms(ttft.p99) })]]));
    const tpot = lat.tpot || {};
    const [pv, pu] = splitValue(ms(tpot.p50));
    box.appendChild(kpi("TPOT p50", pv, pu,
      [["p90 ", el("b", { text: ms(tpot.p90) })], ["p99 ", el("b", { text: ms(tpot.p99) })]]));
    const [sv1, su1] = splitValue(compact(sv.cached_tokens));
    box.appendChild(kpi("Saved by the cache", sv1, su1 ? su1 + " tokens" : "tokens",
      [["prefill ", el("b", { text: duration(sv.prefill_s) })],
       sv.usd === null || sv.usd === undefined ? ["set prices to see money"] : [el("b", { text: usd(sv.usd) }), " at your prices"]]));
  }

  // ---- tables -----------------------------------------------------------------------------
  function barCell(value, color) {
    return el("div", { class: "bar-cell" },
      el("div", { class: "bar" }, el("span", { style: { width: (isNum(value) ? Math.max(0, Math.min(1, value)) * 100 : 0) + "%", background: color || "" } })),
      el("span", { class: "v", text: pct(value) }));
  }

  function table(headers, rows, emptyText) {
    const thead = el("thead", null, el("tr", null, ...headers.map(([h, cls]) => el("th", { class: cls || null, text: h }))));
    const tbody = el("tbody");
    if (!rows.length) {
      tbody.appendChild(el("tr", null, el("td", { class: "empty-row", colspan: headers.length, text: emptyText })));
    }
    for (const r of rows) tbody.appendChild(r);
    return el("table", null, thead, tbody);
  }

  function routeSummary(routes, requests) {
    const entries = Object.entries(routes || {}).sort((a, b) => b[1] - a[1]);
    if (!entries.length || !requests) return "—";
    return entries.slice(0, 3).map(([k, n]) => k.replace(/_/g, " ") + " " + Math.round((100 * n) / requests) + " %").join(" · ");
  }

  function renderBackends(data) {
    const box = $("table-backends");
    clear(box);
    const live = data.backends || {};
    const by = data.by_backend || {};
    const urls = Array.from(new Set([...Object.keys(live), ...Object.keys(by)])).sort();
    const totalReq = Object.values(by).reduce((a, b) => a + (b.requests || 0), 0);
    const rows = urls.map((url) => {
      const b = by[url] || {};
      const l = live[url];
      const health = !l ? el("span", { class: "pill" }, el("i", { class: "dot" }), "not configured here")
        : el("span", { class: "pill" }, el("i", { class: "dot " + (l.healthy ? "live" : "down") }), l.healthy ? "healthy" : "down");
      const share = totalReq ? (b.requests || 0) / totalReq : null;
      return el("tr", { "data-backend": url },
        el("td", { class: "url mono", title: url, text: url }),
        el("td", null, health),
        el("td", { class: "num", text: l ? String(l.in_flight) : "—" }),
        el("td", { class: "num", text: compact(b.requests || 0) }),
        el("td", null, barCell(share, COLORS.predicted)),
        el("td", null, barCell(b.hit_rate_token_weighted, COLORS.measured)),
        el("td", null, barCell(b.predicted_hit_rate, COLORS.predicted)),
        el("td", { class: "label", text: routeSummary(b.cache_sources, b.requests) }),
        el("td", { class: "num", text: ms(((b.latency_ms || {}).ttft || {}).p50) }),
        el("td", { class: "num", text: ms(((b.latency_ms || {}).tpot || {}).p50) }),
        el("td", { class: "num", text: pct(b.error_rate) }),
        el("td", { class: "label", text: routeSummary(b.routes, b.requests) }));
    });
    box.appendChild(table(
      [["Replica"], ["Health"], ["In flight", "num"], ["Requests", "num"], ["Share of requests"], ["Hit rate"], ["Predicted"], ["Cache from"], ["TTFT p50", "num"], ["TPOT p50", "num"], ["Errors", "num"], ["Routed by"]],
      rows, "no backend"));
  }

  function estimate(est, fmt) {
    if (!est || !isNum(est.value)) return "—";
    const [lo, hi] = est.ci || [];
    return fmt(est.value) + (isNum(lo) && isNum(hi) ? " [" + fmt(lo) + ", " + fmt(hi) + "]" : "");
  }

  function points(v) { return (v >= 0 ? "+" : "") + (100 * v).toFixed(1) + " pt"; }
  function signedMs(v) { return (v >= 0 ? "+" : "−") + ms(Math.abs(v)); }

  function renderControl(data) {
    const block = data.control_group;
    $("card-control").classList.toggle("hidden", !block);
    const box = $("table-control");
    clear(box);
    if (!block) return;
    const share = (v) => pct(v, 1);
    const groups = block.groups || {};
    const row = (name, label, g) => el("tr", { "data-group": name },
      el("td", { class: "label", text: label }),
      el("td", { class: "num", text: compact(g.conversations || 0) }),
      el("td", { class: "num", text: compact(g.requests || 0) }),
      el("td", { class: "num", text: estimate(g.cached_share, share) }),
      el("td", { class: "num", text: estimate(g.ttft_p50_ms, ms) }),
      el("td", { class: "num", text: estimate(g.ttft_p90_ms, ms) }),
      el("td", { class: "num", text: estimate(g.goodput_share, share) }));
    const lift = block.lift || {};
    const liftRow = el("tr", { "data-group": "lift" },
      el("td", { class: "label", text: "lift (treated − control)" }),
      el("td", { class: "num", text: "" }),
      el("td", { class: "num", text: "" }),
      el("td", { class: "num", text: estimate(lift.cached_share, points) }),
      el("td", { class: "num", text: estimate(lift.ttft_p50_ms, signedMs) }),
      el("td", { class: "num", text: estimate(lift.ttft_p90_ms, signedMs) }),
      el("td", { class: "num", text: estimate(lift.goodput_share, points) }));
    box.appendChild(table(
      [["Group"], ["Conversations", "num"], ["Requests", "num"], ["Cached share", "num"], ["TTFT p50", "num"], ["TTFT p90", "num"], ["Goodput", "num"]],
      [row("treated", "treated (" + pct(1 - block.share, 1) + " of conversations)", groups.treated || {}),
        row("control", "control (" + pct(block.share, 1) + ")", groups.control || {}), liftRow],
      "no request yet"));
  }

  function renderPrefixes(data) {
    const box = $("table-prefixes");
    clear(box);
    const now = data.generated_at;
    const prefixes = data.top_prefixes || [];
    const labelled = prefixes.some((p) => p.label);
    const tokens = ((data.totals || {}).prompt_tokens) || 0;
    const rows = prefixes.map((p) => el("tr", { "data-anchor": p.anchor },
      el("td", { class: "mono", title: p.anchor, text: p.anchor.slice(0, 16) }),
      labelled ? el("td", { class: "label", title: p.label || "", text: p.label || "—" }) : null,
      el("td", { class: "num", text: compact(p.requests) }),
      el("td", { class: "num", text: compact(p.prompt_tokens) }),
      el("td", null, barCell(tokens ? p.prompt_tokens / tokens : null, COLORS.predicted)),
      el("td", null, barCell(p.hit_rate, COLORS.measured)),
      el("td", { class: "num", text: ago(p.last_seen, now) })));
    const headers = [["Prefix anchor"]];
    if (labelled) headers.push(["Label"]);
    headers.push(["Requests", "num"], ["Prompt tokens", "num"], ["Share of prompt tokens"], ["Hit rate"], ["Last seen", "num"]);
    box.appendChild(table(headers, rows, "no application prefix in this window"));
  }

  function barList(box, entries, total, color, emptyText, attr) {
    if (!entries.length) {
      box.appendChild(el("p", { class: "muted", text: emptyText }));
      return;
    }
    const max = entries[0][1] || 1;
    for (const [name, n] of entries) {
      box.appendChild(el("div", { class: "rule", [attr]: name, title: total ? pct(n / total) + " of requests" : "" },
        el("span", { class: "name", text: name }),
        el("div", { class: "bar" }, el("span", { style: { width: (n / max) * 100 + "%", background: color } })),
        el("span", { class: "n", text: compact(n) })));
    }
  }

  function renderRules(data) {
    const box = $("list-rules");
    clear(box);
    const totals = data.totals || {};
    const reqs = totals.requests || 0;
    const sorted = (o) => Object.entries(o || {}).sort((a, b) => b[1] - a[1]);
    box.appendChild(el("h3", { text: "Canonicalization rules" }));
    barList(box, sorted(totals.rules), reqs, COLORS.predicted, "No rule rewrote a request in this window.", "data-rule");
    box.appendChild(el("h3", { text: "Routing decisions" }));
    barList(box, sorted(totals.routes), reqs, COLORS.p50, "No routing decision recorded in this window.", "data-route");
  }

  function missRow(name, m, attrs) {
    const prompt = m.prompt_tokens || 0;
    const parts = [["cached", "served from cache", COLORS.cached, m.cached_tokens || 0]];
    for (const [key, label, color] of CAUSES) parts.push([key, label, color, (m.tokens || {})[key] || 0]);
    const stack = el("div", { class: "stack" });
    for (const [key, label, color, n] of parts) {
      if (!n || !prompt) continue;
      const seg = el("span", { "data-cause": key, style: { width: (100 * n) / prompt + "%", background: color } });
      seg.addEventListener("mousemove", (evt) => showTooltip(evt, name, [[label, compact(n) + " tokens · " + pct(n / prompt)]]));
      seg.addEventListener("mouseleave", hideTooltip);
      stack.appendChild(seg);
    }
    return el("div", Object.assign({ class: "miss-row" }, attrs),
      el("span", { class: "name", title: name, text: name }), stack,
      el("span", { class: "n", text: compact(prompt) + " tok" }));
  }

  function missFixes(m) {
    const out = [];
    const t = m.tokens || {};
    const u = m.uncached_tokens || 0;
    const share = (n) => (u ? " (" + pct(n / u) + " of uncached)" : "");
    const rules = Object.entries(m.breaker_rules || {}).sort((a, b) => b[1] - a[1]);
    if (t.breaker) out.push("breaker" + share(t.breaker) + ": turn on " + rules.map(([r]) => r).join(", ") + " (out of dry-run).");
    const why = Object.entries(m.routing_why || {}).sort((a, b) => b[1] - a[1]);
    if (t.routing) out.push("routing" + share(t.routing) + ": passed over for " + why.map(([w, n]) => w.replace(/_/g, " ") + " " + compact(n)).join(", ") + "; prefix-affinity routing, or a higher load-gate ratio, keeps a conversation where it is cached.");
    if (t.evicted) out.push("evicted" + share(t.evicted) + ": the replicas' caches are too small for this traffic: more slots or cache memory, or more replicas.");
    if (t.unexplained) out.push("unexplained" + share(t.unexplained) + ": the prefix index did not answer, or the backend served slightly less than predicted.");
    if (t.new && !out.length) out.push("new" + share(t.new) + ": nothing earlier shared these tokens; no setting would have cached them.");
    return out;
  }

  function renderMisses(data) {
    const box = $("misses");
    clear(box);
    const total = (data.totals || {}).misses || {};
    if (!total.requests) {
      box.appendChild(el("p", { class: "muted", text: "No request with backend-reported cached tokens in this window." }));
      return;
    }
    const legend = el("div", { class: "misses-legend" });
    const u = total.uncached_tokens || 0;
    legend.appendChild(el("span", { class: "key" }, el("i", { class: "swatch", style: { background: COLORS.cached } }),
      "served from cache " + compact(total.cached_tokens || 0)));
    for (const [key, label, color] of CAUSES) {
      const n = (total.tokens || {})[key] || 0;
      legend.appendChild(el("span", { class: "key", "data-cause": key }, el("i", { class: "swatch", style: { background: color } }),
        label + " " + compact(n) + (u ? " · " + pct(n / u) : "")));
    }
    box.appendChild(legend);
    box.appendChild(missRow("all traffic", total, { "data-row": "all" }));
    const by = data.by_backend || {};
    for (const url of Object.keys(by).sort()) {
      const m = by[url].misses || {};
      if (m.requests) box.appendChild(missRow(url, m, { "data-row": url }));
    }
    const fixes = missFixes(total);
    if (fixes.length) box.appendChild(el("ul", { class: "miss-fixes" }, ...fixes.map((f) => el("li", { text: f }))));
  }

  // ---- charts -----------------------------------------------------------------------------
  const pctAxis = (v) => Math.round(v * 100) + " %";
  const msAxis = (v) => ms(v);
  const countAxis = (v) => compact(v);
  const tipPct = (v) => pct(v);
  const tipMs = (v) => ms(v);
  const tipCount = (v) => (isNum(v) ? compact(v) : "0");

  function sloLabel(v) { return "SLO " + ms(v); }

  function renderCharts(data) {
    const slo = (data.goodput || {}).slo || {};
    const per = data.resolution_s >= 3600 ? "hour" : "minute";
    drawChart($("chart-hitrate"), data, {
      title: "Cache hit rate over time", kind: "line", yMax: 1, yFormat: pctAxis, tipFormat: tipPct,
      axisTitle: "prompt tokens cached",
      series: [
        { key: "measured", label: "measured (token-weighted)", color: COLORS.measured, area: true, get: (p) => p.hit_rate_token_weighted },
        { key: "predicted", label: "predicted by the index", color: COLORS.predicted, dashed: true, get: (p) => p.predicted_hit_rate },
      ],
      tipExtra: (p) => [["requests", null, compact(p.requests)]],
    });
    drawChart($("chart-tokens"), data, {
      title: "Prompt tokens, cached and computed", kind: "bars", yFormat: countAxis, tipFormat: tipCount,
      axisTitle: "tokens per " + per,
      series: [
        { key: "cached", label: "served from cache", color: COLORS.cached, get: (p) => p.cached_tokens },
        { key: "computed", label: "computed (prefill)", color: COLORS.computed, get: (p) => (isNum(p.prompt_tokens) ? Math.max(p.prompt_tokens - (p.cached_tokens || 0), 0) : null) },
      ],
      tipExtra: (p) => [["hit rate", null, pct(p.hit_rate_token_weighted)]],
    });
    drawChart($("chart-ttft"), data, {
      title: "Time to first token percentiles", kind: "line", yFormat: msAxis, tipFormat: tipMs,
      axisTitle: "TTFT", threshold: { value: slo.ttft_ms, label: sloLabel(slo.ttft_ms) },
      series: [
        { key: "p50", label: "p50", color: COLORS.p50, get: (p) => p.ttft_p50_ms },
        { key: "p90", label: "p90", color: COLORS.p90, get: (p) => p.ttft_p90_ms },
        { key: "p99", label: "p99", color: COLORS.p99, get: (p) => p.ttft_p99_ms },
      ],
    });
    drawChart($("chart-tpot"), data, {
      title: "Time per output token percentiles", kind: "line", yFormat: msAxis, tipFormat: tipMs,
      axisTitle: "TPOT", threshold: { value: slo.tpot_ms, label: sloLabel(slo.tpot_ms) },
      series: [
        { key: "p50", label: "p50", color: COLORS.p50, get: (p) => p.tpot_p50_ms },
        { key: "p90", label: "p90", color: COLORS.p90, get: (p) => p.tpot_p90_ms },
        { key: "p99", label: "p99", color: COLORS.p99, get: (p) => p.tpot_p99_ms },
      ],
    });
    drawChart($("chart-goodput"), data, {
      title: "Requests meeting the SLO", kind: "bars", yFormat: countAxis, tipFormat: tipCount,
      axisTitle: "requests per " + per,
      series: [
        { key: "met", label: "met the SLO", color: COLORS.good, get: (p) => p.slo_met },
        { key: "missed", label: "missed (slow or failed)", color: COLORS.bad, get: (p) => (p.slo_evaluated || 0) - (p.slo_met || 0) },
        { key: "unjudged", label: "not judged", color: COLORS.neutral, get: (p) => (p.requests || 0) - (p.slo_evaluated || 0) },
      ],
      tipExtra: (p) => [["goodput", null, pct(p.goodput_share)]],
    });
    const sloParts = [isNum(slo.ttft_ms) ? "TTFT ≤ " + ms(slo.ttft_ms) : null, isNum(slo.tpot_ms) ? "TPOT ≤ " + ms(slo.tpot_ms) : null].filter(Boolean);
    $("hint-goodput").textContent = sloParts.length
      ? "Requests per " + per + " that succeeded within the SLO (" + sloParts.join(" and ") + ")."
      : "No latency SLO is configured (--slo-ttft-ms, --slo-tpot-ms), so no request is judged.";
  }

  // ---- filters ----------------------------------------------------------------------------
  function fillSelect(select, values, current, allLabel) {
    const wanted = [""].concat(Array.from(values).sort());
    const have = Array.from(select.options).map((o) => o.value);
    if (wanted.join("\n") !== have.join("\n")) {
      clear(select);
      for (const v of wanted) select.appendChild(el("option", { value: v, text: v || allLabel }));
    }
    select.value = current;
  }

  function renderFilters(data) {
    for (const k of Object.keys(data.by_model || {})) state.models.add(k);
    for (const k of Object.keys(data.by_backend || {})) state.backends.add(k);
    for (const k of Object.keys(data.backends || {})) state.backends.add(k);
    if (state.model) state.models.add(state.model);
    if (state.backend) state.backends.add(state.backend);
    fillSelect($("model-select"), state.models, state.model, "all models");
    fillSelect($("backend-select"), state.backends, state.backend, "all backends");
    for (const b of document.querySelectorAll("#window-select button")) {
      b.setAttribute("aria-checked", b.dataset.window === state.window ? "true" : "false");
    }
  }

  // ---- page -------------------------------------------------------------------------------
  function renderEmpty(data) {
    const filtered = state.model || state.backend;
    if ((data.store || {}).degraded) {
      // Requests are served but not counted while the store fails: "no traffic" would be untrue.
      $("empty-title").textContent = "Statistics unavailable";
      $("empty-text").textContent = "The statistics store is failing, so requests served meanwhile are not counted here. Traffic still flows; this page recovers by itself.";
      $("empty-snippet").textContent = "";
      $("empty-snippet").classList.add("hidden");
      $("empty-refresh").textContent = "The page refreshes every " + REFRESH_MS[state.window] / 1000 + " seconds.";
      return;
    }
    $("empty-title").textContent = filtered ? "No requests match these filters" : "No traffic yet";
    $("empty-text").textContent = filtered
      ? "Nothing for this model or backend in the " + WINDOWS[state.window] + ". Clear a filter or pick a longer window."
      : "No request has gone through this proxy in the " + WINDOWS[state.window] + ". Point an OpenAI client at it:";
    const base = location.origin + location.pathname.replace(/\/dashboard\/?$/, "") + "/v1";
    $("empty-snippet").textContent = filtered ? "" :
      'from openai import OpenAI\nclient = OpenAI(base_url="' + base + '", api_key="unused")';
    $("empty-snippet").classList.toggle("hidden", !!filtered);
    $("empty-refresh").textContent = "The page refreshes every " + REFRESH_MS[state.window] / 1000 + " seconds.";
  }

  function render(data) {
    state.data = data;
    renderFilters(data);
    const empty = !data.totals || !data.totals.requests;
    document.body.dataset.state = empty ? "empty" : "data";
    $("empty-state").classList.toggle("hidden", !empty);
    $("charts").classList.toggle("hidden", empty);
    renderKpis(data);
    if (empty) renderEmpty(data);
    else {
      renderCharts(data);
      renderBackends(data);
      renderPrefixes(data);
      renderRules(data);
      renderMisses(data);
      renderControl(data);
    }
    const store = data.store || {};
    const storeBanner = $("store-banner");
    storeBanner.textContent = store.degraded
      ? "The " + (store.kind || "statistics") + " store is degraded: requests are still served, but those served while it fails are missing from these figures. Check prefixgate_store_degraded on /metrics and the proxy's store_degraded log line."
      : "";
    storeBanner.classList.toggle("hidden", !store.degraded);
    document.body.dataset.store = store.degraded ? "degraded" : "ok";
    $("status-dot").className = "dot " + (store.degraded ? "warn" : "live");
    $("status-text").textContent = (store.degraded ? "store degraded · " : "live · ") +
      "updated " + new Date(data.generated_at * 1000).toLocaleTimeString([], { hour12: false }) +
      " · " + (store.kind || "embedded") + " store";
    $("foot-window").textContent = WINDOWS[state.window] + " · " +
      (data.resolution_s >= 3600 ? "one point per hour" : "one point per minute") +
      " · refreshes every " + REFRESH_MS[state.window] / 1000 + " s · schema " + data.schema;
    state.renders += 1;
    document.body.dataset.renders = String(state.renders);
  }

  function statsUrl() {
    const q = new URLSearchParams({ window: state.window });
    if (state.model) q.set("model", state.model);
    if (state.backend) q.set("backend", state.backend);
    return "stats?" + q.toString();
  }

  function syncUrl() {
    const q = new URLSearchParams({ window: state.window });
    if (state.model) q.set("model", state.model);
    if (state.backend) q.set("backend", state.backend);
    history.replaceState(null, "", location.pathname + "?" + q.toString());
    $("stats-link").setAttribute("href", statsUrl());
  }

  async function refresh() {
    if (state.inFlight) return;
    state.inFlight = true;
    const banner = $("error-banner");
    try {
      const resp = await fetch(statsUrl(), { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } });
      const body = await resp.json().catch(() => null);
      if (!resp.ok) {
        const msg = body && body.error ? body.error.message : resp.statusText;
        throw new Error("HTTP " + resp.status + ": " + msg);
      }
      banner.classList.add("hidden");
      render(body);
    } catch (err) {
      banner.textContent = "Cannot load statistics from /stats — " + err.message + ". Showing the last data received; retrying.";
      banner.classList.remove("hidden");
      $("status-dot").className = "dot down";
      $("status-text").textContent = "disconnected";
      if (!state.data) document.body.dataset.state = "error";
    } finally {
      state.inFlight = false;
    }
  }

  function schedule() {
    clearInterval(state.timer);
    state.timer = setInterval(() => { if (!document.hidden) refresh(); }, REFRESH_MS[state.window]);
  }

  function onFilterChange() {
    syncUrl();
    refresh();
    schedule();
  }

  function init() {
    for (const b of document.querySelectorAll("#window-select button")) {
      b.addEventListener("click", () => { state.window = b.dataset.window; onFilterChange(); });
    }
    $("model-select").addEventListener("change", (e) => { state.model = e.target.value; onFilterChange(); });
    $("backend-select").addEventListener("change", (e) => { state.backend = e.target.value; onFilterChange(); });
    document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { if (state.data) render(state.data); }, 150);
    });
    renderFilters({});
    syncUrl();
    refresh();
    schedule();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
