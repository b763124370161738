// A small line chart on a canvas: a few series over the last samples, a y axis from 0 to a round
// maximum, and a legend with each series' latest value.

function niceMax(value) {
  if (!(value > 0)) return 1;
  const exponent = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (value <= step * exponent) return step * exponent;
  }
  return 10 * exponent;
}

function format(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toFixed(digits);
}

// series: [{label, color, values: [number|null], dashed?}]; options: {capacity, digits, unit, min}
export function drawChart(canvas, series, { capacity = 120, digits = 0, unit = "", min = 0 } = {}) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 300;
  const height = canvas.clientHeight || 150;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const style = getComputedStyle(canvas);
  const ink = style.color || "#333";
  const left = 44;
  const right = 8;
  const top = 22;
  const bottom = 14;
  const plotW = width - left - right;
  const plotH = height - top - bottom;
  let peak = min;
  for (const s of series) for (const v of s.values) if (v !== null && v > peak) peak = v;
  const yMax = niceMax(peak);

  g.font = "11px system-ui, sans-serif";
  g.lineWidth = 1;
  g.strokeStyle = "rgba(128,128,128,0.25)";
  g.fillStyle = ink;
  g.textAlign = "right";
  g.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = top + plotH - (plotH * i) / 4;
    g.beginPath();
    g.moveTo(left, y);
    g.lineTo(left + plotW, y);
    g.stroke();
    g.fillText(`${+((yMax * i) / 4).toFixed(2)}`, left - 4, y);
  }

  const step = plotW / Math.max(1, capacity - 1);
  for (const s of series) {
    const offset = capacity - s.values.length;
    g.strokeStyle = s.color;
    g.lineWidth = 2;
    g.setLineDash(s.dashed ? [4, 3] : []);
    g.beginPath();
    let drawing = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) {
        drawing = false;
        return;
      }
      const x = left + (offset + i) * step;
      const y = top + plotH - (plotH * Math.min(v, yMax)) / yMax;
      if (drawing) g.lineTo(x, y);
      else g.moveTo(x, y);
      drawing = true;
    });
    g.stroke();
  }
  g.setLineDash([]);

  g.textAlign = "left";
  g.textBaseline = "top";
  let x = left;
  for (const s of series) {
    const last = s.values.length ? s.values[s.values.length - 1] : null;
    const text = `${s.label} ${format(last, digits)}${last === null ? "" : unit}`;
    g.fillStyle = s.color;
    g.fillRect(x, 6, 10, 3);
    g.fillStyle = ink;
    g.fillText(text, x + 14, 2);
    x += g.measureText(text).width + 30;
  }
}
