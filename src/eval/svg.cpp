#include "eval/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace d2o::eval {

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// Coordinates with one decimal: enough for a screen, stable bytes.
std::string num(double v) {
  return fmt("%.1f", v);
}

// "Nice" tick step (1, 2 or 5 times a power of ten) giving about `target` ticks over the span.
double nice_step(double span, int target) {
  if (!(span > 0)) return 1.0;
  const double raw = span / target;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  const double m = raw / p;
  return (m < 1.5 ? 1.0 : m < 3.5 ? 2.0 : m < 7.5 ? 5.0 : 10.0) * p;
}

// Tick label: integers without decimals, else the fewest decimals the step needs.
std::string tick_label(double v, double step) {
  if (std::fabs(v) < 1e-12 * std::max(1.0, step)) v = 0;
  if (std::fabs(v) >= 1e5 || (step >= 1 && std::fabs(v - std::round(v)) < 1e-9))
    return fmt("%.0f", v);
  const int dec = std::clamp(static_cast<int>(std::ceil(-std::log10(step) - 1e-9)), 0, 6);
  char f[16];
  std::snprintf(f, sizeof f, "%%.%df", dec);
  return fmt(f, v);
}

std::string text(double x, double y, const std::string& s, const char* anchor, int size,
                 const std::string& extra = "") {
  return "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\" text-anchor=\"" + anchor +
         "\" font-size=\"" + std::to_string(size) + "\"" + extra + ">" + xml_escape(s) +
         "</text>\n";
}

std::string header(int w, int h) {
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
         "width=\"" +
         std::to_string(w) + "\" height=\"" + std::to_string(h) + "\" viewBox=\"0 0 " +
         std::to_string(w) + " " + std::to_string(h) +
         "\" font-family=\"Helvetica, Arial, sans-serif\">\n<rect width=\"100%\" " +
         "height=\"100%\" fill=\"white\"/>\n";
}

}  // namespace

std::string xml_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') {
          out += ' ';
        } else {
          out += c;
        }
    }
  }
  return out;
}

const char* series_colour(size_t i) {
  // Okabe-Ito palette plus a few extras.
  static const char* kColours[] = {"#000000", "#E69F00", "#56B4E9", "#009E73", "#D55E00",
                                   "#0072B2", "#CC79A7", "#F0E442", "#7F7F7F", "#8C564B"};
  return kColours[i % (sizeof kColours / sizeof kColours[0])];
}

namespace {

std::string dash_attr(const LineSeries& s) {
  if (!s.dash.empty()) return " stroke-dasharray=\"" + xml_escape(s.dash) + "\"";
  return s.dashed ? " stroke-dasharray=\"6 4\"" : "";
}

}  // namespace

std::string render_line_chart(const LineChart& c) {
  const double W = c.width, H = c.height;
  // Legend on the right, wide enough for the longest name (about 6.2 px per character at 11 px).
  size_t longest = 0;
  for (const LineSeries& s : c.series) longest = std::max(longest, s.name.size());
  const double left = 70, top = 36, bottom = 52;
  const double right = std::max(170.0, 48 + 6.2 * static_cast<double>(longest));
  const double pw = W - left - right, ph = H - top - bottom;
  auto xv = [&](double x) { return c.log_x ? std::log10(x) : x; };
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const LineSeries& s : c.series) {
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      const double x = xv(s.x[i]);
      if (!std::isfinite(x) || !std::isfinite(s.y[i])) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x);
      y0 = std::min(y0, s.y[i]), y1 = std::max(y1, s.y[i]);
      if (i < s.lo.size() && std::isfinite(s.lo[i])) y0 = std::min(y0, s.lo[i]);
      if (i < s.hi.size() && std::isfinite(s.hi[i])) y1 = std::max(y1, s.hi[i]);
    }
  }
  if (!std::isfinite(x0)) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  if (c.y_min < c.y_max) y0 = c.y_min, y1 = c.y_max;
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) y0 -= 0.5, y1 += 0.5;
  const double ypad = (y1 - y0) * 0.04;
  if (!(c.y_min < c.y_max)) y0 -= ypad, y1 += ypad;
  auto px = [&](double x) { return left + (xv(x) - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + (1.0 - (y - y0) / (y1 - y0)) * ph; };

  std::string o = header(c.width, c.height);
  o += text(W / 2 - (right - left) / 2, 22, c.title, "middle", 15, " font-weight=\"bold\"");
  // Grid and ticks.
  const double ys = nice_step(y1 - y0, 6);
  for (double t = std::ceil(y0 / ys) * ys; t <= y1 + 1e-9 * ys; t += ys) {
    o += "<line x1=\"" + num(left) + "\" y1=\"" + num(py(t)) + "\" x2=\"" + num(left + pw) +
         "\" y2=\"" + num(py(t)) + "\" stroke=\"#e0e0e0\"/>\n";
    o += text(left - 6, py(t) + 4, tick_label(t, ys), "end", 11);
  }
  if (c.log_x) {
    for (double e = std::floor(x0); e <= x1 + 1e-9; e += 1) {
      for (int m = 1; m <= 9; ++m) {
        const double lv = e + std::log10(static_cast<double>(m));
        if (lv < x0 - 1e-9 || lv > x1 + 1e-9) continue;
        const double X = left + (lv - x0) / (x1 - x0) * pw;
        o += "<line x1=\"" + num(X) + "\" y1=\"" + num(top) + "\" x2=\"" + num(X) + "\" y2=\"" +
             num(top + ph) + "\" stroke=\"" + (m == 1 ? "#d0d0d0" : "#f0f0f0") + "\"/>\n";
        if (m == 1 || m == 2 || m == 5)
          o += text(X, top + ph + 16, fmt("%.0f", std::pow(10.0, lv)), "middle", 11);
      }
    }
  } else {
    const double xs = nice_step(x1 - x0, 8);
    for (double t = std::ceil(x0 / xs) * xs; t <= x1 + 1e-9 * xs; t += xs) {
      const double X = left + (t - x0) / (x1 - x0) * pw;
      o += "<line x1=\"" + num(X) + "\" y1=\"" + num(top) + "\" x2=\"" + num(X) + "\" y2=\"" +
           num(top + ph) + "\" stroke=\"#f0f0f0\"/>\n";
      o += text(X, top + ph + 16, tick_label(t, xs), "middle", 11);
    }
  }
  o += "<rect x=\"" + num(left) + "\" y=\"" + num(top) + "\" width=\"" + num(pw) + "\" height=\"" +
       num(ph) + "\" fill=\"none\" stroke=\"#444\"/>\n";
  o += text(left + pw / 2, H - 12, c.x_label, "middle", 12);
  o += text(16, top + ph / 2, c.y_label, "middle", 12,
            " transform=\"rotate(-90 16 " + num(top + ph / 2) + ")\"");

  // Clip the data to the plot area (a fixed y range may cut curves).
  o += "<clipPath id=\"plot\"><rect x=\"" + num(left) + "\" y=\"" + num(top) + "\" width=\"" +
       num(pw) + "\" height=\"" + num(ph) + "\"/></clipPath>\n<g clip-path=\"url(#plot)\">\n";
  for (size_t si = 0; si < c.series.size(); ++si) {
    const LineSeries& s = c.series[si];
    const char* col = series_colour(s.colour >= 0 ? static_cast<size_t>(s.colour) : si);
    const size_t n = std::min(s.x.size(), s.y.size());
    // Band: upper edge forward, lower edge backward, one polygon per finite run.
    if (s.lo.size() == n && s.hi.size() == n && n > 0) {
      size_t i = 0;
      while (i < n) {
        while (i < n &&
               !(std::isfinite(s.lo[i]) && std::isfinite(s.hi[i]) && std::isfinite(xv(s.x[i]))))
          ++i;
        size_t j = i;
        while (j < n && std::isfinite(s.lo[j]) && std::isfinite(s.hi[j]) &&
               std::isfinite(xv(s.x[j])))
          ++j;
        if (j - i >= 2) {
          std::string pts;
          for (size_t k = i; k < j; ++k) pts += num(px(s.x[k])) + "," + num(py(s.hi[k])) + " ";
          for (size_t k = j; k-- > i;) pts += num(px(s.x[k])) + "," + num(py(s.lo[k])) + " ";
          o += "<polygon points=\"" + pts + "\" fill=\"" + col +
               "\" fill-opacity=\"0.15\" stroke=\"none\"/>\n";
        }
        i = j;
      }
    }
    std::string d;
    bool pen = false;
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(s.y[i]) || !std::isfinite(xv(s.x[i]))) {
        pen = false;
        continue;
      }
      d += (pen ? "L" : "M") + num(px(s.x[i])) + " " + num(py(s.y[i])) + " ";
      pen = true;
    }
    if (!d.empty()) {
      o += "<path d=\"" + d + "\" fill=\"none\" stroke=\"" + col + "\" stroke-width=\"1.6\"" +
           dash_attr(s) + "/>\n";
    }
    if (n == 1 && std::isfinite(s.y[0])) {
      o += "<circle cx=\"" + num(px(s.x[0])) + "\" cy=\"" + num(py(s.y[0])) + "\" r=\"3\" fill=\"" +
           col + "\"/>\n";
    }
  }
  o += "</g>\n";
  // Legend.
  for (size_t si = 0; si < c.series.size(); ++si) {
    const double ly = top + 10 + 18.0 * static_cast<double>(si);
    const double lx = left + pw + 12;
    o += "<line x1=\"" + num(lx) + "\" y1=\"" + num(ly) + "\" x2=\"" + num(lx + 22) + "\" y2=\"" +
         num(ly) + "\" stroke=\"" +
         series_colour(c.series[si].colour >= 0 ? static_cast<size_t>(c.series[si].colour) : si) +
         "\" stroke-width=\"2.5\"" + dash_attr(c.series[si]) + "/>\n";
    o += text(lx + 28, ly + 4, c.series[si].name, "start", 11);
  }
  o += "</svg>\n";
  return o;
}

namespace {

// 0 -> red, 0.5 -> yellow, 1 -> green (linear in RGB between the three).
std::string heat_colour(double v) {
  v = std::clamp(v, 0.0, 1.0);
  int r, g, b;
  if (v < 0.5) {
    const double t = v / 0.5;
    r = 215, g = static_cast<int>(48 + t * (200 - 48)), b = static_cast<int>(39 + t * (60 - 39));
  } else {
    const double t = (v - 0.5) / 0.5;
    r = static_cast<int>(215 + t * (26 - 215)), g = static_cast<int>(200 + t * (150 - 200)),
    b = static_cast<int>(60 + t * (65 - 60));
  }
  char buf[16];
  std::snprintf(buf, sizeof buf, "#%02X%02X%02X", r, g, b);
  return buf;
}

}  // namespace

std::string render_heatmap(const Heatmap& m) {
  const int cols = static_cast<int>(m.x_ticks.size());
  const int rows = static_cast<int>(m.y_ticks.size());
  const double left = 80, top = 40, bottom = 56, right = 90;
  const double pw = static_cast<double>(cols) * m.cell_w, ph = static_cast<double>(rows) * m.cell_h;
  const int W = static_cast<int>(left + pw + right), H = static_cast<int>(top + ph + bottom);
  std::string o = header(W, H);
  o += text(left + pw / 2, 22, m.title, "middle", 14, " font-weight=\"bold\"");
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const size_t k = static_cast<size_t>(r) * static_cast<size_t>(cols) + static_cast<size_t>(c);
      const double v = k < m.values.size() ? m.values[k] : std::nan("");
      const double x = left + c * m.cell_w, y = top + r * m.cell_h;
      o += "<rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" + std::to_string(m.cell_w) +
           "\" height=\"" + std::to_string(m.cell_h) + "\" fill=\"" +
           (std::isfinite(v) ? heat_colour(v) : "#cccccc") + "\" stroke=\"white\"/>\n";
      if (std::isfinite(v) && !m.value_format.empty()) {
        o += text(x + m.cell_w / 2.0, y + m.cell_h / 2.0 + 4, fmt(m.value_format.c_str(), v),
                  "middle", 11);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    o += text(left - 6, top + (r + 0.5) * m.cell_h + 4, m.y_ticks[static_cast<size_t>(r)], "end",
              11);
  }
  for (int c = 0; c < cols; ++c) {
    o += text(left + (c + 0.5) * m.cell_w, top + ph + 16, m.x_ticks[static_cast<size_t>(c)],
              "middle", 11);
  }
  o += text(left + pw / 2, H - 12, m.x_label, "middle", 12);
  o += text(18, top + ph / 2, m.y_label, "middle", 12,
            " transform=\"rotate(-90 18 " + num(top + ph / 2) + ")\"");
  // Colour scale.
  const double sx = left + pw + 24, sh = std::max(ph, 60.0);
  for (int i = 0; i < 20; ++i) {
    const double v = 1.0 - (i + 0.5) / 20.0;
    o += "<rect x=\"" + num(sx) + "\" y=\"" + num(top + sh * i / 20.0) +
         "\" width=\"14\" height=\"" + num(sh / 20.0 + 0.5) + "\" fill=\"" + heat_colour(v) +
         "\"/>\n";
  }
  o += text(sx + 18, top + 8, "1", "start", 10);
  o += text(sx + 18, top + sh, "0", "start", 10);
  o += "</svg>\n";
  return o;
}

}  // namespace d2o::eval
