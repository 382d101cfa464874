// One sandbox: overview and actions (its state followed live), a terminal (a new shell, or attached to a running
// process with replay), files (list, drag-and-drop upload, download, delete), processes with followed output, its
// ports on URLs of their own (pages/ports.js), the last hour of metrics, its audit events, and its snapshots with
// their forks.

import { base64Bytes, call, enc, get, ndjson, post, query } from "../api.js";
import { chart } from "../chart.js";
import { AttachedTerminal } from "../terminal.js";
import { action, clear, confirm, dialog, errorBox, every, fmtBytes, fmtTime, h, table, toast } from "../ui.js";
import { ports } from "./ports.js";
import { createSandbox, persistentBadge, sandboxActions, takeSnapshot } from "./sandboxes.js";

const TABS = ["overview", "terminal", "files", "processes", "ports", "metrics", "events", "snapshots"];
const TITLES = { overview: "Overview", terminal: "Terminal", files: "Files", processes: "Processes", ports: "Ports",
  metrics: "Metrics", events: "Events", snapshots: "Snapshots" };

/** How often the page looks for a change of the sandbox (its state after an idle suspend, a stop elsewhere). */
const WATCH_MS = 5000;

export function renderSandbox(main, id, tab = "overview", arg = "") {
  if (!TABS.includes(tab)) tab = "overview";
  const head = h("div.sandbox-head");
  const body = h("section.tab-body", { "aria-labelledby": `tab-${tab}` });
  const nav = h("nav.tabs", { "aria-label": "Sandbox" }, TABS.map((t) =>
    h("a", { href: `#/sandboxes/${enc(id)}/${t}`, id: `tab-${t}`, "aria-current": t === tab ? "page" : null },
      TITLES[t])));
  clear(main, h("p", h("a", { href: "#/sandboxes" }, "← Sandboxes")), head, nav, body);
  const cleanups = [];
  let left = false;
  let shown = "";
  // Each look is numbered when it is asked: an answer older than the one shown (a poll answered after an action's
  // own reading) is dropped.
  let asked = 0;
  let drawn = 0;
  // Redrawn only when the sandbox changed, so a button is not replaced under the pointer.
  const show = (s, ticket) => {
    if (left || ticket < drawn) return;
    drawn = ticket;
    const text = JSON.stringify(s);
    if (text === shown) return;
    shown = text;
    const focused = document.activeElement?.dataset?.focus;
    clear(head,
      h("div.bar", h("h1", s.name || s.id, persistentBadge(s)),
        h("span.sandbox-state", h(`span.state.${s.state}`, s.state),
          s.stopped_reason ? h("span.muted", ` (${s.stopped_reason})`) : null)),
      h("div.row-actions", sandboxActions(s, () => loadHead()),
        s.state !== "terminated" ? h("a.button", { href: `#/ssh/${enc(s.id)}` }, "SSH") : null));
    if (focused) head.querySelector(`[data-focus="${CSS.escape(focused)}"]`)?.focus();
    if (tab === "overview") overview(body, id, s);
  };
  const loadHead = async () => {
    const ticket = ++asked;
    try {
      const s = await get(`/v1/sandboxes/${enc(id)}`);
      show(s, ticket);
      return s;
    } catch (error) {
      shown = "";
      clear(head, h("h1", id), errorBox(error));
      return null;
    }
  };
  loadHead().then((s) => {
    if (left) return;
    const render = { overview, terminal, files, processes, ports, metrics, events, snapshots }[tab];
    const cleanup = render(body, id, s, arg);
    if (cleanup) cleanups.push(cleanup);
    if (!s) return;
    // The list, not GET of this sandbox: reading one sandbox counts as activity for its idle timer (it would never
    // be suspended while the page is open), the list names none. Neither wakes a suspended or stopped one.
    cleanups.push(every(WATCH_MS, async () => {
      const ticket = ++asked;
      try {
        const now = (await get("/v1/sandboxes")).sandboxes.find((x) => x.id === s.id);
        if (now) show(now, ticket);
      } catch {
        // a failed look is tried again at the next tick; the page keeps what it showed
      }
    }));
  });
  return () => {
    left = true;
    cleanups.forEach((c) => c());
  };
}

function overview(body, id, s) {
  if (!s) return;
  const rows = [
    ["Id", s.id], ["Name", s.name || "—"], ["State", s.stopped_reason ? `${s.state} (${s.stopped_reason})` : s.state],
    ["Persistent", s.persistent ? "yes: suspended, not terminated, at its idle timeout; can be stopped and resumed" : "no"],
    ["Image", s.image],
    ["CPUs", s.cpus], ["Memory", `${s.memory_mb} MiB`], ["Disk", `${s.disk_mb} MiB`],
    ["Network", `${s.network.mode}${s.network.allow ? ` (allow ${s.network.allow.join(", ")})` : ""}${s.network.deny?.length ? ` (deny ${s.network.deny.join(", ")})` : ""}`],
    ["Labels", Object.entries(s.labels).map(([k, v]) => `${k}=${v}`).join(", ") || "—"],
    ["Environment names", s.env_names.join(", ") || "—"],
    ["Idle timeout", `${s.idle_timeout_secs} s${s.persistent ? " (then suspended)" : ""}`],
    ["Snapshot schedule", s.snapshot_every_secs ? `every ${s.snapshot_every_secs} s, keep ${s.snapshot_keep}` : "none"],
    ["Created", fmtTime(s.created_at)],
  ];
  if (s.snapshotting) rows.push(["Snapshotting", `${s.snapshotting.phase}, ${fmtBytes(s.snapshotting.bytes)}`]);
  if (s.terminated_at) rows.push(["Terminated", `${fmtTime(s.terminated_at)} (${s.terminated_reason})`]);
  clear(body, h("dl.details", rows.map(([k, v]) => [h("dt", k), h("dd", String(v))])));
}

// -- terminal -----------------------------------------------------------------------------------------------

function terminal(body, id, s, pidText) {
  const status = h("p.term-status", { role: "status", "aria-live": "polite" }, "not attached");
  const screen = h("div.terminal", { "aria-label": "Terminal" });
  const picker = h("select", { id: "attach-pid" });
  let current = null;
  const setStatus = async (text, kind) => {
    status.textContent = text;
    status.dataset.kind = kind;
    if (kind === "refused" && current) {
      // Ask the API why (the WebSocket refusal's body cannot be read by a browser).
      try {
        await get(`/v1/sandboxes/${enc(id)}/processes/${current.pid}`);
        status.textContent = "the server refused the attach: too many attaches are open, or the key lacks sandbox:create";
      } catch (error) {
        status.textContent = `the server refused the attach: ${error}`;
      }
    }
  };
  const attach = (pid) => {
    if (current) current.term.dispose();
    clear(screen);
    current = { pid, term: new AttachedTerminal(screen, id, pid, setStatus) };
    history.replaceState(null, "", `#/sandboxes/${enc(id)}/terminal/${pid}`); // no re-render
  };
  const newShell = async () => {
    const size = current?.term.term ?? { rows: 24, cols: 80 };
    // A login shell on a terminal; sh where the image has no bash.
    const proc = await post(`/v1/sandboxes/${enc(id)}/processes`, {
      argv: ["sh", "-c", "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"],
      tty: true, rows: size.rows, cols: size.cols,
    });
    attach(proc.pid);
  };
  const loadPicker = async () => {
    const answer = await get(`/v1/sandboxes/${enc(id)}/processes`);
    const running = answer.processes.filter((p) => p.state === "running");
    clear(picker, h("option", { value: "" }, running.length ? "a running process…" : "no running process"),
      running.map((p) => h("option", { value: p.pid }, `${p.pid}: ${p.argv.join(" ")}`)));
  };
  clear(body,
    h("div.toolbar",
      action("New shell", newShell, { id: "new-shell" }),
      h("label", { for: "attach-pid" }, "Attach to"), picker,
      action("Attach", async () => picker.value && attach(Number(picker.value))),
      h("select", { id: "signal", "aria-label": "Signal" }, ["INT", "TERM", "HUP", "KILL"].map((n) => h("option", n))),
      action("Send signal", async () => current?.term.signal(document.getElementById("signal").value)),
      action("End input", async () => current?.term.endInput(), { title: "Send the end of input (a terminal gets ^D)" })),
    status, screen,
    h("p.muted", "Ctrl-D at a prompt ends the shell; closing the page detaches and leaves the process running."));
  loadPicker().catch((error) => toast(String(error), "error"));
  if (s?.state === "running") {
    if (pidText) attach(Number(pidText));
  }
  return () => current?.term.dispose();
}

// -- files ----------------------------------------------------------------------------------------------------

function files(body, id) {
  let dir = "/sandbox/home";
  const listing = h("div.files", { tabindex: "-1" });
  const where = h("input", { id: "file-path", value: dir });
  const upload = h("input", { id: "upload", type: "file", multiple: true, class: "visually-hidden" });
  const hint = h("p.muted", "Drop files on the list to upload them into this directory.");
  const path = (name) => (dir === "/" ? `/${name}` : `${dir}/${name}`);

  async function load(next = dir) {
    try {
      const answer = await get(`/v1/sandboxes/${enc(id)}/dirs${query({ path: next })}`);
      dir = next;
      where.value = dir;
      const entries = answer.entries.sort((a, b) => (a.type === b.type ? a.name.localeCompare(b.name) : a.type === "dir" ? -1 : 1));
      const parent = dir === "/" ? [] : [{ name: "..", type: "dir", size: 0, parent: true }];
      clear(listing, table([
        { label: "Name", cell: (e) => e.type === "dir"
          ? h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); load(e.parent ? dir.replace(/\/[^/]*$/, "") || "/" : path(e.name)); } }, `${e.name}/`)
          : e.name },
        { label: "Size", cell: (e) => (e.type === "file" ? fmtBytes(e.size) : "") },
        { label: "Actions", cell: (e) => e.parent ? "" : h("div.row-actions",
          e.type === "file" ? action("Download", () => download(path(e.name), e.name), { "aria-label": `Download ${e.name}` }) : null,
          action("Delete", () => remove(path(e.name)), { danger: true, "aria-label": `Delete ${e.name}` })) },
      ], [...parent, ...entries], "This directory is empty."));
    } catch (error) {
      clear(listing, errorBox(error));
    }
  }

  async function download(file, name) {
    const resp = await call("GET", `/v1/sandboxes/${enc(id)}/files${query({ path: file })}`, { raw: true });
    const url = URL.createObjectURL(await resp.blob());
    const link = h("a", { href: url, download: name });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  async function remove(file) {
    if (!(await confirm("Delete", `Delete ${file}? A directory must be empty.`, "Delete"))) return;
    await call("DELETE", `/v1/sandboxes/${enc(id)}/files${query({ path: file })}`);
    toast(`deleted ${file}`);
    load();
  }

  async function send(fileList) {
    for (const file of fileList) {
      try {
        await call("PUT", `/v1/sandboxes/${enc(id)}/files${query({ path: path(file.name) })}`, { body: file });
        toast(`uploaded ${path(file.name)}`);
      } catch (error) {
        toast(`${file.name}: ${error}`, "error");
      }
    }
    load();
  }

  upload.addEventListener("change", () => send(upload.files).then(() => (upload.value = "")));
  listing.addEventListener("dragover", (event) => {
    event.preventDefault();
    listing.classList.add("drop");
  });
  listing.addEventListener("dragleave", () => listing.classList.remove("drop"));
  listing.addEventListener("drop", (event) => {
    event.preventDefault();
    listing.classList.remove("drop");
    send(event.dataTransfer.files);
  });
  clear(body,
    h("form.toolbar", { onsubmit: (ev) => { ev.preventDefault(); load(where.value || "/"); } },
      h("label", { for: "file-path" }, "Directory"), where, h("button", { type: "submit" }, "Open"),
      h("label.button", { for: "upload" }, "Upload files…"), upload),
    hint, listing);
  load();
}

// -- processes ------------------------------------------------------------------------------------------------

function processes(body, id) {
  const list = h("div");
  const output = h("pre.output", { "aria-live": "off", tabindex: "0" });
  const heading = h("h2.sub", "Output");
  let following = null;
  const decoder = new TextDecoder();

  async function load() {
    try {
      const answer = await get(`/v1/sandboxes/${enc(id)}/processes`);
      clear(list, table([
        { label: "Pid", cell: (p) => String(p.pid) },
        { label: "Command", cell: (p) => h("code", p.argv.join(" ")) },
        { label: "State", cell: (p) => (p.state === "running" ? "running" : `exited ${p.exit_code}`) },
        { label: "Started", cell: (p) => fmtTime(p.started_at) },
        { label: "Actions", cell: (p) => h("div.row-actions",
          action("Follow output", () => follow(p), { "aria-label": `Follow output of ${p.pid}` }),
          p.state === "running" ? h("a.button", { href: `#/sandboxes/${enc(id)}/terminal/${p.pid}` }, "Attach") : null,
          p.state === "running" ? action("Kill", async () => {
            await post(`/v1/sandboxes/${enc(id)}/processes/${p.pid}/signal`, { signal: "KILL" }, {});
            setTimeout(load, 500);
          }, { danger: true }) : null) },
      ], answer.processes.slice().reverse(), "No processes yet."));
    } catch (error) {
      clear(list, errorBox(error));
    }
  }

  async function follow(p) {
    following?.abort();
    following = new AbortController();
    heading.textContent = `Output of ${p.pid}: ${p.argv.join(" ")}`;
    output.textContent = "";
    try {
      for await (const line of ndjson(`/v1/sandboxes/${enc(id)}/processes/${p.pid}/output`, following.signal)) {
        if (line.data !== undefined) output.append(decoder.decode(base64Bytes(line.data), { stream: true }));
        else if (line.exit_code !== undefined) output.append(`\n[exited with code ${line.exit_code}]\n`);
        output.scrollTop = output.scrollHeight;
      }
      load();
    } catch (error) {
      if (error.name !== "AbortError") output.append(`\n[${error}]\n`);
    }
  }

  const start = () => dialog({
    title: "Start a process",
    fields: [{ name: "command", label: "Command (run by sh -c)", required: true }],
    ok: "Start",
    submit: (v) => post(`/v1/sandboxes/${enc(id)}/processes`, { argv: ["sh", "-c", v.command] }),
  }).then((p) => {
    if (p) {
      load();
      follow(p);
    }
  });
  clear(body, h("div.toolbar", action("Start process", start), action("Refresh", load)), list, heading, output);
  load();
  return () => following?.abort();
}

// -- metrics --------------------------------------------------------------------------------------------------

function metrics(body, id) {
  const note = h("p.muted");
  const boxes = [h("div.chart"), h("div.chart"), h("div.chart"), h("div.chart")];
  clear(body, note, h("div.charts", boxes));
  const mib = (v) => (v === null || v === undefined ? "" : `${(v / 1048576).toFixed(1)} MiB`);
  const rate = (v) => (v === null || v === undefined ? "" : `${fmtBytes(v)}/s`);
  const charts = [
    chart(boxes[0], "CPU (% of its vCPUs)", [{ label: "cpu", stroke: "#2f6fdf" }], (v) => (v === null || v === undefined ? "" : `${v.toFixed(0)} %`)),
    chart(boxes[1], "Memory", [{ label: "resident", stroke: "#1a9c6b" }, { label: "limit", stroke: "#999" }], mib),
    chart(boxes[2], "Network", [{ label: "rx", stroke: "#8a4fd0" }, { label: "tx", stroke: "#d07a1f" }], rate),
    chart(boxes[3], "Disk", [{ label: "read", stroke: "#3a8fb7" }, { label: "write", stroke: "#c0392b" }], rate),
  ];
  const rates = (samples, field) => samples.map((s, i) => {
    if (i === 0) return null;
    const secs = (Date.parse(s.time) - Date.parse(samples[i - 1].time)) / 1000;
    return secs > 0 ? Math.max(0, (s[field] - samples[i - 1][field]) / secs) : null;
  });
  async function load() {
    try {
      const answer = await get(`/v1/sandboxes/${enc(id)}/metrics`);
      const samples = answer.samples;
      const times = samples.map((s) => Date.parse(s.time) / 1000);
      charts[0].set([times, samples.map((s) => s.cpu_percent)]);
      charts[1].set([times, samples.map((s) => s.memory_bytes), samples.map((s) => s.memory_limit_bytes)]);
      charts[2].set([times, rates(samples, "net_rx_bytes"), rates(samples, "net_tx_bytes")]);
      charts[3].set([times, rates(samples, "disk_read_bytes"), rates(samples, "disk_write_bytes")]);
      note.textContent = `${samples.length} sample${samples.length === 1 ? "" : "s"}, one every ${answer.interval_secs} s (the last hour)`;
    } catch (error) {
      clear(note, errorBox(error));
    }
  }
  load();
  const timer = setInterval(load, 5000);
  return () => {
    clearInterval(timer);
    charts.forEach((c) => c.dispose());
  };
}

// -- events ---------------------------------------------------------------------------------------------------

function events(body, id) {
  const load = async () => {
    try {
      const answer = await get(`/v1/sandboxes/${enc(id)}/events`);
      const rest = (e) => Object.entries(e).filter(([k]) => !["time", "type", "sandbox"].includes(k))
        .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join("  ");
      clear(body, h("div.toolbar", action("Refresh", load)),
        answer.truncated ? h("p.muted", "Only the newest 5000 events are shown.") : null,
        table([
          { label: "Time", cell: (e) => fmtTime(e.time) },
          { label: "Type", cell: (e) => h("code", e.type) },
          { label: "Details", cell: (e) => h("span.details", rest(e)) },
        ], answer.events.slice().reverse(), "No events."));
    } catch (error) {
      clear(body, errorBox(error));
    }
  };
  load();
}

// -- snapshots and forks ----------------------------------------------------------------------------------------

function snapshots(body, id, s) {
  const load = async () => {
    try {
      const all = (await get("/v1/snapshots")).snapshots.filter((snap) => snap.sandbox === id);
      const forks = await Promise.all(all.map((snap) =>
        get(`/v1/sandboxes${query({ label: `forked-from=${snap.id}` })}`).then((a) => a.sandboxes).catch(() => [])));
      clear(body,
        h("div.toolbar", s ? action("Take snapshot", async () => (await takeSnapshot(s)) && load()) : null),
        h("p.muted", "Forks made here carry the label forked-from=<snapshot>, which is how they are listed."),
        table([
          { label: "Snapshot", cell: (snap) => h("code", snap.id) },
          { label: "Kind", cell: (snap) => `${snap.kind}${snap.scheduled ? " (scheduled)" : ""}` },
          { label: "Size", cell: (snap) => fmtBytes(snap.bytes) },
          { label: "Taken", cell: (snap) => fmtTime(snap.created_at) },
          { label: "Forks", cell: (snap) => forks[all.indexOf(snap)].map((f) =>
            h("a.tag", { href: `#/sandboxes/${enc(f.id)}/overview` }, `${f.name || f.id} (${f.state})`)) },
          { label: "Actions", cell: (snap) => h("div.row-actions",
            action("Fork", () => createSandbox(snap.id)),
            action("Delete", async () => {
              if (!(await confirm("Delete snapshot", `Delete snapshot ${snap.id}?`, "Delete"))) return;
              await call("DELETE", `/v1/snapshots/${enc(snap.id)}`);
              load();
            }, { danger: true })) },
        ], all, "No snapshots of this sandbox."));
    } catch (error) {
      clear(body, errorBox(error));
    }
  };
  load();
}
