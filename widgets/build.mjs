// Bundles the widget front-end into flexlab/jupyter/static/, which is committed so the wheel ships it and
// neither CI nor users need npm. Run `npm install && npm run build` in this folder after editing src/.
import { build } from "esbuild";
import { copyFileSync } from "node:fs";

const out = new URL("../flexlab/jupyter/static/", import.meta.url).pathname;
await build({
  entryPoints: ["src/editor.js"],
  bundle: true,
  format: "esm",
  minify: true,
  target: ["es2020"],
  legalComments: "eof",
  outfile: `${out}editor.js`,
});
copyFileSync("src/editor.css", `${out}editor.css`);
console.log(`built ${out}editor.js`);
