// pagegate's KV-page dashboard: plain JavaScript, no library, no network beyond this server.
//
// Frames come over Server-Sent Events (read with fetch, so the API key travels as a header). A frame's
// page states are one byte per page (bit 7: a prefix-cache page, bits 0-6: refcount capped at 127), as runs
// of (byte, LEB128 length), base64; a frame that is not a key frame holds the XOR with the previous one.
"use strict";

(() => {
  const KEY_STORE = "pagegate.apiKey";
  const FEED = "/dashboard/api/feed";
  const RECENT = "/dashboard/api/recent";
  const RECENT_POLL_MS = 2000;
  const RETRY_MS = 1000;
  const HISTORY_POINTS = 300;
  const CACHED = 0x80;
  const REFCOUNT = 0x7f;
  const root = document.documentElement;
  const $ = (id) => document.getElementById(id);

  // ---- colours: one RGBA word per state byte, built once --------------------------------------------------
  const rgb = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  const word = ([r, g, b]) => (255 << 24 | b << 16 | g << 8 | r) >>> 0; // ImageData is RGBA in memory
  const mix = (a, b, t) => a.map((v, i) => Math.round(v + (b[i] - v) * t));
  const FREE = rgb("#e9ecef"), CACHED_FREE = rgb("#8ecae6"), USED = rgb("#2a9d8f");
  const SHARED_FEW = rgb("#f4a261"), SHARED_MANY = rgb("#9d0208"), HIGHLIGHT = word(rgb("#7b2cbf"));
  const WHITE = [255, 255, 255];

  function stateColour(state) {
    const refcount = state & REFCOUNT;
    if (refcount === 0) return state & CACHED ? CACHED_FREE : FREE;
    if (refcount === 1) return USED;
    return mix(SHARED_FEW, SHARED_MANY, Math.min(1, Math.log2(refcount) / 4)); // darkest from 16 holders
  }
  const PALETTE = new Uint32Array(256), DIMMED = new Uint32Array(256);
  for (let s = 0; s < 256; s++) {
    PALETTE[s] = word(stateColour(s));
    DIMMED[s] = word(mix(stateColour(s), WHITE, 0.7));
  }

  function describe(state) {
    const refcount = state & REFCOUNT, count = refcount === REFCOUNT ? "127+" : String(refcount);
    if (refcount === 0) return state & CACHED ? "cached, evictable" : "free";
    return refcount === 1 ? "used by one sequence" : `shared by ${count}`;
  }

  // ---- run-length decoding ---------------------------------------------------------------------------------
  function base64Bytes(text) {
    const binary = atob(text), out = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
    return out;
  }

  function decodeRuns(text, states, delta) {
    const data = base64Bytes(text);
    let i = 0, k = 0;
    while (k < data.length) {
      const value = data[k++];
      let run = 0, shift = 0, b;
      do { b = data[k++]; run += (b & 0x7f) * 2 ** shift; shift += 7; } while (b & 0x80);
      const end = Math.min(i + run, states.length);
      if (!delta) states.fill(value, i, end);
      else if (value !== 0) for (let j = i; j < end; j++) states[j] ^= value;
      i = end;
    }
  }

  // ---- a pool as a grid: one pixel per page off screen, scaled up without smoothing -------------------------
  class PoolGrid {
    constructor(canvas, box) {
      this.canvas = canvas;
      this.box = box;
      this.states = new Uint8Array(0);
      this.mask = null; // pages to highlight, or null
      this.pixels = document.createElement("canvas");
    }

    resize(n) {
      this.states = new Uint8Array(n);
      const width = this.box.clientWidth, height = this.box.clientHeight;
      let cell = Math.floor(Math.sqrt((width * height) / Math.max(n, 1)));
      let cols, rows;
      for (cell = Math.max(cell, 1); ; cell--) {
        cols = Math.max(1, Math.floor(width / cell));
        rows = Math.ceil(n / cols);
        if (rows * cell <= height || cell === 1) break;
      }
      if (rows * cell > height) { // more pages than pixels: squeeze (rare: > 400k pages in the box)
        cols = Math.ceil(Math.sqrt((n * width) / height));
        rows = Math.ceil(n / cols);
        cell = Math.min(width / cols, height / rows);
      }
      Object.assign(this, { cols, rows, cell });
      this.canvas.dataset.cols = cols; // for tests and scripts that point at a page
      const ratio = window.devicePixelRatio || 1;
      this.canvas.style.width = `${cols * cell}px`;
      this.canvas.style.height = `${Math.max(rows, 1) * cell}px`;
      this.canvas.width = Math.round(cols * cell * ratio);
      this.canvas.height = Math.round(Math.max(rows, 1) * cell * ratio);
      this.pixels.width = cols;
      this.pixels.height = Math.max(rows, 1);
      this.image = new ImageData(cols, Math.max(rows, 1));
      this.words = new Uint32Array(this.image.data.buffer);
    }

    render() {
      const { states, words, mask } = this;
      const palette = mask ? DIMMED : PALETTE;
      words.fill(0);
      for (let i = 0; i < states.length; i++) words[i] = mask && mask[i] ? HIGHLIGHT : palette[states[i]];
      this.pixels.getContext("2d").putImageData(this.image, 0, 0);
      const ctx = this.canvas.getContext("2d");
      ctx.imageSmoothingEnabled = false;
      ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
      ctx.drawImage(this.pixels, 0, 0, this.canvas.width, this.canvas.height);
      this.drawGaps(ctx);
    }

    drawGaps(ctx) { // thin white lines between cells once cells are big enough to read one by one
      const scale = this.canvas.width / this.cols;
      if (scale < 6) return;
      ctx.fillStyle = "#ffffff";
      for (let c = 1; c < this.cols; c++) ctx.fillRect(Math.round(c * scale) - 1, 0, 1, this.canvas.height);
      for (let r = 1; r < this.rows; r++) ctx.fillRect(0, Math.round(r * scale) - 1, this.canvas.width, 1);
    }

    pageAt(event) {
      const rect = this.canvas.getBoundingClientRect();
      const col = Math.floor(((event.clientX - rect.left) / rect.width) * this.cols);
      const row = Math.floor(((event.clientY - rect.top) / rect.height) * this.rows);
      const page = row * this.cols + col;
      return col >= 0 && col < this.cols && row >= 0 && page < this.states.length ? page : -1;
    }
  }

  // ---- sparklines ------------------------------------------------------------------------------------------
  function sparkline(canvas, values, { max = null, bars = false, colour = "#2a9d8f" } = {}) {
    const ratio = window.devicePixelRatio || 1, width = canvas.clientWidth || 300, height = canvas.clientHeight || 36;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.fillStyle = "#f1f3f5";
    ctx.fillRect(0, 0, width, height);
    const top = max ?? Math.max(1, ...values.filter((v) => v !== null));
    const step = width / HISTORY_POINTS, x0 = width - values.length * step;
    const y = (v) => height - 2 - (v / top) * (height - 4);
    ctx.fillStyle = ctx.strokeStyle = colour;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    values.forEach((v, i) => {
      const x = x0 + i * step;
      if (v === null) { drawing = false; return; }
      if (bars) { if (v > 0) ctx.fillRect(x, y(v), Math.max(step, 1), height - y(v)); return; }
      if (drawing) ctx.lineTo(x, y(v)); else ctx.moveTo(x, y(v));
      drawing = true;
    });
    if (!bars) ctx.stroke();
  }

  // ---- state -----------------------------------------------------------------------------------------------
  const device = new PoolGrid($("device-grid"), $("device-box"));
  const cpu = new PoolGrid($("cpu-grid"), $("cpu-box"));
  let history = [];
  let frames = 0;
  let hovered = null; // { request, fetchedAt }
  let renderQueued = false;
  let recentPolling = false;

  const percent = (v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(1)}%`);
  const number = (v) => v.toLocaleString("en-US");

  function authHeaders() {
    const key = sessionStorage.getItem(KEY_STORE);
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  function queueRender() {
    if (renderQueued) return;
    renderQueued = true;
    requestAnimationFrame(() => {
      renderQueued = false;
      device.render();
      if (cpu.states.length) cpu.render();
    });
  }

  function applyPages(grid, text, total, key) {
    if (key || grid.states.length !== total) grid.resize(total);
    decodeRuns(text, grid.states, !key);
  }

  function applyFrame(f) {
    applyPages(device, f.pages, f.total_pages, f.key);
    applyPages(cpu, f.cpu_pages, f.cpu_total_pages, f.key);
    $("cpu-pool").hidden = f.cpu_total_pages === 0;
    frames += 1;
    Object.assign(root.dataset, {
      totalPages: f.total_pages, usedPages: f.used_pages, sharedPages: f.shared_pages,
      cachedPages: f.cached_pages, running: f.running, waiting: f.waiting, swapped: f.swapped,
      cpuUsedPages: f.cpu_used_pages, health: f.health, frames,
    });
    showFigures(f);
    if (f.queues) showQueues(f.queues);
    if (f.history) history = (f.key ? f.history : history.concat(f.history)).slice(-HISTORY_POINTS);
    if (f.history) showHistory(f);
    if (hovered && performance.now() - hovered.fetchedAt > 500) highlight(hovered.request);
    queueRender();
  }

  function showFigures(f) {
    $("model").textContent = f.model;
    $("device-caption").textContent = `${number(f.total_pages)} pages`;
    $("cpu-caption").textContent = `${number(f.cpu_total_pages)} pages`;
    $("health").textContent = f.health;
    $("health").className = `badge ${f.health}`;
    $("health-reason").textContent = f.health_reason;
    $("f-used").textContent = `${number(f.used_pages)} of ${number(f.total_pages)} (${percent(f.usage)})`;
    $("f-shared").textContent = number(f.shared_pages);
    $("f-cached").textContent = number(f.cached_pages);
    $("f-cpu").textContent = `${number(f.cpu_used_pages)} of ${number(f.cpu_total_pages)}`;
    $("f-tiers").textContent = f.host_tier_capacity || f.disk_tier_capacity
      ? `${number(f.host_tier_pages)} of ${number(f.host_tier_capacity)} · ${number(f.disk_tier_pages)} of ` +
        `${number(f.disk_tier_capacity)} (${number(f.tier_hit_pages)})`
      : "off";
    $("f-queues").textContent = `${f.running} · ${f.waiting} · ${f.swapped}`;
    $("f-cap").textContent = number(f.running_cap);
    $("f-hits").textContent = percent(f.prefix_hit_rate);
    $("f-spec").textContent = percent(f.spec_acceptance_rate);
    $("f-preemptions").textContent = `${number(f.preemptions)} · ${number(f.swap_outs)}`;
    $("f-models").textContent = f.models ?? "one";
  }

  function showHistory(f) {
    const column = (i) => history.map((p) => p[i]);
    const last = (i) => history.map((p) => p[i]).filter((v) => v !== null).pop() ?? null;
    sparkline($("s-usage"), column(1), { max: 1 });
    sparkline($("s-hits"), column(2), { max: 1, bars: true, colour: "#3a86ff" }); // only seconds with prompts
    sparkline($("s-preemptions"), column(3), { bars: true, colour: "#e76f51" });
    sparkline($("s-swaps"), column(4), { bars: true, colour: "#9d0208" });
    $("s-usage-now").textContent = percent(f.usage);
    $("s-hits-now").textContent = percent(last(2));
    $("s-preemptions-now").textContent = last(3) ?? "";
    $("s-swaps-now").textContent = last(4) ?? "";
  }

  function showQueues(queues) {
    for (const name of ["running", "waiting", "swapped"]) {
      const { count, requests } = queues[name];
      $(`${name}-count`).textContent = count;
      const list = $(`${name}-list`);
      const kept = new Map([...list.querySelectorAll("li[data-request]")].map((li) => [li.dataset.request, li]));
      const items = requests.map(([id, seqs, pages]) => { // id null: another API key's request
        const item = id === null ? queueItem(null) : kept.get(id) || queueItem(id);
        item.lastChild.textContent = `${seqs} seq${seqs === 1 ? "" : "s"} · ${pages} pages`;
        return item;
      });
      if (count > requests.length) {
        const more = document.createElement("li");
        more.className = "more";
        more.textContent = `… and ${count - requests.length} more`;
        items.push(more);
      }
      list.replaceChildren(...items); // the same elements where the request stays: hover and focus survive
    }
  }

  function queueItem(id) {
    const item = document.createElement("li"), label = document.createElement("span");
    const meta = document.createElement("span");
    if (id !== null) item.dataset.request = id; // only a named request can be hovered
    label.className = "rid";
    label.textContent = label.title = id ?? "another key's request";
    meta.className = "meta";
    item.append(label, meta);
    return item;
  }

  // ---- hovering: a request's pages, a page's holders ---------------------------------------------------------
  async function getJSON(path) {
    const response = await fetch(path, { headers: authHeaders(), cache: "no-store" });
    return response.ok ? response.json() : null;
  }

  async function highlight(request) {
    hovered = { request, fetchedAt: performance.now() };
    const body = await getJSON(`/dashboard/api/pages?request=${encodeURIComponent(request)}`);
    if (hovered === null || hovered.request !== request) return;
    device.mask = maskOf(body ? body.pages : [], device.states.length);
    cpu.mask = maskOf(body ? body.cpu_pages : [], cpu.states.length);
    root.dataset.highlightedPages = body ? body.pages.length + body.cpu_pages.length : 0;
    queueRender();
  }

  // ---- the last finished requests: where each one's time went ----------------------------------------------
  async function pollRecent() {
    const body = document.hidden ? null : await getJSON(RECENT).catch(() => null);
    if (body) showRecent(body.requests);
    setTimeout(pollRecent, RECENT_POLL_MS);
  }

  function showRecent(rows) {
    const ms = (v) => v.toFixed(v < 10 ? 1 : 0);
    $("recent-rows").replaceChildren(...rows.map((r) => {
      const tr = document.createElement("tr");
      const cells = [r.request_id ?? "another key's request", `${r.prompt_tokens} · ${r.completion_tokens}`,
        ms(r.queue_ms), ms(r.prefill_ms), ms(r.decode_ms), ms(r.preempted_ms), `${r.preemptions} · ${r.swaps}`,
        r.prefix_hit_pages, r.pages_held];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (i === 0) { td.className = "rid"; td.title = text; }
        tr.append(td);
      });
      return tr;
    }));
    root.dataset.recentRequests = rows.length;
  }

  function maskOf(pages, n) {
    const mask = new Uint8Array(n);
    for (const page of pages) if (page < n) mask[page] = 1;
    return mask;
  }

  function unhighlight() {
    hovered = null;
    device.mask = cpu.mask = null;
    delete root.dataset.highlightedPages;
    document.querySelectorAll(".queue li.active").forEach((li) => li.classList.remove("active"));
    queueRender();
  }

  $("queues").addEventListener("mouseover", (event) => {
    const item = event.target.closest("li[data-request]");
    if (!item || (hovered && hovered.request === item.dataset.request)) return;
    document.querySelectorAll(".queue li.active").forEach((li) => li.classList.remove("active"));
    item.classList.add("active");
    highlight(item.dataset.request);
  });
  $("queues").addEventListener("mouseleave", unhighlight);

  const tooltip = $("tooltip");
  let tipFor = "", tipTimer = 0;

  function showTip(grid, pool, event) {
    const page = grid.pageAt(event);
    if (page < 0) { tooltip.hidden = true; tipFor = ""; return; }
    const state = grid.states[page], refcount = state & REFCOUNT, id = `${pool}:${page}:${state}`;
    tooltip.hidden = false;
    place(event);
    if (id === tipFor) return;
    tipFor = id;
    const lines = [`<b>${pool === "cpu" ? "CPU page" : "Page"} ${page}</b>`, describe(state),
      `refcount ${refcount === REFCOUNT ? "127+" : refcount}`,
      `prefix-cache page: ${state & CACHED ? "yes" : "no"}`];
    tooltip.innerHTML = lines.join("<br>");
    clearTimeout(tipTimer);
    if (refcount === 0) { place(event); return; }
    const holders = document.createElement("div");
    holders.textContent = "held by …";
    tooltip.append(holders);
    place(event);
    tipTimer = setTimeout(async () => {
      const body = await getJSON(`/dashboard/api/page?pool=${pool}&id=${page}`);
      if (tipFor === id) holders.textContent = body ? `held by: ${holderNames(body)}` : "";
      place(event);
    }, 80);
  }

  function holderNames({ requests, other_requests: others }) {
    const names = others ? [...requests, `${others} from other keys`] : requests;
    return names.join(", ") || "–";
  }

  function place(event) { // beside the pointer, on whichever side has room
    const { offsetWidth: width, offsetHeight: height } = tooltip;
    const left = event.clientX + 14 + width > window.innerWidth ? event.clientX - 14 - width : event.clientX + 14;
    const top = event.clientY + 14 + height > window.innerHeight ? event.clientY - 14 - height : event.clientY + 14;
    tooltip.style.left = `${Math.max(0, left)}px`;
    tooltip.style.top = `${Math.max(0, top)}px`;
  }

  for (const [grid, pool] of [[device, "device"], [cpu, "cpu"]]) {
    grid.canvas.addEventListener("mousemove", (event) => showTip(grid, pool, event));
    grid.canvas.addEventListener("mouseleave", () => { tooltip.hidden = true; tipFor = ""; });
  }

  // ---- the feed --------------------------------------------------------------------------------------------
  function setConnection(text) { $("connection").textContent = text; }

  function showLogin(message) {
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    setConnection("needs an API key");
  }

  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("api-key").value);
    $("login").hidden = true;
    connect();
  });

  function handleMessage(message) {
    const data = message.split("\n").filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(5).trimStart()).join("\n");
    if (data) applyFrame(JSON.parse(data));
  }

  async function connect() {
    if (root.dataset.authRequired === "true" && !sessionStorage.getItem(KEY_STORE)) {
      showLogin();
      return;
    }
    setConnection("connecting…");
    let response;
    try {
      response = await fetch(FEED, { headers: authHeaders(), cache: "no-store" });
    } catch {
      setTimeout(connect, RETRY_MS);
      return;
    }
    if (response.status === 401) {
      sessionStorage.removeItem(KEY_STORE);
      showLogin("That key was refused.");
      return;
    }
    if (!response.ok) { // 503: the server is loading, stopping, or has all the viewers it takes
      setConnection(`feed answered ${response.status}; retrying`);
      setTimeout(connect, Number(response.headers.get("Retry-After")) * 1000 || RETRY_MS);
      return;
    }
    setConnection("live");
    if (!recentPolling) { recentPolling = true; pollRecent(); }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          handleMessage(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
        }
      }
    } catch {
      // the connection dropped: reconnect below
    }
    setConnection("disconnected; retrying");
    setTimeout(connect, RETRY_MS);
  }

  connect();
})();
