// Sandboxes: the live list (filters by label), create, and the actions on one sandbox (rename, labels, network,
// suspend, resume, stop, snapshot, terminate) shared with the sandbox's own page. Errors are the server's, as sent.

import { enc, get, patch, post, del, query } from "../api.js";
import { action, clear, confirm, dialog, errorBox, fmtAge, h, labelText, parseLabels, table, toast } from "../ui.js";

const REFRESH_MS = 5000;

export function renderSandboxes(main) {
  const filter = h("input", { id: "label-filter", type: "search", placeholder: "team=web, env=dev" });
  const list = h("div.list");
  const status = h("p.muted", { "aria-live": "polite" });
  let shown = "";
  let stopped = false;
  // Each listing is numbered when asked: one answered after a newer one (a poll overtaken by an action's own
  // refresh) is dropped rather than drawn over it.
  let asked = 0;
  let drawn = 0;

  async function refresh() {
    let labels;
    const ticket = ++asked;
    try {
      labels = filter.value.split(",").map((s) => s.trim()).filter(Boolean);
      const answer = await get(`/v1/sandboxes${query({ label: labels })}`);
      if (ticket < drawn) return;
      drawn = ticket;
      const text = JSON.stringify(answer.sandboxes);
      if (text !== shown) {
        shown = text;
        renderList(list, answer.sandboxes, refresh);
      }
      status.textContent = `${answer.sandboxes.length} sandboxes · updated ${new Date().toLocaleTimeString()}`;
    } catch (error) {
      shown = "";
      clear(list, errorBox(error));
    }
  }
  const timer = setInterval(() => !stopped && !document.querySelector("dialog") && refresh(), REFRESH_MS);
  filter.addEventListener("change", () => {
    shown = "";
    refresh();
  });
  clear(
    main,
    h("div.bar",
      h("h1", "Sandboxes"),
      h("button.primary", { type: "button", onclick: () => createSandbox().then((made) => made && refresh()) },
        "Create sandbox")),
    h("div.field.inline", h("label", { for: "label-filter" }, "Filter by labels"), filter),
    status,
    list,
  );
  refresh();
  return () => {
    stopped = true;
    clearInterval(timer);
  };
}

function renderList(list, sandboxes, refresh) {
  const focused = document.activeElement?.dataset?.focus;
  clear(list, table([
    { label: "Sandbox", cell: (s) => [h("a", { href: `#/sandboxes/${enc(s.id)}/overview` }, s.name || s.id), persistentBadge(s)] },
    { label: "State", cell: (s) => h(`span.state.${s.state}`, s.state) },
    { label: "Image", cell: (s) => s.image },
    { label: "Resources", cell: (s) => `${s.cpus} CPU · ${s.memory_mb} MiB · ${s.disk_mb} MiB disk` },
    { label: "Labels", cell: (s) => Object.entries(s.labels).map(([k, v]) => h("span.tag", `${k}=${v}`)) },
    { label: "Age", cell: (s) => fmtAge(s.created_at) },
    { label: "Actions", cell: (s) => h("div.row-actions", sandboxActions(s, refresh, { compact: true })) },
  ], sandboxes, "No sandboxes yet: create one."));
  if (focused) list.querySelector(`[data-focus="${CSS.escape(focused)}"]`)?.focus();
}

/** The "persistent" badge of a persistent sandbox (capability `persistent`), else nothing. */
export function persistentBadge(s) {
  if (!s.persistent) return null;
  return h("span.badge.persistent", { title: "Persistent: suspended, not terminated, when idle; Stop keeps its disk" },
    "persistent");
}

/** The buttons acting on sandbox `s`; `after(result)` runs once one has changed it. */
export function sandboxActions(s, after, { compact = false } = {}) {
  const live = s.state !== "terminated";
  const key = (what) => ({ dataset: { focus: `${s.id}:${what}` } });
  const buttons = [];
  if (!compact) {
    buttons.push(
      action("Rename", () => rename(s).then((r) => r && after(r)), key("rename")),
      action("Labels", () => editLabels(s).then((r) => r && after(r)), key("labels")),
      action("Network", () => editNetwork(s).then((r) => r && after(r)), key("network")),
      action("Snapshot", () => takeSnapshot(s).then((r) => r && after(r)), key("snapshot")),
    );
  }
  if (s.state === "running") {
    buttons.push(action("Suspend", async () => after(await post(`/v1/sandboxes/${enc(s.id)}/suspend`, {})), key("suspend")));
  }
  if (s.persistent && (s.state === "running" || s.state === "suspended")) {
    buttons.push(action("Stop", async () => {
      if (!(await confirm("Stop sandbox", `Stop ${s.name || s.id}? Its processes end and its memory is freed; its disk, `
        + "volumes, name, labels and network are kept. Resume, or any command, starts it again.", "Stop"))) return;
      after(await post(`/v1/sandboxes/${enc(s.id)}/stop`, {}));
    }, key("stop")));
  }
  if (s.state === "suspended" || s.state === "stopped") {
    buttons.push(action("Resume", async () => after(await post(`/v1/sandboxes/${enc(s.id)}/resume`, {})), key("resume")));
  }
  if (live) {
    buttons.push(action("Terminate", async () => {
      if (!(await confirm("Terminate sandbox", `Terminate ${s.name || s.id}? Its processes stop and its disk is discarded.`, "Terminate"))) return;
      await del(`/v1/sandboxes/${enc(s.id)}`);
      toast(`terminated ${s.name || s.id}`);
      after(null);
    }, { danger: true, ...key("terminate") }));
  }
  for (const b of buttons) {
    if (!live && b.textContent !== "Terminate") b.disabled = true;
  }
  return buttons;
}

async function rename(s) {
  return dialog({
    title: `Rename ${s.name || s.id}`,
    fields: [{ name: "name", label: "Name (empty removes it)", value: s.name || "" }],
    ok: "Rename",
    submit: (v) => patch(`/v1/sandboxes/${enc(s.id)}`, { name: v.name }),
  });
}

async function editLabels(s) {
  const own = Object.fromEntries(Object.entries(s.labels).filter(([k]) => !k.startsWith("gateway.")));
  return dialog({
    title: `Labels of ${s.name || s.id}`,
    body: h("p.muted", "One key=value per line; the set replaces the current one. The gateway keeps its own gateway.* labels."),
    fields: [{ name: "labels", label: "Labels", type: "textarea", value: labelText(own) }],
    ok: "Save labels",
    submit: (v) => patch(`/v1/sandboxes/${enc(s.id)}`, { labels: { ...gatewayLabels(s), ...parseLabels(v.labels) } }),
  });
}

function gatewayLabels(s) {
  return Object.fromEntries(Object.entries(s.labels).filter(([k]) => k.startsWith("gateway.")));
}

let capabilities = null;
/** GET /v1/capabilities, once per page load. */
export async function caps() {
  capabilities ??= await get("/v1/capabilities");
  return capabilities;
}

export function networkFields(caps, current = { mode: caps.network.default.mode }) {
  const order = ["none", "allowlist", "open"];
  const modes = order.slice(0, order.indexOf(caps.network.ceiling) + 1);
  const mayAllow = caps.network.may_allow.length ? caps.network.may_allow.join(", ") : "only the default list";
  return [
    { name: "mode", label: "Network mode", type: "select", value: current.mode, options: modes,
      hint: `The server's ceiling is ${caps.network.ceiling}.` },
    { name: "allow", label: "Allow (allowlist mode; empty: the server's default list)", type: "textarea",
      value: (current.allow || []).join("\n"),
      hint: `Default: ${(caps.network.default.allow || []).join(", ") || "none"}. May allow: ${mayAllow}.` },
    { name: "deny", label: "Deny", type: "textarea", value: (current.deny || []).join("\n") },
  ];
}

export function networkRequest(v) {
  const names = (text) => text.split(/[\s,]+/).map((s) => s.trim()).filter(Boolean);
  const network = { mode: v.mode };
  if (v.mode === "allowlist" && names(v.allow).length) network.allow = names(v.allow);
  if (v.mode !== "none" && names(v.deny).length) network.deny = names(v.deny);
  return network;
}

async function editNetwork(s) {
  const c = await caps();
  if (!c.capabilities.network_policy_update) throw new Error("this server cannot change a running sandbox's network");
  return dialog({
    title: `Network of ${s.name || s.id}`,
    fields: networkFields(c, s.network),
    ok: "Apply",
    submit: (v) => patch(`/v1/sandboxes/${enc(s.id)}`, { network: networkRequest(v) }),
  });
}

export async function takeSnapshot(s) {
  return dialog({
    title: `Snapshot ${s.name || s.id}`,
    body: h("p.muted", "A memory snapshot keeps memory, processes and disk; a disk snapshot only the files."),
    fields: [{ name: "kind", label: "Kind", type: "select", value: "memory", options: ["memory", "disk"] }],
    ok: "Take snapshot",
    submit: async (v) => {
      const snap = await post(`/v1/sandboxes/${enc(s.id)}/snapshots`, { kind: v.kind });
      toast(`snapshot ${snap.id} taken`);
      return snap;
    },
  });
}

/** The create form; resolves with the new sandbox (and opens it) or null. `snapshot` preselects a fork. */
export async function createSandbox(snapshot = "") {
  const c = await caps();
  const [volumes, snapshots] = await Promise.all([
    get("/v1/volumes").then((a) => a.volumes).catch(() => []),
    get("/v1/snapshots").then((a) => a.snapshots).catch(() => []),
  ]);
  const l = c.limits;
  const made = await dialog({
    title: "Create sandbox",
    fields: [
      { name: "name", label: "Name (optional)" },
      { name: "image", label: "Image (empty: the server's default)" },
      { name: "cpus", label: `CPUs (at most ${l.max_cpus})`, type: "number" },
      { name: "memory_mb", label: `Memory MiB (at most ${l.max_memory_mb})`, type: "number" },
      { name: "disk_mb", label: `Disk MiB (at most ${l.max_disk_mb})`, type: "number" },
      ...networkFields(c),
      { name: "labels", label: "Labels (key=value per line)", type: "textarea" },
      { name: "volumes", label: "Volumes (name:/path or name:/path:ro per line)", type: "textarea",
        hint: volumes.length ? `Yours: ${volumes.map((v) => v.name).join(", ")}` : "You have no volumes." },
      { name: "snapshot_id", label: "Fork from snapshot", type: "select", value: snapshot,
        options: [["", "none"], ...snapshots.map((s) => [s.id, `${s.id} (${s.kind}, of ${s.sandbox})`])] },
      { name: "idle_timeout_secs", label: `Idle timeout, seconds (at most ${l.max_idle_timeout_secs || "no limit"})`, type: "number" },
      ...(c.capabilities.persistent ? [{ name: "persistent", label: "Persistent", type: "checkbox",
        hint: "Suspended, not terminated, at its idle timeout, and woken by the next command; it can be stopped "
          + "(disk kept, memory freed) and resumed. Needs a name." }] : []),
    ],
    ok: "Create",
    submit: (v) => post("/v1/sandboxes", createRequest(v)),
  });
  if (made) {
    toast(`created ${made.name || made.id}`);
    location.hash = `#/sandboxes/${enc(made.id)}/overview`;
  }
  return made;
}

function createRequest(v) {
  const request = {};
  for (const name of ["name", "image"]) if (v[name].trim()) request[name] = v[name].trim();
  for (const name of ["cpus", "memory_mb", "disk_mb", "idle_timeout_secs"]) {
    if (v[name] !== "") request[name] = Number(v[name]);
  }
  request.network = networkRequest(v);
  if (v.persistent) request.persistent = true;
  const labels = parseLabels(v.labels);
  if (v.snapshot_id) {
    request.snapshot_id = v.snapshot_id;
    labels["forked-from"] = v.snapshot_id; // how the Snapshots tab finds a snapshot's forks
  }
  if (Object.keys(labels).length) request.labels = labels;
  const mounts = v.volumes.split("\n").map((s) => s.trim()).filter(Boolean).map((line) => {
    const [name, path, ro] = line.split(":");
    if (!name || !path) throw new Error(`volume "${line}" is not name:/path`);
    return ro === "ro" ? { name, path, read_only: true } : { name, path };
  });
  if (mounts.length) request.volumes = mounts;
  return request;
}
