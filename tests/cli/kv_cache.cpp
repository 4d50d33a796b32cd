// `attn generate` with KV-cache page sizes the machine cannot hold: an
// argument error (exit 1) naming the cache and its bytes, never a crash (exit
// 139), an internal error (exit 5) or an allocation failure (exit 6).
#include "cli_test.hpp"

#include <string>

namespace attn_cli_test {
namespace {

TEST_F(Cli, GenerateRefusesPageSizesTooLargeForTheMachine) {
  ASSERT_EQ(run("train --task copy --length 4 --symbols 6 --causal --dim 16 --heads 2 --layers 1 --steps 2 "
                "--save m.safetensors").rc,
            0);
  for (const std::string page : {"9223372036854775807", "4611686018427387904", "1099511627776", "-1"}) {
    const Result g = run("generate --checkpoint m.safetensors --page " + page);
    EXPECT_EQ(g.rc, 1) << page << ": " << g.err;
    EXPECT_TRUE(contains(g.err, "page_size")) << page << ": " << g.err;
  }
  const Result ok = run("generate --checkpoint m.safetensors --page 3");
  EXPECT_EQ(ok.rc, 0) << ok.err;
}

}  // namespace
}  // namespace attn_cli_test
