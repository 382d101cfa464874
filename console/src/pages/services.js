// Services: the list (desired/ready, serving and rolling revisions, replica states and restarts, health, the
// address), create from a form (the ServiceSpec, with the server's limits), and one service's page: its rollout
// followed live (progress, or the reason it failed), replicas, scale, roll out a new revision, delete.

import { del, enc, get, post, put, query, session } from "../api.js";
import {
  action, clear, commandText, confirm, dialog, errorBox, every, fmtAge, fmtTime, h, parseCommand, parseEnv,
  parseNames, table, toast,
} from "../ui.js";
import { caps, networkFields, networkRequest } from "./sandboxes.js";

/** Seconds between refreshes of the list and of a service (a rollout is watched at this pace). */
const LIST_MS = 4000;
const SERVICE_MS = 2000;
const REPLICA_STATES = ["healthy", "starting", "unhealthy", "lost"];

/** Where a service is addressed in the console: its tenant ("default" for the default one) and name. */
const tenantOf = (svc) => svc.tenant || "default";
const pageOf = (svc) => `#/services/${enc(tenantOf(svc))}/${enc(svc.spec.name)}`;
const apiOf = (tenant, name) => `/v1/services/${enc(name)}${query({ tenant })}`;

/** The service's addresses: the path form on this gateway always, and `url` (the domain form when configured). */
export function addresses(svc) {
  if (!svc.spec.port) return [];
  const label = svc.tenant ? `${svc.spec.name}--${svc.tenant}` : svc.spec.name;
  const found = [`${location.origin}/svc/${label}/`];
  if (svc.url && !found.includes(svc.url)) found.push(svc.url);
  return found;
}

function addressLinks(svc) {
  const found = addresses(svc);
  if (!found.length) return h("span.muted", "no port: no traffic");
  return found.map((url) => h("div", h("a.address", { href: url, target: "_blank", rel: "noopener noreferrer" }, url)));
}

function replicaCounts(svc) {
  const counts = {};
  for (const r of svc.replicas) counts[r.state] = (counts[r.state] || 0) + 1;
  return REPLICA_STATES.filter((s) => counts[s]).map((s) => h(`span.tag.state.${s}`, `${counts[s]} ${s}`));
}

/** "serving 2" and, while one runs or after it failed, the rollout: "→ 3 in progress" / "→ 3 failed". */
function revisionText(svc) {
  const parts = [h("span", `serving ${svc.serving}`)];
  const r = svc.rollout;
  if (r && r.state === "in_progress") parts.push(h("span.state.starting", ` · rolling out ${r.from} → ${r.to}`));
  if (r && r.state === "failed") parts.push(h("span.state.failed", ` · rollout to ${r.to} failed`));
  return parts;
}

function health(spec) {
  const hc = spec.health;
  if (!hc) return "the command running";
  const what = hc.http ? `GET ${hc.http}` : `command ${commandText(hc.command)}`;
  return `${what} every ${hc.every_secs} s (timeout ${hc.timeout_secs} s, ${hc.failures} failures)`;
}

export function renderServices(main) {
  const list = h("div.list");
  const status = h("p.muted", { "aria-live": "polite" });
  let shown = "";
  const admin = session.me.scopes.includes("admin");
  const refresh = async () => {
    try {
      const services = (await get("/v1/services")).services;
      const text = JSON.stringify(services);
      if (text !== shown) {
        shown = text;
        clear(list, table([
          { label: "Service", cell: (s) => h("a", { href: pageOf(s) }, s.spec.name) },
          admin ? { label: "Owner", cell: (s) => `${s.owner} (${tenantOf(s)})` } : null,
          { label: "Ready / desired", cell: (s) => h(`span.state.${s.ready >= s.desired ? "up" : "down"}`, `${s.ready} / ${s.desired}`) },
          { label: "Revision", cell: (s) => revisionText(s) },
          { label: "Replicas", cell: (s) => replicaCounts(s) },
          { label: "Restarts", cell: (s) => String(s.restarts) },
          { label: "Health", cell: (s) => [health(s.spec), s.error ? h("div.error", s.error) : null] },
          { label: "Address", cell: (s) => addressLinks(s) },
        ].filter(Boolean), services, "No services yet: create one."));
      }
      status.textContent = `${services.length} service${services.length === 1 ? "" : "s"} · updated ${new Date().toLocaleTimeString()}`;
    } catch (error) {
      shown = "";
      clear(list, errorBox(error));
    }
  };
  clear(main,
    h("div.bar", h("h1", "Services"),
      action("Create service", async () => {
        const made = await serviceForm();
        if (made) location.hash = pageOf(made);
      })),
    h("p.muted", "A service keeps its replicas healthy, rolls out a changed spec one replica at a time, and serves HTTP at its address."),
    status, list);
  return every(LIST_MS, refresh);
}

/** The ServiceSpec form: a new service, or (`svc` given) a new revision of it. Resolves with the Service or null. */
async function serviceForm(svc = null) {
  const c = await caps();
  const secrets = await get("/v1/secrets").then((a) => a.secrets.map((s) => s.name)).catch(() => null);
  const l = c.limits;
  const s = svc?.spec ?? {};
  const hc = s.health ?? {};
  const res = s.resources ?? {};
  const envHint = svc?.env_names.length
    ? `Values are never answered back: give every variable again (now set: ${svc.env_names.join(", ")}); left empty, the new revision has none.`
    : "One NAME=value per line.";
  const fields = [
    svc ? null : { name: "name", label: "Name (a-z, 0-9 and -, at most 30, starting with a letter)", required: true },
    { name: "command", label: "Command (run by sh -c; or a JSON array of arguments)", type: "textarea", value: commandText(s.command),
      hint: "Required: the program every replica runs, e.g. python3 -m http.server 8080 --bind 127.0.0.1" },
    { name: "image", label: "Image (empty: the node's default)", value: s.image ?? "" },
    { name: "port", label: "Port the command listens on (guest loopback; empty: no traffic)", type: "number", value: s.port ?? "" },
    svc ? null : { name: "replicas", label: "Replicas (0 to 100)", type: "number", value: 1 },
    { name: "cpus", label: `CPUs per replica (at most ${l.max_cpus})`, type: "number", value: res.cpus ?? "" },
    { name: "memory_mb", label: `Memory MiB per replica (at most ${l.max_memory_mb})`, type: "number", value: res.memory_mb ?? "" },
    { name: "disk_mb", label: `Disk MiB per replica (at most ${l.max_disk_mb})`, type: "number", value: res.disk_mb ?? "" },
    { name: "health_kind", label: "Health check", type: "select", value: hc.http ? "http" : hc.command ? "command" : "none",
      options: [["none", "none: healthy while the command runs"], ["http", "HTTP GET (needs the port)"], ["command", "a command (exit 0 passes)"]] },
    { name: "health_what", label: "Health path (/healthz) or command", value: hc.http ?? commandText(hc.command) },
    { name: "every_secs", label: "Check every, seconds (1 to 3600; empty: 10)", type: "number", value: hc.every_secs ?? "" },
    { name: "timeout_secs", label: "Check timeout, seconds (1 to 3600; empty: 5)", type: "number", value: hc.timeout_secs ?? "" },
    { name: "failures", label: "Failures in a row before unhealthy (1 to 100; empty: 3)", type: "number", value: hc.failures ?? "" },
    { name: "env", label: "Environment (NAME=value per line)", type: "textarea", hint: envHint },
    { name: "secrets", label: "Secrets by name (comma separated)", value: (s.secrets ?? []).join(", "),
      hint: secrets === null ? "This gateway keeps no secrets." : `This tenant's: ${secrets.join(", ") || "none yet"}.` },
    ...networkFields(c, s.network ?? { mode: c.network.default.mode }),
    { name: "public", label: "Public: traffic needs no key", type: "checkbox", value: s.public },
    { name: "spread", label: "Spread replicas over nodes", type: "checkbox", value: Boolean(s.placement) },
    { name: "answer_timeout_secs", label: "Answer timeout, seconds (1 to 3600; empty: 120)", type: "number", value: s.answer_timeout_secs ?? "" },
  ].filter(Boolean);
  return dialog({
    title: svc ? `Roll out a new revision of ${s.name}` : "Create service",
    body: svc ? h("p.muted", "A changed image, command, resources, port, health, environment, network or secrets starts a rollout, one replica at a time; the page shows it as it goes.") : null,
    fields,
    ok: svc ? "Roll out" : "Create",
    submit: async (v) => {
      const spec = specOf(v, svc);
      const answer = svc ? await put(apiOf(tenantOf(svc), s.name), spec) : await post("/v1/services", spec);
      toast(svc ? `revision ${answer.revision} of ${s.name}: ${answer.rollout?.state ?? "applied"}` : `created ${answer.spec.name}`);
      return answer;
    },
  });
}

function specOf(v, svc) {
  const spec = { name: svc ? svc.spec.name : v.name.trim() };
  const command = parseCommand(v.command);
  if (command) spec.command = command;
  if (v.image.trim()) spec.image = v.image.trim();
  if (v.port !== "") spec.port = Number(v.port);
  spec.replicas = svc ? svc.desired : Number(v.replicas || 0);
  const resources = {};
  for (const k of ["cpus", "memory_mb", "disk_mb"]) if (v[k] !== "") resources[k] = Number(v[k]);
  if (Object.keys(resources).length) spec.resources = resources;
  if (v.health_kind !== "none") {
    const hc = v.health_kind === "http" ? { http: v.health_what.trim() } : { command: parseCommand(v.health_what) };
    for (const k of ["every_secs", "timeout_secs", "failures"]) if (v[k] !== "") hc[k] = Number(v[k]);
    spec.health = hc;
  }
  const env = parseEnv(v.env);
  if (Object.keys(env).length) spec.env = env;
  const secrets = parseNames(v.secrets);
  if (secrets.length) spec.secrets = secrets;
  spec.network = networkRequest(v);
  if (v.public) spec.public = true;
  if (v.spread) spec.placement = { spread: "node" };
  if (v.answer_timeout_secs !== "") spec.answer_timeout_secs = Number(v.answer_timeout_secs);
  return spec;
}

// -- one service ---------------------------------------------------------------------------------------------

export function renderService(main, tenant, name) {
  const head = h("div");
  const rollout = h("div.rollout", { "aria-live": "polite" });
  const replicas = h("div");
  const details = h("div");
  const path = apiOf(tenant, name);
  let shown = "";
  const refresh = async () => {
    let svc;
    try {
      svc = await get(path);
    } catch (error) {
      shown = "";
      clear(head, h("h1", name), errorBox(error));
      clear(rollout);
      clear(replicas);
      clear(details);
      return;
    }
    const text = JSON.stringify(svc);
    if (text === shown) return;
    shown = text;
    clear(head,
      h("div.bar", h("h1", name),
        h(`span.state.${svc.ready >= svc.desired ? "up" : "down"}#ready`, `${svc.ready} / ${svc.desired} ready`)),
      h("div.row-actions",
        action("Scale", () => scale(svc)),
        action("Roll out a new revision", () => serviceForm(svc).then((r) => r && refresh())),
        action("Delete", () => remove(svc), { danger: true })),
      svc.error ? h("p.error#service-error", { role: "alert" }, svc.error) : null);
    clear(rollout, rolloutPanel(svc));
    clear(replicas, h("h2", "Replicas"), table([
      { label: "Sandbox", cell: (r) => h("a", { href: `#/sandboxes/${enc(r.sandbox)}/overview` }, r.sandbox) },
      { label: "Node", cell: (r) => r.node },
      { label: "Revision", cell: (r) => String(r.revision) },
      { label: "State", cell: (r) => h(`span.state.${r.state}`, r.state) },
      { label: "Last check", cell: (r) => [fmtTime(r.last_check), r.last_error ? h("div.error", r.last_error) : null] },
      { label: "Restarts", cell: (r) => String(r.restarts) },
      { label: "Age", cell: (r) => fmtAge(r.created_at) },
    ], svc.replicas, svc.desired ? "No replica yet." : "Scaled to zero."));
    const s = svc.spec;
    const res = s.resources ?? {};
    const rows = [
      ["Owner", `${svc.owner} (${tenantOf(svc)})`],
      ["Address", addressLinks(svc)],
      ["Access", s.public ? "public: anyone may call it" : "private: a key of this tenant with sandbox:read (Authorization: Bearer)"],
      ["Command", h("code", commandText(s.command))],
      ["Image", s.image ?? "the node's default"],
      ["Port", s.port ?? "none"],
      ["Resources", ["cpus", "memory_mb", "disk_mb"].filter((k) => res[k] !== undefined).map((k) => `${k} ${res[k]}`).join(", ") || "the node's defaults"],
      ["Health", health(s)],
      ["Environment names", svc.env_names.join(", ") || "none"],
      ["Secrets", (s.secrets ?? []).join(", ") || "none"],
      ["Network", s.network ? `${s.network.mode}${s.network.allow ? ` (allow ${s.network.allow.join(", ")})` : ""}` : "the node's default"],
      ["Placement", s.placement ? "spread over nodes" : "anywhere"],
      ["Answer timeout", `${s.answer_timeout_secs} s`],
      ["Restarts", String(svc.restarts)],
      ["Created", fmtTime(svc.created_at)],
      ["Updated", fmtTime(svc.updated_at)],
    ];
    clear(details, h("h2", svc.revision === svc.serving ? `Spec (revision ${svc.revision})` : `Spec (revision ${svc.revision}, the newest asked for)`), h("dl.details", rows.map(([k, v]) => [h("dt", k), h("dd", v)])));
  };

  async function scale(svc) {
    const done = await dialog({
      title: `Scale ${name}`,
      fields: [{ name: "replicas", label: "Replicas (0 to 100)", type: "number", value: svc.desired, required: true }],
      ok: "Scale",
      submit: (v) => post(`/v1/services/${enc(name)}/scale${query({ tenant })}`, { replicas: Number(v.replicas) }),
    });
    if (done) {
      toast(`${name} scaled to ${done.desired}`);
      refresh();
    }
  }

  async function remove(svc) {
    if (!(await confirm("Delete service", `Delete ${name}? Its ${svc.replicas.length} replicas are ended and its address stops answering.`, "Delete"))) return;
    await del(path);
    toast(`deleted ${name}`);
    location.hash = "#/services";
  }

  clear(main, h("p", h("a", { href: "#/services" }, "← Services")), head, rollout, replicas, details);
  return every(SERVICE_MS, refresh);
}

/** The latest rollout: its progress while it runs (new-revision replicas healthy of desired), or why it failed. */
function rolloutPanel(svc) {
  const r = svc.rollout;
  if (!r) return h("p.muted", `Revision ${svc.serving} serving; no rollout yet.`);
  if (r.state === "done") return h("p.rollout-done", `Revision ${r.to} serving (rolled out from ${r.from}).`);
  if (r.state === "failed") {
    return h("div.rollout-failed", { role: "alert" },
      h("strong", `Rollout from revision ${r.from} to ${r.to} failed`),
      h("p.error#rollout-reason", r.reason ?? "no reason given"),
      h("p.muted", `Revision ${svc.serving} keeps serving. Roll out again with a corrected spec.`));
  }
  const fresh = svc.replicas.filter((x) => x.revision === r.to);
  const healthy = fresh.filter((x) => x.state === "healthy").length;
  const old = svc.replicas.filter((x) => x.revision !== r.to).length;
  return h("div.rollout-progress",
    h("strong", `Rolling out revision ${r.from} → ${r.to}`),
    h("progress", { max: Math.max(svc.desired, 1), value: healthy, "aria-label": "New replicas healthy" }),
    h("p", `${healthy} of ${svc.desired} new replicas healthy, ${fresh.length - healthy} starting or failing, ${old} of the old revision left.`));
}
