// The explainer's requests answered by the native build: one JSON request per
// line on stdin, one answer per line on stdout. The browser tests send the
// page's requests here too and compare the numbers with the WebAssembly
// build's.
#include <iostream>
#include <string>

#include "requests.hpp"

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    nlohmann::json r = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    std::cout << (r.is_discarded() ? nlohmann::json{{"error", "explainer: the request is not JSON"}}
                                   : attn::web::handle(r))
                     .dump()
              << std::endl;
  }
  return 0;
}
