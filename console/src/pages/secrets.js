// Secrets of the tenant acted in: names and update times only (the API never answers a value). A value is typed
// into a write-only field of a dialog, sent once, and gone from the page when the dialog closes: the field is
// emptied and the dialog removed, whether the save worked or was cancelled.

import { del, enc, get, put, session } from "../api.js";
import { action, clear, confirm, errorBox, fmtTime, h, table, toast } from "../ui.js";

export function renderSecrets(main) {
  const body = h("div");
  const canWrite = session.me.scopes.includes("secrets:write") || session.me.scopes.includes("admin");
  const refresh = async () => {
    try {
      const secrets = (await get("/v1/secrets")).secrets;
      clear(body, table([
        { label: "Name", cell: (s) => h("code", s.name) },
        { label: "Updated", cell: (s) => fmtTime(s.updated_at) },
        { label: "Actions", cell: (s) => h("div.row-actions",
          action("Set value", () => setSecret(s.name).then((done) => done && refresh()), { "aria-label": `Set ${s.name}`, disabled: !canWrite }),
          action("Delete", async () => {
            if (!(await confirm("Delete secret", `Delete ${s.name}? Jobs and replicas made afterwards that name it fail; running ones keep the value they have.`, "Delete"))) return;
            await del(`/v1/secrets/${enc(s.name)}`);
            toast(`deleted ${s.name}`);
            refresh();
          }, { danger: true, "aria-label": `Delete ${s.name}`, disabled: !canWrite })) },
      ], secrets, "No secrets in this tenant yet."));
    } catch (error) {
      clear(body, errorBox(error));
    }
  };
  clear(main,
    h("div.bar", h("h1", "Secrets"),
      h("div.row-actions",
        action("New secret", () => setSecret().then((done) => done && refresh()), { disabled: !canWrite }),
        action("Refresh", refresh))),
    h("p.muted", `Values a job or service puts in its sandboxes' environment, by name. They are sealed at rest and never shown again, here or by the API.${canWrite ? "" : " This key lacks secrets:write: it may list them only."}`),
    body);
  refresh();
}

/**
 * The write-only dialog: a name (fixed when updating) and the value in a password field. Resolves true when
 * saved. Not the shared dialog helper, so that the value is read from the field only at the moment it is sent
 * and the field is emptied before the dialog goes, whatever happens.
 */
function setSecret(name = "") {
  return new Promise((resolve) => {
    const nameInput = h("input#secret-name", { name: "name", value: name, required: true, readonly: Boolean(name),
      autocomplete: "off", spellcheck: "false" });
    let valueInput = h("input#secret-value", { name: "value", type: "password", required: true,
      autocomplete: "new-password", spellcheck: "false" });
    // A password field holds one line: a certificate or a JSON document goes in a text area instead (shown as
    // typed, emptied all the same).
    const multiline = h("input#secret-multiline", { type: "checkbox" });
    multiline.addEventListener("change", () => {
      const typed = valueInput.value;
      valueInput.value = "";
      const next = multiline.checked
        ? h("textarea#secret-value", { name: "value", required: true, rows: 6, spellcheck: "false", autocomplete: "off" })
        : h("input#secret-value", { name: "value", type: "password", required: true, autocomplete: "new-password", spellcheck: "false" });
      next.value = typed;
      valueInput.replaceWith(next);
      valueInput = next;
      valueInput.focus();
    });
    const problem = h("div.problem");
    const save = h("button.primary", { type: "submit" }, "Save");
    const form = h("form", { method: "dialog" },
      h("h2", name ? `Set ${name}` : "New secret"),
      h("div.field", h("label", { for: "secret-name" }, "Name (an environment variable name)"), nameInput),
      h("div.field", h("label", { for: "secret-value" }, "Value (write-only: never shown again)"), valueInput,
        h("small", "At most 64 KiB of text. Saving replaces the value; jobs and replicas made afterwards get it.")),
      h("div.field.check", h("label", { for: "secret-multiline" }, "Several lines (a text area, shown as typed)"), multiline),
      problem,
      h("div.actions", h("button", { type: "button", onclick: () => close(false) }, "Cancel"), save));
    const box = h("dialog", { "aria-label": name ? `Set ${name}` : "New secret" }, form);
    const close = (saved) => {
      valueInput.value = "";
      box.close();
      box.remove();
      resolve(saved);
    };
    box.addEventListener("cancel", (event) => {
      event.preventDefault();
      close(false);
    });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const secretName = nameInput.value.trim();
      save.disabled = true;
      try {
        await put(`/v1/secrets/${enc(secretName)}`, { value: valueInput.value });
      } catch (error) {
        clear(problem, errorBox(error));
        save.disabled = false;
        return;
      }
      toast(`${secretName} saved`);
      close(true);
    });
    document.body.append(box);
    box.showModal();
    (name ? valueInput : nameInput).focus();
  });
}
