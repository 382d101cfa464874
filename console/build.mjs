// Builds the console into ../src/sbx/web/console_assets (or the directory given as the first argument):
// index.html, console.js and console.css (one bundle each, minified, with source maps), and
// THIRD-PARTY-LICENSES.txt with the licence of every package bundled. No network: only node_modules.
import { build } from "esbuild";
import { mkdirSync, readFileSync, rmSync, writeFileSync, cpSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = process.argv[2] ?? join(here, "..", "src", "sbx", "web", "console_assets");
// What the bundles contain from node_modules; their licences ship beside them.
const BUNDLED = ["@xterm/xterm", "@xterm/addon-fit", "uplot"];

rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
await build({
  entryPoints: { console: join(here, "src", "main.js") },
  bundle: true,
  minify: true,
  sourcemap: "linked",
  format: "esm",
  target: ["chrome111", "firefox115", "safari16.4"],
  outdir: out,
  legalComments: "none",
  logLevel: "warning",
});
cpSync(join(here, "src", "index.html"), join(out, "index.html"));
const licences = BUNDLED.map((name) => {
  const dir = join(here, "node_modules", name);
  const pkg = JSON.parse(readFileSync(join(dir, "package.json"), "utf8"));
  return `${name} ${pkg.version} (${pkg.license})\n\n${readFileSync(join(dir, "LICENSE"), "utf8").trim()}\n`;
});
writeFileSync(join(out, "THIRD-PARTY-LICENSES.txt"), licences.join("\n" + "-".repeat(78) + "\n\n"));
console.log(`console built in ${out}`);
