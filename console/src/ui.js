// Small DOM helpers. Text always goes in as text (textContent), never as HTML, so nothing the server or a
// sandbox returns can become markup.

/** h("button.primary", {onclick}, "Save") — a tag with optional .classes and #id, attributes, children. */
export function h(spec, attrs = {}, ...children) {
  const [, tag = "div", rest = ""] = spec.match(/^([a-z0-9-]*)(.*)$/i);
  const element = document.createElement(tag || "div");
  for (const part of rest.match(/[.#][^.#]+/g) || []) {
    if (part[0] === ".") element.classList.add(part.slice(1));
    else element.id = part.slice(1);
  }
  if (attrs === null || typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs)) {
    children.unshift(attrs);
    attrs = {};
  }
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (name in element && typeof value !== "string") element[name] = value;
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(element, ...children) {
  element.replaceChildren();
  append(element, children);
  return element;
}

/** A table: columns [{label, cell(row) -> node or text}], rows; an empty note when there are none. */
export function table(columns, rows, empty = "Nothing here.") {
  if (!rows.length) return h("p.empty", empty);
  return h(
    "div.scroll",
    h(
      "table",
      h("thead", h("tr", columns.map((c) => h("th", { scope: "col" }, c.label)))),
      h("tbody", rows.map((row) => h("tr", columns.map((c) => h("td", { dataset: { label: c.label } }, c.cell(row)))))),
    ),
  );
}

/** An error as the server said it (status, code and message), in a live region. */
export function errorBox(error) {
  return h("p.error", { role: "alert" }, String(error));
}

let toastArea;
export function toast(message, kind = "info") {
  if (!toastArea) {
    toastArea = h("div.toasts", { role: "status", "aria-live": "polite" });
    document.body.append(toastArea);
  }
  const note = h(`div.toast.${kind}`, String(message));
  toastArea.append(note);
  setTimeout(() => note.remove(), kind === "error" ? 12000 : 5000);
}

/**
 * A modal dialog (the <dialog> element: focus is kept inside, Escape cancels). `body` is a node or a list;
 * `fields` builds a form whose values `submit(values)` receives. Resolves with the submit's result, or null when
 * cancelled. An error thrown by `submit` is shown in the dialog, which stays open.
 */
export function dialog({ title, body = [], fields = [], ok = "OK", danger = false, submit = async () => true }) {
  return new Promise((resolve) => {
    const problem = h("div.problem");
    const inputs = fields.map(field);
    const form = h(
      "form",
      { method: "dialog" },
      h("h2", title),
      body,
      inputs.map((i) => i.row),
      problem,
      h(
        "div.actions",
        h("button", { type: "button", value: "cancel", onclick: () => close(null) }, "Cancel"),
        h(`button.${danger ? "danger" : "primary"}`, { type: "submit", value: "ok" }, ok),
      ),
    );
    const box = h("dialog", { "aria-label": title }, form);
    let settled = false;
    const close = (value) => {
      if (settled) return;
      settled = true;
      box.close();
      box.remove();
      resolve(value);
    };
    box.addEventListener("cancel", (event) => {
      event.preventDefault();
      close(null);
    });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const values = Object.fromEntries(inputs.map((i) => [i.name, i.value()]));
      const button = form.querySelector("button[type=submit]");
      button.disabled = true;
      try {
        close(await submit(values));
      } catch (error) {
        clear(problem, errorBox(error));
      } finally {
        button.disabled = false;
      }
    });
    document.body.append(box);
    box.showModal();
    const first = form.querySelector("input, select, textarea");
    if (first) first.focus();
  });
}

/** Ask before something that cannot be undone: resolves true or false. */
export async function confirm(title, text, ok = "Confirm") {
  return (await dialog({ title, body: h("p", text), ok, danger: true })) === true;
}

/** A labelled form control: {name, label, type (text, number, select, textarea, checkbox), value, options, hint}. */
export function field({ name, label, type = "text", value = "", options = [], hint, required, placeholder }) {
  const id = `f-${name}-${Math.random().toString(36).slice(2, 8)}`;
  let control;
  if (type === "select") {
    control = h("select", { id, name }, options.map((o) => {
      const [v, text] = Array.isArray(o) ? o : [o, o];
      return h("option", { value: v, selected: v === value }, text);
    }));
  } else if (type === "textarea") {
    control = h("textarea", { id, name, rows: 3, placeholder }, value);
  } else if (type === "checkbox") {
    control = h("input", { id, name, type, checked: Boolean(value) });
  } else {
    control = h("input", { id, name, type, value, required, placeholder, autocomplete: "off" });
  }
  const row = h(
    `div.field${type === "checkbox" ? ".check" : ""}`,
    h("label", { for: id }, label),
    control,
    hint ? h("small", hint) : null,
  );
  const read = () => (type === "checkbox" ? control.checked : control.value);
  return { name, row, control, value: read };
}

export function fmtBytes(bytes) {
  if (bytes === undefined || bytes === null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit && value < 10 ? 1 : 0)} ${units[unit]}`;
}

export function fmtAge(time) {
  if (!time) return "";
  const secs = Math.max(0, (Date.now() - Date.parse(time)) / 1000);
  if (secs < 60) return `${Math.floor(secs)} s`;
  if (secs < 3600) return `${Math.floor(secs / 60)} min`;
  if (secs < 86400) return `${Math.floor(secs / 3600)} h`;
  return `${Math.floor(secs / 86400)} d`;
}

export function fmtTime(time) {
  return time ? new Date(time).toLocaleString() : "";
}

/** "key=value" lines (or comma separated) to an object; throws on a line without "=". */
export function parseLabels(text) {
  const labels = {};
  for (const item of text.split(/[\n,]/).map((s) => s.trim()).filter(Boolean)) {
    const at = item.indexOf("=");
    if (at <= 0) throw new Error(`label "${item}" is not key=value`);
    labels[item.slice(0, at).trim()] = item.slice(at + 1).trim();
  }
  return labels;
}

export function labelText(labels) {
  return Object.entries(labels || {})
    .map(([k, v]) => `${k}=${v}`)
    .join("\n");
}

/** A button that runs `action` and shows its error as a toast; disabled while it runs. */
export function action(label, run, { danger = false, ...attrs } = {}) {
  const button = h(`button${danger ? ".danger" : ""}`, { type: "button", ...attrs }, label);
  button.addEventListener("click", async () => {
    button.disabled = true;
    try {
      await run();
    } catch (error) {
      toast(String(error), "error");
    } finally {
      button.disabled = false;
    }
  });
  return button;
}
