// trainmon TensorBoard plugin: the ES module TensorBoard loads into the plugin's iframe
// (/data/plugin_entry.html?name=trainmon, <base href="plugin/trainmon/">); it calls render().
// The application lives next to this file in static/; this entry works whether it is served as
// /data/plugin/trainmon/static/index.js or as /data/plugin/trainmon/index.js.

const here = new URL('.', import.meta.url).pathname;
const dir = here.endsWith('/static/') ? './' : './static/';

export async function render() {
  const app = await import(`${dir}app.js`);
  return app.render();
}
