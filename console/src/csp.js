// The console runs under a strict Content-Security-Policy: scripts and stylesheets only from this origin, and
// <style> elements only with this answer's nonce (no 'unsafe-inline'). xterm.js writes its dynamic CSS (cell
// size, theme colours) into <style> elements it creates, and a few cell styles through setAttribute("style").
// Two shims make that work without loosening the policy:
//  - every <style> element created through document.createElement gets the nonce at creation (before it is
//    inserted, which is when the browser checks it);
//  - setAttribute("style", text) goes through the CSSOM (element.style.cssText), which the policy allows.
// The nonce is read from the <script> element the server stamped; an injected element never has it.

export function installCspShims() {
  const stamped = document.querySelector("script[nonce]");
  const nonce = stamped ? stamped.nonce : "";
  const create = Document.prototype.createElement;
  Document.prototype.createElement = function (tag, options) {
    const element = create.call(this, tag, options);
    if (nonce && String(tag).toLowerCase() === "style") element.setAttribute("nonce", nonce);
    return element;
  };
  const setAttribute = Element.prototype.setAttribute;
  Element.prototype.setAttribute = function (name, value) {
    if (String(name).toLowerCase() === "style" && this.style) {
      this.style.cssText = String(value);
      return;
    }
    setAttribute.call(this, name, value);
  };
}
