// Time series charts of a sandbox's metrics (uPlot, drawn on a canvas).

import uPlot from "uplot";

/** A chart in `container`: `series` [{label, stroke}], data [[times (s)], [values]...], values shown by `fmt`. */
export function chart(container, title, series, fmt) {
  const width = Math.max(280, container.clientWidth || 600);
  const options = {
    title,
    width,
    height: 200,
    // The x range is set with each data set (below): uPlot's own auto range spreads a single sample over years.
    scales: { x: { time: true, auto: false } },
    axes: [{}, { values: (u, ticks) => ticks.map(fmt), size: 86 }],
    series: [{}, ...series.map((s) => ({ label: s.label, stroke: s.stroke, width: 2, value: (u, v) => fmt(v) }))],
    legend: { live: true },
  };
  const plot = new uPlot(options, [[], ...series.map(() => [])], container);
  const observer = new ResizeObserver(() => plot.setSize({ width: Math.max(280, container.clientWidth), height: 200 }));
  observer.observe(container);
  return {
    set(data) {
      plot.setData(data, false);
      const times = data[0];
      if (times.length > 0) {
        // At least five minutes wide, ending at the newest sample; the y scales follow this window.
        const max = times[times.length - 1];
        plot.setScale("x", { min: Math.min(times[0], max - 300), max });
      }
    },
    dispose() {
      observer.disconnect();
      plot.destroy();
    },
  };
}
