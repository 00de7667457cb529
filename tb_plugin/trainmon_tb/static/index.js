// trainmon TensorBoard plugin: the ES module TensorBoard loads into the plugin's iframe
// (/data/plugin_entry.html?name=trainmon) from /data/plugin/trainmon/static/index.js; it calls render().
// The application and its views are the other modules of this folder.

// Every module of the application, fetched at once rather than one import level after another (app.js,
// then what it imports): the first view waits for the last of them.
const MODULES = ['app', 'api', 'chart', 'compare', 'detail', 'dumpview', 'heatmap', 'ipc', 'timeline', 'util'];

export async function render() {
  for (const name of MODULES) {
    const link = document.createElement('link');
    link.rel = 'modulepreload';
    link.href = new URL(`./${name}.js`, import.meta.url).href;
    document.head.append(link);
  }
  const css = document.createElement('link'); // the style sheet the app links, in the same fetches
  css.rel = 'preload';
  css.as = 'style';
  css.href = new URL('./style.css', import.meta.url).href;
  document.head.append(css);
  // the run list is asked for while the modules load (app.js would ask only once they all have)
  const runs = import('./api.js').then((api) => api.getJSON('runs'));
  runs.catch(() => {}); // its failure is shown by the app
  const app = await import('./app.js');
  return app.render({ runs });
}
