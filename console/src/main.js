// The console's shell: sign-in, the organisation switcher, navigation, and a hash router (#/sandboxes, ...).

import "@xterm/xterm/css/xterm.css";
import "uplot/dist/uPlot.min.css";
import "./style.css";
import { installCspShims } from "./csp.js";
import { ApiError, get, onUnauthorized, session } from "./api.js";
import { clear, errorBox, h } from "./ui.js";
import { renderSandboxes } from "./pages/sandboxes.js";
import { renderSandbox } from "./pages/sandbox.js";
import { renderAdminOrgs, renderAudit, renderKeys, renderLost, renderNodes, renderQuotas } from "./pages/admin.js";
import { renderMembers, renderOrgs } from "./pages/orgs.js";
import { renderService, renderServices } from "./pages/services.js";
import { renderJob, renderJobs } from "./pages/jobs.js";
import { renderSecrets } from "./pages/secrets.js";
import { renderSsh } from "./pages/ssh.js";

installCspShims();

const app = document.getElementById("app");
const header = h("header.top");
const banner = h("div.banner", { role: "alert", hidden: true });
const main = h("main#main", { tabindex: "-1" });
const footer = h("footer", h("a", { href: "THIRD-PARTY-LICENSES.txt" }, "Third-party licences"),
  " · ", h("a", { href: "/openapi.json" }, "API description"));
app.append(header, banner, main, footer);

const ROUTES = [
  [/^#\/sandboxes\/([^/]+)(?:\/([a-z]+))?(?:\/(\d+))?$/, (m) => renderSandbox(main, decodeURIComponent(m[1]), m[2], m[3])],
  [/^#\/sandboxes$/, () => renderSandboxes(main)],
  [/^#\/services\/([^/]+)\/([^/]+)$/, (m) => renderService(main, decodeURIComponent(m[1]), decodeURIComponent(m[2]))],
  [/^#\/services$/, () => renderServices(main)],
  [/^#\/jobs\/([^/]+)$/, (m) => renderJob(main, decodeURIComponent(m[1]))],
  [/^#\/jobs$/, () => renderJobs(main)],
  [/^#\/secrets$/, () => renderSecrets(main)],
  [/^#\/ssh(?:\/([^/]+))?$/, (m) => renderSsh(main, m[1] ? decodeURIComponent(m[1]) : "")],
  [/^#\/orgs\/([^/]+)$/, (m) => renderMembers(main, decodeURIComponent(m[1]))],
  [/^#\/orgs$/, () => renderOrgs(main)],
  [/^#\/admin\/nodes$/, () => renderNodes(main), true],
  [/^#\/admin\/lost$/, () => renderLost(main), true],
  [/^#\/admin\/keys$/, () => renderKeys(main), true],
  [/^#\/admin\/orgs$/, () => renderAdminOrgs(main), true],
  [/^#\/admin\/audit$/, () => renderAudit(main), true],
  [/^#\/admin\/quotas$/, () => renderQuotas(main), true],
];
let cleanup = null;

onUnauthorized.push((message) => {
  banner.hidden = false;
  clear(banner, `The gateway refused this key: ${message}. `,
    h("a", { href: "#/signin", onclick: () => session.signOut() }, "Sign in again"));
});

async function route() {
  if (cleanup) cleanup();
  cleanup = null;
  const hash = location.hash || "#/sandboxes";
  if (!session.key || hash === "#/signin") {
    renderSignIn();
    return;
  }
  if (!session.me) {
    try {
      session.me = await get("/v1/whoami");
    } catch (error) {
      if (error instanceof ApiError && error.status === 404 && session.org) {
        session.setOrg(""); // the organisation is gone or we were removed: back to the key's own tenant
        return route();
      }
      renderSignIn(error);
      return;
    }
    await renderHeader();
  }
  const admin = session.me.scopes.includes("admin");
  for (const [pattern, render, needsAdmin] of ROUTES) {
    const match = hash.match(pattern);
    if (!match) continue;
    if (needsAdmin && !admin) {
      clear(main, h("h1", "Admin only"), h("p", "This page needs a key with the admin scope."));
      return;
    }
    cleanup = render(match) || null;
    highlight(hash);
    return;
  }
  location.hash = "#/sandboxes";
}

function highlight(hash) {
  for (const link of header.querySelectorAll("nav a")) {
    const here = hash === link.getAttribute("href") || hash.startsWith(`${link.getAttribute("href")}/`);
    if (here) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
}

async function renderHeader() {
  const me = session.me;
  const links = [["#/sandboxes", "Sandboxes"], ["#/services", "Services"], ["#/jobs", "Jobs"],
    ["#/secrets", "Secrets"], ["#/ssh", "SSH"], ["#/orgs", "Organisations"]];
  if (me.scopes.includes("admin")) {
    links.push(["#/admin/nodes", "Nodes"], ["#/admin/lost", "Lost"], ["#/admin/keys", "Keys"],
      ["#/admin/orgs", "All orgs"], ["#/admin/audit", "Audit"], ["#/admin/quotas", "Quotas"]);
  }
  const switcher = h("select", { id: "org", "aria-label": "Organisation" });
  try {
    const orgs = (await get("/v1/orgs")).orgs;
    for (const org of orgs) {
      const own = orgs.indexOf(org) === 0;
      switcher.append(h("option", { value: own ? "" : org.name, selected: org.current }, own ? `${org.name} (own)` : org.name));
    }
  } catch (error) {
    switcher.append(h("option", { value: session.org }, session.org || "own tenant"));
  }
  switcher.addEventListener("change", async () => {
    session.setOrg(switcher.value);
    session.me = null;
    await route();
  });
  clear(header,
    h("a.brand", { href: "#/sandboxes" }, "sbx console"),
    h("nav", { "aria-label": "Main" }, links.map(([href, text]) => h("a", { href }, text))),
    h("div.who",
      h("label", { for: "org" }, "Acting in"), switcher,
      h("span.user", { title: `key ${me.key_id}` }, me.user),
      h("button", { type: "button", onclick: signOut }, "Sign out")));
}

function signOut() {
  session.signOut();
  session.me = null;
  clear(header);
  banner.hidden = true;
  location.hash = "#/signin";
}

function renderSignIn(error) {
  clear(header, h("span.brand", "sbx console"));
  banner.hidden = true;
  const key = h("input", { id: "api-key", type: "password", autocomplete: "off", required: true, placeholder: "sgk_…" });
  const problem = h("div", error ? errorBox(error) : null);
  const form = h("form.signin",
    h("h1", "Sign in"),
    h("p", "Paste an API key. It is kept in this tab only (session storage) and sent to this gateway alone."),
    h("div.field", h("label", { for: "api-key" }, "API key"), key),
    problem,
    h("button.primary", { type: "submit" }, "Sign in"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    session.signIn(key.value.trim());
    session.setOrg("");
    session.me = null;
    try {
      session.me = await get("/v1/whoami");
    } catch (failure) {
      session.signOut();
      clear(problem, errorBox(failure));
      return;
    }
    banner.hidden = true;
    await renderHeader();
    if (location.hash === "#/sandboxes") route();
    else location.hash = "#/sandboxes";
  });
  clear(main, form);
  key.focus();
}

window.addEventListener("hashchange", route);
route();
