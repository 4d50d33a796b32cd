// The WebAssembly module's one export: a JSON request in, a JSON answer out
// (requests.hpp). The answer's text stays valid until the next call.
#include <emscripten.h>

#include <string>

#include "requests.hpp"

extern "C" EMSCRIPTEN_KEEPALIVE const char* attn_web_call(const char* request) {
  static std::string answer;
  nlohmann::json r = nlohmann::json::parse(request, nullptr, /*allow_exceptions=*/false);
  answer = r.is_discarded() ? nlohmann::json{{"error", "explainer: the request is not JSON"}}.dump()
                            : attn::web::handle(r).dump();
  return answer.c_str();
}
