// A sandbox's ports tab (capability exposed_ports: a gateway run with --ports-domain; docs/ports.md): the ports its
// guest listens on and the public ones, each with an "Open" link and a public/private toggle.
//
// "Open" of a private port makes a port token when clicked (POST .../ports/{port}/tokens) and opens its URL in a
// new tab: the key stays in this tab (a token opens that one port, and the gateway trades it for a cookie of that
// port's host), and no token is made that nobody asked for. A public port's link is its plain URL.

import { enc, get, post, put } from "../api.js";
import { action, clear, confirm, errorBox, every, h, table, toast } from "../ui.js";

/** How often the list is looked at again (a server started in the guest shows without a reload). */
const PORTS_MS = 5000;
/** Lifetime of the token an "Open" click makes, in seconds. */
const OPEN_TTL_SECS = 3600;

/** Open `url` in a new tab that cannot reach back to this page (no opener, no referrer). */
function openTab(url) {
  window.open(url, "_blank", "noopener,noreferrer");
}

function openLink(id, port) {
  const link = h("a.button.port-open", {
    href: port.url, target: "_blank", rel: "noopener noreferrer", "aria-label": `Open port ${port.port}`,
  }, "Open");
  if (port.public) return link;
  link.title = "Opens with a token URL made now, good for an hour";
  link.addEventListener("click", async (event) => {
    event.preventDefault();
    try {
      const made = await post(`/v1/sandboxes/${enc(id)}/ports/${port.port}/tokens`, { ttl_secs: OPEN_TTL_SECS });
      openTab(made.url);
    } catch (error) {
      toast(String(error), "error");
    }
  });
  return link;
}

function toggle(id, port, again) {
  if (port.public) {
    return action("Make private", async () => {
      await put(`/v1/sandboxes/${enc(id)}/ports/${port.port}`, { public: false });
      again();
    }, { "aria-label": `Make port ${port.port} private` });
  }
  return action("Make public", async () => {
    const sure = await confirm(`Make port ${port.port} public`,
      `Anyone who has ${port.url} may open it, without a key, until it is made private again.`, "Make public");
    if (!sure) return;
    await put(`/v1/sandboxes/${enc(id)}/ports/${port.port}`, { public: true });
    again();
  }, { danger: true, "aria-label": `Make port ${port.port} public` });
}

export function ports(body, id) {
  const list = h("div.ports");
  let shown = "";
  const load = async () => {
    try {
      const answer = await get(`/v1/sandboxes/${enc(id)}/ports`);
      const text = JSON.stringify(answer);
      if (text === shown) return; // redrawn only when something changed: a button is not replaced under the pointer
      shown = text;
      clear(list, table([
        { label: "Port", cell: (p) => String(p.port) },
        { label: "URL", cell: (p) => h("code", p.url) },
        { label: "Access", cell: (p) => h(`span.tag.${p.public ? "public" : "private"}`, p.public ? "public" : "private") },
        { label: "Listening", cell: (p) => (p.listening ? "yes" : "no") },
        { label: "Actions", cell: (p) => h("div.row-actions", openLink(id, p), toggle(id, p, () => { shown = ""; load(); })) },
      ], answer.ports, "Nothing listens in this sandbox yet: start a server (on any address) and it shows here."));
    } catch (error) {
      shown = "";
      clear(list, errorBox(error));
    }
  };
  clear(body,
    h("p.muted", "A private port opens with a token URL made when you click Open (a new tab, for an hour; whoever " +
      "holds that URL can use it). A public port opens for anyone who has its URL."),
    list);
  return every(PORTS_MS, load);
}
