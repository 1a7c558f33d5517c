// The rvllm dashboard: polls /v1/engine/stats once a second and shows it.
// Plain JavaScript, no library; the charts are drawn on canvases by hand.
"use strict";

(function () {
  const STATS_URL = "v1/engine/stats"; // relative: works behind a path prefix too
  const KEY_NAME = "rvllm-dashboard-api-key";
  const POLL_MS = 1000;
  const CHART_POINTS = 120; // two minutes at one reading a second

  const history = { prompt: [], generation: [], running: [], waiting: [], kv: [] };
  // What the page has shown, for anyone (and the tests) to read.
  const state = { updates: 0, last: null };
  window.rvllmDashboard = state;
  let timer = null;
  let configShown = "";

  const $ = (id) => document.getElementById(id);

  function setText(id, text) {
    const el = $(id);
    if (el.textContent !== text) el.textContent = text;
  }

  function number(value, digits) {
    if (value === null || value === undefined) return "-";
    return value.toLocaleString("en-US", {
      maximumFractionDigits: digits === undefined ? 0 : digits,
      minimumFractionDigits: digits === undefined ? 0 : digits,
    });
  }

  function percent(fraction) {
    if (fraction === null || fraction === undefined) return "-";
    return (100 * fraction).toFixed(1) + " %";
  }

  function seconds(value) {
    if (value === null || value === undefined) return "-";
    if (value < 1) return (1000 * value).toFixed(1) + " ms";
    return value.toFixed(2) + " s";
  }

  function rate(value) {
    if (value === null || value === undefined) return "-";
    return number(value, value < 100 ? 1 : 0);
  }

  // ------------------------------------------------------------ the API key

  function storedKey() {
    try {
      return window.localStorage.getItem(KEY_NAME) || "";
    } catch (e) {
      return "";
    }
  }

  function storeKey(key) {
    try {
      if (key) window.localStorage.setItem(KEY_NAME, key);
      else window.localStorage.removeItem(KEY_NAME);
    } catch (e) {
      // storage refused (a private window): the key lasts as long as the page
    }
    memoryKey = key;
  }

  let memoryKey = storedKey();

  function showKeyForm(message) {
    $("key-form").hidden = false;
    setText("key-error", message);
    $("api-key").focus();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    storeKey($("api-key").value.trim());
    $("api-key").value = "";
    pollNow();
  });

  $("forget-key").addEventListener("click", () => {
    storeKey("");
    pollNow();
  });

  // ------------------------------------------------------------ polling

  function setStatus(name, text) {
    const el = $("status");
    el.dataset.state = name;
    setText("status", text);
  }

  function pollNow() {
    clearTimeout(timer);
    poll();
  }

  function later() {
    clearTimeout(timer);
    timer = setTimeout(poll, POLL_MS);
  }

  async function poll() {
    const headers = {};
    const key = memoryKey;
    if (key) headers.Authorization = "Bearer " + key;
    $("forget-key").hidden = !key;
    let response;
    try {
      response = await fetch(STATS_URL, { headers: headers, cache: "no-store" });
    } catch (e) {
      setStatus("offline", "server unreachable");
      return later();
    }
    if (response.status === 401) {
      setStatus("locked", "API key needed");
      showKeyForm(key ? "That key was refused." : "");
      return; // until a key is given
    }
    if (!response.ok) {
      setStatus("error", "HTTP " + response.status);
      return later();
    }
    let stats;
    try {
      stats = await response.json();
      $("key-form").hidden = true;
      render(stats);
      setStatus("live", "live");
    } catch (e) {
      setStatus("error", "bad answer: " + e.message);
    }
    later();
  }

  // ------------------------------------------------------------ rendering

  function render(s) {
    state.last = s;
    setText("model", s.config.model);
    setText("updated", "updated " + new Date(s.time * 1000).toLocaleTimeString());

    setText("running", number(s.requests.running));
    setText("waiting", number(s.requests.waiting));
    setText("swapped", number(s.requests.swapped));

    const kv = s.kv_cache;
    setText("kv-usage", percent(kv.usage));
    $("kv-bar").style.width = (100 * kv.usage).toFixed(1) + "%";
    setText("kv-blocks", number(kv.num_blocks - kv.num_free_blocks) + " of " +
            number(kv.num_blocks) + " blocks in use");

    const prefix = s.prefix_cache;
    setText("prefix-hit-rate", percent(prefix.recent_hit_rate));
    setText("prefix-hit-rate-total", percent(prefix.hit_rate) + " since start");

    setText("prompt-tps", rate(s.throughput.prompt_tokens_per_s));
    setText("generation-tps", rate(s.throughput.generation_tokens_per_s));
    setText("prompt-total", number(s.totals.prompt_tokens) + " tokens since start");
    setText("generation-total", number(s.totals.generation_tokens) + " tokens since start");
    setText("preemptions", number(s.totals.preemptions));

    const finished = s.totals.finished_requests;
    const reasons = Object.keys(finished).sort();
    setText("finished", number(reasons.reduce((sum, r) => sum + finished[r], 0)));
    setText("finished-detail", reasons.map((r) => r + " " + finished[r]).join(", "));

    const spec = s.spec_decode;
    $("spec-tile").hidden = !spec;
    if (spec) {
      setText("spec-acceptance", percent(spec.acceptance_rate));
      setText("spec-detail", number(spec.num_accepted_tokens) + " of " +
              number(spec.num_draft_tokens) + " drafted, " +
              number(spec.mean_acceptance_length, 2) + " tokens a step");
    }
    $("structured-tile").hidden = !s.totals.structured_output_requests;
    setText("structured-requests", number(s.totals.structured_output_requests));

    renderLatency(s.latency);
    renderReplicas(s);
    renderRequests(s.live_requests, s.config.show_prompts);
    renderConfig(s.config);
    renderCharts(s);
    state.updates += 1;
  }

  function renderLatency(latency) {
    setText("latency-window", number(latency.window_s));
    for (const name of ["ttft", "tpot", "e2e"]) {
      const p = latency[name];
      setText(name + "-p50", seconds(p.p50));
      setText(name + "-p90", seconds(p.p90));
      setText(name + "-p99", seconds(p.p99));
      setText(name + "-count", number(p.count));
    }
  }

  function row(cells, className) {
    const tr = document.createElement("tr");
    if (className) tr.className = className;
    for (const cell of cells) {
      const td = document.createElement("td");
      if (typeof cell === "object" && cell !== null) {
        td.textContent = cell.text;
        if (cell.className) td.className = cell.className;
      } else {
        td.textContent = cell;
      }
      tr.appendChild(td);
    }
    return tr;
  }

  function renderReplicas(s) {
    $("replicas-section").hidden = s.replicas.length === 0;
    if (s.replicas.length === 0) return;
    const rows = s.replicas.map((r) => row([
      String(r.index), r.alive ? "running" : "restarting", r.device || "-",
      number(r.requests.running), number(r.requests.waiting), number(r.requests.swapped),
      percent(r.kv_cache.usage),
      rate(r.throughput.prompt_tokens_per_s), rate(r.throughput.generation_tokens_per_s),
      number(r.totals.generation_tokens), number(r.totals.preemptions),
    ]));
    rows.push(row([
      "sum", "", "", number(s.requests.running), number(s.requests.waiting),
      number(s.requests.swapped), percent(s.kv_cache.usage), rate(s.throughput.prompt_tokens_per_s),
      rate(s.throughput.generation_tokens_per_s), number(s.totals.generation_tokens),
      number(s.totals.preemptions),
    ], "sum"));
    $("replicas").replaceChildren(...rows);
  }

  function renderRequests(requests, showPrompts) {
    for (const el of document.querySelectorAll("th.prompt-col")) el.hidden = !showPrompts;
    const rows = requests.map((r) => {
      const cells = [
        r.id, { text: r.state, className: "state-" + r.state },
        r.prompt_tokens === null ? "-" : number(r.prompt_tokens), number(r.output_tokens),
        r.age_s.toFixed(1) + " s",
      ];
      if (showPrompts) cells.push({ text: r.prompt || "", className: "prompt-col" });
      const tr = row(cells);
      tr.dataset.id = r.id;
      if (showPrompts && r.prompt) tr.lastChild.title = r.prompt;
      return tr;
    });
    $("requests").replaceChildren(...rows);
    setText("live-count", String(requests.length));
    $("no-requests").hidden = requests.length > 0;
  }

  const CONFIG_LABELS = [
    ["model", "Served model"], ["model_path", "Model path"],
    ["architecture", "Architecture"], ["max_model_len", "Context length"],
    ["dtype", "Data type"], ["kv_cache_dtype", "KV-cache data type"],
    ["quantization", "Quantization"], ["packed_activations", "Packed weights' activations"],
    ["kernel_backend", "Kernel backend"],
    ["device", "Device"], ["block_size", "Block size (tokens)"],
    ["num_blocks", "KV-cache blocks"], ["num_cpu_blocks", "CPU swap blocks"],
    ["max_num_seqs", "Max running requests"],
    ["max_num_batched_tokens", "Max tokens a step"],
    ["enable_prefix_caching", "Prefix caching"], ["speculative", "Speculative decoding"],
    ["tensor_parallel_size", "Tensor-parallel size"],
    ["data_parallel_size", "Data-parallel replicas"], ["threads", "Engine threads"],
    ["cpu_count", "CPUs"], ["show_prompts", "Prompts shown"],
    ["rvllm_version", "rvllm version"],
  ];

  function renderConfig(config) {
    const text = JSON.stringify(config);
    if (text === configShown) return;
    configShown = text;
    const rows = CONFIG_LABELS.map(([name, label]) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.textContent = label;
      const td = document.createElement("td");
      const value = config[name];
      td.textContent = value === null || value === undefined ? "-" :
        (value === true ? "yes" : value === false ? "no" : String(value));
      td.id = "config-" + name;
      tr.append(th, td);
      return tr;
    });
    $("config").replaceChildren(...rows);
  }

  // ------------------------------------------------------------ charts

  function push(series, value) {
    series.push(value === null || value === undefined ? 0 : value);
    if (series.length > CHART_POINTS) series.shift();
  }

  function renderCharts(s) {
    push(history.prompt, s.throughput.prompt_tokens_per_s);
    push(history.generation, s.throughput.generation_tokens_per_s);
    push(history.running, s.requests.running);
    push(history.waiting, s.requests.waiting);
    push(history.kv, 100 * s.kv_cache.usage);
    const css = getComputedStyle(document.documentElement);
    const color = (name) => css.getPropertyValue("--" + name).trim();
    drawChart($("chart-tps"), [[history.prompt, color("prompt")],
                               [history.generation, color("generation")]], null, color);
    drawChart($("chart-requests"), [[history.running, color("running")],
                                    [history.waiting, color("waiting")]], null, color);
    drawChart($("chart-kv"), [[history.kv, color("kv")]], 100, color);
  }

  // Lines of the last CHART_POINTS readings, newest at the right; the y axis from 0 to
  // ``fixedMax`` or to a round number above the largest value.
  function drawChart(canvas, lines, fixedMax, color) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 400;
    const height = canvas.clientHeight || 140;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);

    let max = fixedMax;
    if (max === null) {
      const top = Math.max(1, ...lines.flatMap(([values]) => values));
      const step = Math.pow(10, Math.floor(Math.log10(top)));
      max = Math.ceil(top / step) * step;
    }
    const left = 36;
    const plotWidth = width - left - 4;
    const plotHeight = height - 12;
    const y = (v) => 4 + plotHeight - (plotHeight * Math.min(v, max)) / max;

    ctx.strokeStyle = color("line");
    ctx.fillStyle = color("muted");
    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    for (const fraction of [0, 0.5, 1]) {
      const value = max * fraction;
      const at = Math.round(y(value)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(left, at);
      ctx.lineTo(width - 4, at);
      ctx.stroke();
      ctx.fillText(value >= 1000 ? (value / 1000).toFixed(1) + "k" : String(+value.toFixed(1)),
                   2, at + 4);
    }
    ctx.lineWidth = 2;
    for (const [values, stroke] of lines) {
      ctx.strokeStyle = stroke;
      ctx.beginPath();
      values.forEach((v, i) => {
        const x = left + plotWidth * (1 - (values.length - 1 - i) / (CHART_POINTS - 1));
        if (i === 0) ctx.moveTo(x, y(v));
        else ctx.lineTo(x, y(v));
      });
      ctx.stroke();
    }
  }

  poll();
})();
