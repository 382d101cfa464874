// Organisations: the key's own tenant and its user's organisations (create one with org:create), and the
// members of one (owners add, change roles and remove; removing a member ends what they had open in it).

import { del, enc, get, post } from "../api.js";
import { action, clear, confirm, dialog, errorBox, fmtTime, h, table, toast } from "../ui.js";

export function renderOrgs(main) {
  const body = h("div");
  const load = async () => {
    try {
      const orgs = (await get("/v1/orgs")).orgs;
      clear(body, table([
        { label: "Organisation", cell: (o) => (o.created ? h("a", { href: `#/orgs/${enc(o.name)}` }, o.name) : `${o.name} (your key's tenant)`) },
        { label: "Role", cell: (o) => o.role },
        { label: "Acting in", cell: (o) => (o.current ? "yes" : "") },
        { label: "Created", cell: (o) => fmtTime(o.created) },
      ], orgs));
    } catch (error) {
      clear(body, errorBox(error));
    }
  };
  const create = action("Create organisation", async () => {
    const made = await dialog({
      title: "Create an organisation",
      fields: [{ name: "name", label: "Name (a-z, 0-9 and -, 1 to 30)", required: true }],
      ok: "Create",
      submit: (v) => post("/v1/orgs", { name: v.name }),
    });
    if (made) {
      toast(`created ${made.name}`);
      load();
    }
  });
  clear(main, h("div.bar", h("h1", "Organisations"), create),
    h("p.muted", "Pick the organisation to act in with the switcher at the top."), body);
  load();
}

export function renderMembers(main, name) {
  const body = h("div");
  const load = async () => {
    try {
      const members = (await get(`/v1/orgs/${enc(name)}/members`)).members;
      clear(body, table([
        { label: "User", cell: (m) => m.user },
        { label: "Tenant", cell: (m) => m.tenant || "default" },
        { label: "Role", cell: (m) => m.role },
        { label: "Added", cell: (m) => fmtTime(m.added) },
        { label: "Actions", cell: (m) => h("div.row-actions",
          action(m.role === "owner" ? "Make member" : "Make owner", async () => {
            await post(`/v1/orgs/${enc(name)}/members`, { user: m.user, tenant: m.tenant || "default", role: m.role === "owner" ? "member" : "owner" });
            load();
          }),
          action("Remove", async () => {
            if (!(await confirm("Remove member", `Remove ${m.user} from ${name}? What they have open in it is ended.`, "Remove"))) return;
            await del(`/v1/orgs/${enc(name)}/members/${enc(m.user)}?tenant=${enc(m.tenant || "default")}`);
            load();
          }, { danger: true })) },
      ], members));
    } catch (error) {
      clear(body, errorBox(error));
    }
  };
  const add = action("Add member", async () => {
    const added = await dialog({
      title: `Add a member to ${name}`,
      fields: [
        { name: "user", label: "User", required: true },
        { name: "tenant", label: "Their tenant (empty: yours)" },
        { name: "role", label: "Role", type: "select", value: "member", options: ["member", "owner"] },
      ],
      ok: "Add",
      submit: (v) => post(`/v1/orgs/${enc(name)}/members`, { user: v.user, role: v.role, ...(v.tenant ? { tenant: v.tenant } : {}) }),
    });
    if (added) load();
  });
  clear(main, h("p", h("a", { href: "#/orgs" }, "← Organisations")), h("div.bar", h("h1", `Members of ${name}`), add), body);
  load();
}
