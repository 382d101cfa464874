// Admin pages (keys with the admin scope): nodes (health, capacity, cordon, drain and what remains), sandboxes
// on lost nodes, API keys (a new secret shown once; revoke), every organisation, the audit log, tenant quotas.

import { del, enc, get, post, put, query } from "../api.js";
import { action, clear, confirm, dialog, errorBox, fmtTime, h, table, toast } from "../ui.js";

/** A page of one table: `load(refresh)` answers what to show, or null to keep what is shown (nothing changed). */
function page(main, title, tools, load) {
  const body = h("div");
  const refresh = async () => {
    try {
      const shown = await load(refresh);
      if (shown !== null) clear(body, shown);
    } catch (error) {
      clear(body, errorBox(error));
    }
  };
  clear(main, h("div.bar", h("h1", title), h("div.row-actions", tools(refresh), action("Refresh", refresh))), body);
  refresh();
  return refresh;
}

/** Seconds between refreshes of the nodes page (a drain, a cordon made elsewhere, a node going down show). */
const NODES_MS = 5000;

// -- nodes ----------------------------------------------------------------------------------------------------

export function renderNodes(main) {
  let shown = "";
  const refresh = page(main, "Nodes", () => [], async (again) => {
    const nodes = (await get("/v1/admin/nodes")).nodes;
    // Redrawn only when something besides the last poll's time changed (a button being clicked stays put);
    // the times are updated in place.
    const text = JSON.stringify(nodes.map((n) => ({ ...n, last_seen: null })));
    if (text === shown && main.querySelector(".last-seen")) {
      for (const n of nodes) {
        const cell = main.querySelector(`.last-seen[data-node="${CSS.escape(n.name)}"]`);
        if (cell) cell.textContent = fmtTime(n.last_seen);
      }
      return null;
    }
    shown = text;
    const res = (r) => (r ? `${r.cpus} CPU · ${r.memory_mb} MiB · ${r.disk_mb} MiB disk` : "");
    return table([
      { label: "Node", cell: (n) => h("strong", n.name) },
      { label: "Health", cell: (n) => h(`span.state.${n.lost ? "lost" : n.healthy ? "up" : "down"}`, n.lost ? "lost" : n.healthy ? "up" : "down") },
      { label: "Cordoned", cell: (n) => (n.cordoned ? "cordoned" : "no") },
      { label: "Running", cell: (n) => String(n.status?.running ?? "") },
      { label: "Capacity", cell: (n) => res(n.status?.capacity) },
      { label: "Free", cell: (n) => res(n.status?.free) },
      { label: "Version", cell: (n) => n.status?.version ?? "" },
      { label: "Last seen", cell: (n) => [h("span.last-seen", { dataset: { node: n.name } }, fmtTime(n.last_seen)),
        n.error ? h("div.error", n.error) : null] },
      { label: "Actions", cell: (n) => h("div.row-actions",
        action(n.cordoned ? "Uncordon" : "Cordon", async () => {
          await post(`/v1/admin/nodes/${enc(n.name)}/cordon`, { cordoned: !n.cordoned });
          toast(`${n.name} ${n.cordoned ? "uncordoned" : "cordoned"}`);
          again();
        }, { "aria-label": `${n.cordoned ? "Uncordon" : "Cordon"} ${n.name}` }),
        action("Drain", () => drain(n, again), { "aria-label": `Drain ${n.name}` }),
        n.from_node_file ? null : action("Remove", async () => {
          if (!(await confirm("Remove node", `Remove ${n.name}? Its sandboxes' owners are kept.`, "Remove"))) return;
          await del(`/v1/admin/nodes/${enc(n.name)}`);
          again();
        }, { danger: true })) },
    ], nodes, "No nodes.");
  });
  function drain(n, again) {
    return dialog({
      title: `Drain ${n.name}`,
      body: h("p", "Draining cordons the node (kept across its restarts). Terminating ends every sandbox on it now."),
      fields: [{ name: "terminate", label: "Terminate its sandboxes", type: "checkbox" }],
      ok: "Drain",
      danger: true,
      submit: (v) => post(`/v1/admin/nodes/${enc(n.name)}/drain`, { terminate: v.terminate }),
    }).then((result) => {
      if (!result) return;
      const failed = (result.failed || []).map((f) => `${f.id}: ${f.error}`);
      // Persistent sandboxes a drain without terminate suspended (an addition, capability persistent): they sleep
      // and wake wherever there is room at their next call; they do not count in remaining.
      const suspended = result.suspended || [];
      dialog({
        title: `${result.node} drained`,
        body: [
          h("p.drain-result", `${result.remaining} sandboxes still running; ${result.terminated.length} terminated` +
            `${suspended.length ? `; ${suspended.length} persistent suspended` : ""}.`),
          suspended.length ? h("div.drain-suspended",
            h("p", "Suspended persistent sandboxes (the next call that needs one wakes it):"),
            h("ul", suspended.map((id) => h("li", h("a", { href: `#/sandboxes/${enc(id)}` }, id))))) : null,
          failed.length ? h("ul", failed.map((t) => h("li.error", t))) : null,
          result.remaining ? h("p.muted", "Run the drain again until none remain, or terminate them.") : null,
        ],
        ok: "Close",
      });
      again();
    });
  }
  const timer = setInterval(() => !document.querySelector("dialog") && refresh(), NODES_MS);
  return () => clearInterval(timer);
}

export function renderLost(main) {
  page(main, "Lost sandboxes", () => [], async () => table([
    { label: "Sandbox", cell: (s) => h("code", s.id) },
    { label: "Owner", cell: (s) => `${s.user}${s.tenant ? ` (${s.tenant})` : ""}` },
    { label: "Node", cell: (s) => s.node },
    { label: "Resources", cell: (s) => `${s.cpus ?? "?"} CPU · ${s.memory_mb ?? "?"} MiB` },
    { label: "Node down since", cell: (s) => fmtTime(s.node_down_since) },
  ], (await get("/v1/admin/lost")).sandboxes, "No sandbox is on a lost node."));
}

// -- keys -----------------------------------------------------------------------------------------------------

const SCOPES = ["sandbox:read", "sandbox:create", "sandbox:delete", "sandbox:ssh", "secrets:write", "org:create", "admin"];

export function renderKeys(main) {
  const create = (again) => action("Create key", async () => {
    const made = await dialog({
      title: "Create an API key",
      fields: [
        { name: "user", label: "User", required: true },
        { name: "tenant", label: "Tenant (empty: the default one)" },
        ...SCOPES.map((s) => ({ name: s, label: s, type: "checkbox", value: s.startsWith("sandbox:") && s !== "sandbox:ssh" })),
      ],
      ok: "Create",
      submit: (v) => post("/v1/admin/keys", {
        user: v.user, ...(v.tenant ? { tenant: v.tenant } : {}), scopes: SCOPES.filter((s) => v[s]),
      }),
    });
    if (!made) return;
    again();
    const secret = h("input.secret", { value: made.secret, readonly: true, "aria-label": "The new key's secret", id: "new-secret" });
    await dialog({
      title: `Key ${made.id} for ${made.user}`,
      body: [h("p", "This secret is shown only now: copy it and keep it safe."), secret,
        h("button", { type: "button", onclick: () => navigator.clipboard?.writeText(made.secret).then(() => toast("copied")) }, "Copy")],
      ok: "Done",
    });
  });
  page(main, "API keys", (again) => [create(again)], async (again) => table([
    { label: "Key", cell: (k) => h("code", k.id) },
    { label: "User", cell: (k) => k.user },
    { label: "Tenant", cell: (k) => k.tenant || "default" },
    { label: "Scopes", cell: (k) => k.scopes.map((s) => h("span.tag", s)) },
    { label: "Created", cell: (k) => fmtTime(k.created) },
    { label: "State", cell: (k) => (k.revoked ? `revoked ${fmtTime(k.revoked)}` : "active") },
    { label: "Actions", cell: (k) => (k.revoked ? "" : action("Revoke", async () => {
      if (!(await confirm("Revoke key", `Revoke ${k.id} of ${k.user}? Its open terminals, streams and transfers are cut at once.`, "Revoke"))) return;
      await del(`/v1/admin/keys/${enc(k.id)}`);
      toast(`revoked ${k.id}`);
      again();
    }, { danger: true, "aria-label": `Revoke ${k.id}` })) },
  ], (await get("/v1/admin/keys")).keys.slice().reverse(), "No keys."));
}

// -- organisations (all) ----------------------------------------------------------------------------------------

export function renderAdminOrgs(main) {
  page(main, "All organisations", () => [], async () => table([
    { label: "Organisation", cell: (o) => h("a", { href: `#/orgs/${enc(o.name)}` }, o.name) },
    { label: "Members", cell: (o) => String(o.members) },
    { label: "Owners", cell: (o) => o.owners.join(", ") },
    { label: "Created", cell: (o) => `${fmtTime(o.created)} by ${o.created_by}${o.created_by_tenant ? ` (${o.created_by_tenant})` : ""}` },
  ], (await get("/v1/admin/orgs")).orgs, "No organisations."));
}

// -- audit ------------------------------------------------------------------------------------------------------

export function renderAudit(main) {
  const since = h("input", { id: "audit-since", type: "datetime-local" });
  const limit = h("input", { id: "audit-limit", type: "number", min: 1, max: 1000, value: 100 });
  const body = h("div");
  const load = async () => {
    try {
      const answer = await get(`/v1/admin/audit${query({
        since: since.value ? new Date(since.value).toISOString() : "", limit: limit.value,
      })}`);
      const details = (e) => Object.entries(e).filter(([k]) => !["time", "kind", "type"].includes(k))
        .map(([k, v]) => `${k}=${v}`).join("  ");
      clear(body,
        answer.truncated ? h("p.muted", "More entries match: narrow the time or raise the limit.") : null,
        table([
          { label: "Time", cell: (e) => fmtTime(e.time) },
          { label: "Type", cell: (e) => h("code", e.type) },
          { label: "Details", cell: (e) => h("span.details", details(e)) },
        ], answer.entries, "No entries."));
    } catch (error) {
      clear(body, errorBox(error));
    }
  };
  clear(main, h("h1", "Audit log"),
    h("form.toolbar", { onsubmit: (ev) => { ev.preventDefault(); load(); } },
      h("label", { for: "audit-since" }, "Since"), since,
      h("label", { for: "audit-limit" }, "Limit (1 to 1000)"), limit,
      h("button.primary", { type: "submit" }, "Show")),
    body);
  load();
}

// -- quotas -----------------------------------------------------------------------------------------------------

export function renderQuotas(main) {
  const amount = (limit, used) => `${used} / ${limit ?? "∞"}`;
  const edit = (q, again) => dialog({
    title: `Quota of ${q.tenant}`,
    body: h("p.muted", "Empty: no limit on that amount."),
    fields: [
      { name: "tenant", label: "Tenant", value: q.tenant, required: true },
      { name: "sandboxes", label: "Sandboxes", type: "number", value: q.sandboxes ?? "" },
      { name: "cpus", label: "CPUs", type: "number", value: q.cpus ?? "" },
      { name: "memory_mb", label: "Memory MiB", type: "number", value: q.memory_mb ?? "" },
    ],
    ok: "Save",
    submit: (v) => put(`/v1/admin/quotas/${enc(v.tenant)}`, Object.fromEntries(
      ["sandboxes", "cpus", "memory_mb"].map((k) => [k, v[k] === "" ? null : Number(v[k])]))),
  }).then((saved) => saved && again());
  page(main, "Tenant quotas",
    (again) => [action("Set a quota", () => edit({ tenant: "" }, again))],
    async (again) => table([
      { label: "Tenant", cell: (q) => q.tenant },
      { label: "Sandboxes", cell: (q) => amount(q.sandboxes, q.used.sandboxes) },
      { label: "CPUs", cell: (q) => amount(q.cpus, q.used.cpus) },
      { label: "Memory MiB", cell: (q) => amount(q.memory_mb, q.used.memory_mb) },
      { label: "Actions", cell: (q) => action("Edit", () => edit(q, again), { "aria-label": `Edit quota of ${q.tenant}` }) },
    ], (await get("/v1/admin/quotas")).quotas, "No tenant has a quota or sandboxes."));
}
