// Every kind of bad input to the attn tool, as one table: the arguments, the
// exit code they must give and the fragments stderr must contain. A new error
// case is one row of kErrors (and, if it needs one, a file written in
// write_fixture_files). Exit codes: 1 invalid input, 2 usage error, 3 file
// error, 4 feature not built (docs/cli.md).
//
// Besides its own row, every case is held to the rule of docs/cli.md that a
// failed command writes nothing: after each run the directory holds exactly
// the fixture files, byte for byte (no new output, no temporary left behind,
// no existing output replaced; y.npy exists beforehand to catch the last).
#include "cli_test.hpp"

#include <map>
#include <random>
#include <string>
#include <vector>

namespace attn_cli_test {
namespace {

using attn::io::Array;
using attn::io::DType;

struct CliError {
  const char* args;                    // after `attn `, run in the fixture directory
  int exit_code;
  std::vector<std::string> fragments;  // each must appear in stderr
};

const std::vector<CliError> kErrors = {
    // ---- usage: the command line itself (exit 2)
    {"", 2, {}},
    {"frobnicate", 2, {}},  // (issue 11 item 16: the message should name it)
    {"sdpa --q only.npy", 2, {}},
    {"explain --example dog", 2, {"dog"}},
    {"explain --example cat --dk 8", 2, {}},
    {"explain --example random --dim 7 --heads 2", 2, {}},
    {"experiment jacobian --plot j.png", 2, {}},
    {"experiment nonsense", 2, {"nonsense"}},
    {"train --task reverses --steps 1", 2, {"--task", "reverses"}},
    {"train --positions spiral --steps 1", 2, {"spiral"}},
    {"train --dropout 1.5 --steps 1", 2, {"--dropout", "0 <= P < 1", "'1.5'"}},
    {"train --dropout -0.1 --steps 1", 2, {"--dropout", "'-0.1'"}},
    {"train --precision fp16 --steps 1", 2, {"--precision", "fp16 not in {fp32,bf16}"}},
    {"train --precision x --steps 1", 2, {"--precision", "x not in {fp32,bf16}"}},
    {"heatmap --out h.png", 2, {}},
    {"heatmap --weights a.npy --checkpoint c.safetensors --out h.png", 2, {}},
    // a source's options are refused with the other source instead of being ignored
    {"heatmap --checkpoint c.safetensors --labels 'a b' --out h.png", 2, {"--labels"}},
    {"heatmap --checkpoint c.safetensors --batch 1 --out h.png", 2, {}},
    {"heatmap --weights a.npy --example 3 --out h.png", 2, {"--example"}},
    {"heatmap --weights a.npy --task reverse --out h.png", 2, {}},

    // ---- sdpa: inputs that do not fit together (exit 1)
    {"sdpa --q q.npy --k k_e5.npy --v v.npy --out y.npy", 1,
     {"--k k_e5.npy has shape (6, 5) but --q q.npy has shape (4, 8)"}},
    {"sdpa --q q.npy --k k.npy --v v_s5.npy --out y.npy", 1, {"--v v_s5.npy has shape (5, 3)"}},
    {"sdpa --q q_rank3.npy --k k.npy --v v.npy --out y.npy", 1, {"same number of axes"}},
    // 3 key heads do not divide 4 query heads
    {"sdpa --q q_h4.npy --k k_h3.npy --v v_h3.npy --out y.npy", 1, {"Hkv dividing H = 4", "k = k_h3.npy"}},
    {"sdpa --q q.npy --k k.npy --v v.npy --mask m_random.npy --out y.npy", 1, {"--mask m_random.npy holds"}},
    {"sdpa --q q.npy --k k.npy --v v.npy --backend turbo --out y.npy", 1, {"unknown backend 'turbo'"}},
    {"sdpa --q q.npy --k k.npy --v v.npy --out no/such/dir/y.npy", 3, {"no/such/dir/y.npy"}},

    // ---- malformed or missing input files: exit 3 naming the file and what is wrong
    {"sdpa --q badmagic.npy --k k.npy --v v.npy --out y.npy", 3, {"badmagic.npy", "bad magic"}},
    {"sdpa --q liar.npy --k k.npy --v v.npy --out y.npy", 3, {"liar.npy", "runs past the end of the file"}},
    {"sdpa --q overflow.npy --k k.npy --v v.npy --out y.npy", 3, {"overflow.npy", "more elements than"}},
    {"sdpa --q truncated.npy --k k.npy --v v.npy --out y.npy", 3, {"truncated.npy", "truncated"}},
    {"sdpa --q int.npy --k k.npy --v v.npy --out y.npy", 3, {"int.npy", "unsupported dtype '<i8'"}},
    {"sdpa --q empty.npy --k k.npy --v v.npy --out y.npy", 3, {"empty.npy", "not a .npy file"}},
    {"sdpa --q missing.npy --k k.npy --v v.npy --out y.npy", 3, {"missing.npy", "cannot open"}},
    {"mha --weights outside.safetensors --x x.npy --out y.npy", 3, {"outside.safetensors", "outside the"}},
    {"mha --weights liar.safetensors --x x.npy --out y.npy", 3, {"liar.safetensors", "header length"}},
    {"mha --weights bf16.safetensors --x x.npy --out y.npy", 3, {"bf16.safetensors", "unsupported dtype 'BF16'"}},

    // ---- mha: a state_dict that does not fit the layer (exit 1)
    {"mha --weights bad_shape.safetensors --x x.npy --out y.npy", 1,
     {"tensor 'in_proj_weight' in bad_shape.safetensors has shape (24, 6)"}},
    {"mha --weights extra.safetensors --x x.npy --out y.npy", 1, {"holds tensor 'encoder.w'"}},
    {"mha --weights no_out_proj.safetensors --x x.npy --out y.npy", 1, {"lacks tensor 'out_proj.weight'"}},
    {"mha --weights half_bias.safetensors --x x.npy --out y.npy", 1, {"only one of in_proj_bias and out_proj.bias"}},
    {"mha --weights ok.safetensors --x x.npy --heads 3 --out y.npy", 1,
     {"--heads 3 must be >= 1 and divide the model width D = 8"}},

    // ---- heatmap from a weights file (exit 1)
    {"heatmap --weights a.npy --labels 'too few' --out h.png", 1, {"--labels has 2 words"}},
    {"heatmap --weights a_rank1.npy --out h.png", 1, {}},

    // ---- train and the checkpoint heatmap
    {"train --steps 1 --resume missing.safetensors", 3, {"missing.safetensors: no such file (given as --resume)"}},
    {"train --steps 1 --dim 8 --heads 3", 1, {"heads"}},
    {"heatmap --checkpoint missing.safetensors --out h.png", 3, {"missing.safetensors: no such file (given as --checkpoint)"}},
    {"heatmap --checkpoint junk.safetensors --out h.png", 3, {"junk.safetensors"}},  // not a safetensors file
};

// The files the rows above name.
void write_fixture_files(Cli& t) {
  std::mt19937_64 rng(5);
  // sdpa: q (L=4, E=8), k (S=6, E=8), v (S=6, Ev=3), and ones that do not fit them
  t.write_random<float>("q.npy", {4, 8}, rng);
  t.write_random<float>("k.npy", {6, 8}, rng);
  t.write_random<float>("v.npy", {6, 3}, rng);
  t.write_random<float>("k_e5.npy", {6, 5}, rng);
  t.write_random<float>("v_s5.npy", {5, 3}, rng);
  t.write_random<float>("q_rank3.npy", {2, 4, 8}, rng);
  t.write_random<float>("q_h4.npy", {1, 4, 5, 8}, rng);
  t.write_random<float>("k_h3.npy", {1, 3, 6, 8}, rng);
  t.write_random<float>("v_h3.npy", {1, 3, 6, 2}, rng);
  t.write_random<float>("m_random.npy", {4, 7}, rng);  // not 0/1
  const std::vector<float> old = {42};
  attn::io::write_npy(t.path("y.npy"), {1}, old.data());  // an existing output no failure may replace

  // malformed .npy files
  const std::string magic("\x93NUMPY\x01\x00", 8);
  auto npy = [&](const std::string& dict, const std::string& data, int len_override = -1) {
    std::string h = dict;
    while ((10 + h.size() + 1) % 16) h += ' ';
    h += '\n';
    const size_t n = len_override >= 0 ? size_t(len_override) : h.size();
    return magic + std::string(1, char(n & 0xff)) + std::string(1, char(n >> 8)) + h + data;
  };
  const std::string data(4 * 32, '\0');
  t.put("badmagic.npy", "PK\x03\x04 this is a zip file, not an array");
  t.put("liar.npy", npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 8), }", data, 60000));
  t.put("overflow.npy", npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4), }", data));
  t.put("truncated.npy", npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 8), }", data.substr(0, 50)));
  t.put("int.npy", npy("{'descr': '<i8', 'fortran_order': False, 'shape': (4, 4), }", data));
  t.put("empty.npy", "");

  // malformed safetensors: offsets outside the file, lying header length, wrong dtype
  auto st = [&](const std::string& js, const std::string& payload, uint64_t declared) {
    std::string b(8, '\0');
    for (int i = 0; i < 8; ++i) b[size_t(i)] = char((declared >> (8 * i)) & 0xff);
    return b + js + payload;
  };
  const std::string w =
      R"({"in_proj_weight":{"dtype":"F32","shape":[24,8],"data_offsets":[0,768]},)"
      R"("out_proj.weight":{"dtype":"F32","shape":[8,8],"data_offsets":[768,99999]}})";
  t.put("outside.safetensors", st(w, std::string(1024, '\0'), w.size()));
  t.put("liar.safetensors", st(w, std::string(1024, '\0'), uint64_t(1) << 40));
  const std::string bf = R"({"in_proj_weight":{"dtype":"BF16","shape":[24,8],"data_offsets":[0,384]}})";
  t.put("bf16.safetensors", st(bf, std::string(384, '\0'), bf.size()));

  // mha: x (N=5, D=8) and state_dicts that do not fit a width-8 layer
  t.write_random<float>("x.npy", {5, 8}, rng);
  auto save = [&](const std::string& f, std::map<std::string, std::vector<int64_t>> shapes) {
    std::map<std::string, Array<float>> sd;
    for (auto& [name, s] : shapes) {
      int64_t n = 1;
      for (auto d : s) n *= d;
      sd[name] = {s, std::vector<float>(static_cast<size_t>(n), 0.1f), DType::f32};
    }
    attn::io::write_safetensors(t.path(f), sd);
  };
  save("bad_shape.safetensors", {{"in_proj_weight", {24, 6}}, {"out_proj.weight", {8, 8}}});
  save("extra.safetensors", {{"in_proj_weight", {24, 8}}, {"out_proj.weight", {8, 8}}, {"encoder.w", {2}}});
  save("no_out_proj.safetensors", {{"in_proj_weight", {24, 8}}});
  save("half_bias.safetensors", {{"in_proj_weight", {24, 8}}, {"out_proj.weight", {8, 8}}, {"in_proj_bias", {24}}});
  save("ok.safetensors", {{"in_proj_weight", {24, 8}}, {"out_proj.weight", {8, 8}}});

  // heatmap weights: (H=2, L=3, S=3) rows of 1/3, and one of rank 1
  const std::vector<double> a(2 * 3 * 3, 1.0 / 3), a5(5, 0.2);
  attn::io::write_npy(t.path("a.npy"), {2, 3, 3}, a.data());
  attn::io::write_npy(t.path("a_rank1.npy"), {5}, a5.data());
  t.put("junk.safetensors", "not a checkpoint");
}

// Every file of the directory with its bytes, but the captured output.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string name = fs::relative(e.path(), dir).string();
    if (name != "out.txt" && name != "err.txt") files[name] = e.is_regular_file() ? slurp(e.path()) : "<dir>";
  }
  return files;
}

TEST_F(Cli, EveryErrorCaseExitsWithItsCodeNamesTheProblemAndWritesNothing) {
  write_fixture_files(*this);
  const auto before = snapshot(dir_);
  for (const CliError& c : kErrors) {
    SCOPED_TRACE(std::string("attn ") + c.args);
    const Result r = run(c.args);
    EXPECT_EQ(r.rc, c.exit_code) << r.err;
    for (const std::string& f : c.fragments) EXPECT_TRUE(contains(r.err, f)) << "stderr lacks '" << f << "': " << r.err;
    EXPECT_FALSE(r.err.empty()) << "a failure says why on stderr";
    EXPECT_EQ(snapshot(dir_), before) << "a failed command must leave the directory as it was";
  }
}

}  // namespace
}  // namespace attn_cli_test
