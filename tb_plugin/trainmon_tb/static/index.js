// trainmon TensorBoard plugin: the ES module TensorBoard loads into the plugin's iframe
// (/data/plugin_entry.html?name=trainmon) from /data/plugin/trainmon/static/index.js; it calls render().
// The application and its views are the other modules of this folder.

export async function render() {
  const app = await import('./app.js');
  return app.render();
}
