// Time series charts of a sandbox's metrics (uPlot, drawn on a canvas).

import uPlot from "uplot";

/** A chart in `container`: `series` [{label, stroke}], data [[times (s)], [values]...], values shown by `fmt`. */
export function chart(container, title, series, fmt) {
  const width = Math.max(280, container.clientWidth || 600);
  const options = {
    title,
    width,
    height: 200,
    // At least five minutes wide, so the first samples are not spread over a range of years.
    scales: { x: { time: true, range: (u, min, max) => [Math.min(min ?? max, max - 300), max] } },
    axes: [{}, { values: (u, ticks) => ticks.map(fmt), size: 86 }],
    series: [{}, ...series.map((s) => ({ label: s.label, stroke: s.stroke, width: 2, value: (u, v) => fmt(v) }))],
    legend: { live: true },
  };
  const plot = new uPlot(options, [[], ...series.map(() => [])], container);
  const observer = new ResizeObserver(() => plot.setSize({ width: Math.max(280, container.clientWidth), height: 200 }));
  observer.observe(container);
  return {
    set(data) {
      plot.setData(data);
    },
    dispose() {
      observer.disconnect();
      plot.destroy();
    },
  };
}
