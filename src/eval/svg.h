// Minimal SVG charts for the evaluation reports: a line chart (series with optional uncertainty
// bands) and a heatmap (values in [0, 1] on a grid). Written by hand, with no plotting
// dependency, so a report renders on any Markdown viewer that shows images. Output is a
// complete, well-formed standalone SVG document; all text is XML-escaped; numbers are printed
// with fixed precision, so the same data gives the same bytes.
#pragma once

#include <string>
#include <vector>

namespace d2o::eval {

struct LineSeries {
  std::string name;
  std::vector<double> x, y;
  // Optional uncertainty band (same length as x), drawn as a translucent area; empty: none.
  std::vector<double> lo, hi;
  bool dashed = false;  // e.g. the reference curve
  // Optional style overrides: a palette index (series_colour) instead of the series' position,
  // and a stroke-dasharray ("2 3") instead of `dashed`'s.
  int colour = -1;
  std::string dash;
};

struct LineChart {
  std::string title;
  std::string x_label, y_label;
  std::vector<LineSeries> series;
  bool log_x = false;
  // Fixed y range when y_min < y_max; otherwise fitted to the data (bands included).
  double y_min = 0, y_max = 0;
  int width = 720, height = 420;
};

struct Heatmap {
  std::string title;
  std::string x_label, y_label;
  std::vector<std::string> x_ticks;  // column labels
  std::vector<std::string> y_ticks;  // row labels (top to bottom)
  // [rows, cols], row-major, in [0, 1] (NaN: no data, drawn grey); printed in each cell.
  std::vector<double> values;
  std::string value_format = "%.2f";  // printf format of the number in a cell ("" = none)
  int cell_w = 64, cell_h = 30;
};

// Non-finite points of a series are skipped (the line is broken there).
std::string render_line_chart(const LineChart& chart);
// Red (0) to yellow to green (1), as the paper's needle-in-a-haystack figures.
std::string render_heatmap(const Heatmap& map);

// Escapes & < > " ' for XML text and attributes.
std::string xml_escape(const std::string& s);

// The colour of series i (a fixed palette, distinguishable and colour-blind friendly).
const char* series_colour(size_t i);

}  // namespace d2o::eval
