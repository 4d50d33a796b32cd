// attn::io alone: a safetensors round trip in memory through an installed libattn_io.
#include <attn/io.hpp>

#include <cstdio>

int main() {
  std::map<std::string, attn::io::Array<float>> t;
  t["w"] = {{2, 2}, {1, 2, 3, 4}};
  const auto bytes = attn::io::encode_safetensors(t, {{"step", "7"}});
  attn::io::Metadata meta;
  const auto back = attn::io::parse_safetensors<float>(bytes.data(), bytes.size(), "memory", {}, &meta);
  const auto& w = back.at("w");
  std::printf("w %s, last %.1f, step %s\n", attn::shape_str(w.shape).c_str(), w.data[3], meta["step"].c_str());
  return w.shape == std::vector<int64_t>{2, 2} && w.data[3] == 4 && meta["step"] == "7" ? 0 : 1;
}
