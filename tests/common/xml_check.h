// A small XML well-formedness checker for the SVG files the evaluation harness writes: elements
// properly nested and closed, attribute values quoted, no stray '<' or '&' in text. Not a full
// XML parser (no DTDs, no CDATA), which the harness never writes.
#pragma once

#include <cctype>
#include <string>
#include <vector>

namespace d2o::test {

// Empty string when well-formed, else a description of the first problem.
inline std::string xml_problem(const std::string& s) {
  std::vector<std::string> stack;
  size_t i = 0;
  int roots = 0;
  auto entity_ok = [&](size_t at) {
    static const char* kEnt[] = {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"};
    for (const char* e : kEnt) {
      if (s.compare(at, std::char_traits<char>::length(e), e) == 0) return true;
    }
    return s.compare(at, 2, "&#") == 0;
  };
  while (i < s.size()) {
    if (s[i] == '&') {
      if (!entity_ok(i)) return "bad entity at byte " + std::to_string(i);
      ++i;
      continue;
    }
    if (s[i] != '<') {
      ++i;
      continue;
    }
    if (s.compare(i, 5, "<?xml") == 0) {
      const size_t e = s.find("?>", i);
      if (e == std::string::npos) return "unterminated XML declaration";
      i = e + 2;
      continue;
    }
    if (s.compare(i, 4, "<!--") == 0) {
      const size_t e = s.find("-->", i);
      if (e == std::string::npos) return "unterminated comment";
      i = e + 3;
      continue;
    }
    const bool closing = i + 1 < s.size() && s[i + 1] == '/';
    size_t j = i + (closing ? 2 : 1);
    const size_t name_start = j;
    while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '-' ||
                            s[j] == ':' || s[j] == '_'))
      ++j;
    const std::string name = s.substr(name_start, j - name_start);
    if (name.empty()) return "tag without a name at byte " + std::to_string(i);
    if (closing) {
      while (j < s.size() && std::isspace(static_cast<unsigned char>(s[j]))) ++j;
      if (j >= s.size() || s[j] != '>') return "bad closing tag </" + name;
      if (stack.empty() || stack.back() != name)
        return "</" + name + "> does not close the open element";
      stack.pop_back();
      i = j + 1;
      continue;
    }
    // Attributes: name="value" or name='value'.
    bool self_close = false;
    while (true) {
      while (j < s.size() && std::isspace(static_cast<unsigned char>(s[j]))) ++j;
      if (j >= s.size()) return "unterminated tag <" + name;
      if (s[j] == '/' && j + 1 < s.size() && s[j + 1] == '>') {
        self_close = true;
        j += 2;
        break;
      }
      if (s[j] == '>') {
        ++j;
        break;
      }
      const size_t a0 = j;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '-' ||
                              s[j] == ':' || s[j] == '_'))
        ++j;
      if (j == a0) return "bad attribute in <" + name;
      if (j >= s.size() || s[j] != '=') return "attribute without a value in <" + name;
      ++j;
      if (j >= s.size() || (s[j] != '"' && s[j] != '\'')) return "unquoted attribute in <" + name;
      const char q = s[j];
      const size_t e = s.find(q, j + 1);
      if (e == std::string::npos) return "unterminated attribute in <" + name;
      if (s.find('<', j + 1) < e) return "'<' inside an attribute of <" + name;
      j = e + 1;
    }
    if (stack.empty()) ++roots;
    if (!self_close) stack.push_back(name);
    i = j;
  }
  if (!stack.empty()) return "<" + stack.back() + "> is never closed";
  if (roots != 1) return "expected one root element, found " + std::to_string(roots);
  return "";
}

}  // namespace d2o::test
