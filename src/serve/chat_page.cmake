# Turns the chat page (src/serve/chat.html) into a C++ header holding it as one raw string, so
# that `d2o serve` answers GET / from the binary alone. Run at build time:
#   cmake -DIN=chat.html -DOUT=chat_page.h -P chat_page.cmake
# The header is rewritten only when its text changes (no needless recompiles).
file(READ "${IN}" page)
set(delim "d2o_chat_html")
string(FIND "${page}" ")${delim}\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw-string delimiter ')${delim}\"'")
endif()
file(WRITE "${OUT}.tmp"
  "// Generated from src/serve/chat.html by src/serve/chat_page.cmake; do not edit.\n"
  "#pragma once\n"
  "namespace d2o::serve {\n"
  "inline constexpr char kChatPageHtml[] = R\"${delim}(${page})${delim}\";\n"
  "}  // namespace d2o::serve\n")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
