// Line charts with the vendored uPlot (a global from static/vendor/uplot-*/uPlot.iife.min.js).
import { el } from "./common.js";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2"];
const charts = new Set();

/** A chart of `names` over x values, in a new `.chart` element under `parent`; `xLabel` names x.
 *  `timeAxis`: x values are Unix seconds. The element keeps its uPlot instance as `.uplot`. */
export function lineChart(parent, title, names, { xLabel = "step", timeAxis = false, bars = false } = {}) {
  const box = el("figure", { class: "chart", "aria-label": title }, el("figcaption", {}, title));
  parent.append(box);
  const ink = getComputedStyle(document.body).color;
  const grid = { stroke: "rgba(127,127,127,0.2)" };
  const opts = {
    width: Math.max(280, box.clientWidth - 8),
    height: 220,
    scales: { x: { time: timeAxis } },
    legend: { live: !timeAxis },
    axes: [
      { stroke: ink, grid, label: timeAxis ? undefined : xLabel },
      { stroke: ink, grid, size: 60 },
    ],
    series: [
      { label: timeAxis ? "day" : xLabel },
      ...names.map((name, i) => ({
        label: name, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
        fill: bars ? COLORS[i % COLORS.length] + "55" : undefined,
        paths: bars ? globalThis.uPlot.paths.bars({ size: [0.6, 40] }) : undefined,
        points: { show: true, size: 4 },
      })),
    ],
  };
  const plot = new globalThis.uPlot(opts, [[], ...names.map(() => [])], box);
  box.uplot = plot;
  charts.add(plot);
  return plot;
}

addEventListener("resize", () => {
  for (const plot of charts) {
    const width = Math.max(280, plot.root.parentElement.clientWidth - 8);
    plot.setSize({ width, height: 220 });
  }
});
