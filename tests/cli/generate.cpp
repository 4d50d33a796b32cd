// `attn generate` on checkpoints of `attn train --causal`: a model with
// ALiBi, a sliding window and sinks (the score rules the decode kernel
// applies over its KV cache) decodes in task mode and in free mode, with
// float32 and paged bfloat16 caches; a model that is not causal is refused.
#include "cli_test.hpp"

#include <string>

namespace attn_cli_test {
namespace {

TEST_F(Cli, GenerateDecodesAModelWithAWindowSinksAndAlibi) {
  const Result t = run("train --task copy --length 6 --symbols 8 --causal --positions alibi --window 7,0 --sinks "
                       "--dim 32 --heads 4 --layers 1 --steps 300 --log-every 100 --save m.safetensors");
  ASSERT_EQ(t.rc, 0) << t.err;
  for (const std::string cache : {"", " --cache-dtype bfloat16 --page 4"}) {
    const Result g = run("generate --checkpoint m.safetensors --examples 3 --batch 2" + cache);
    ASSERT_EQ(g.rc, 0) << cache << ": " << g.err;
    EXPECT_TRUE(contains(g.out, "token accuracy")) << g.out;
    EXPECT_TRUE(contains(g.out, "tokens/s")) << g.out;
  }
  const Result f = run("generate --checkpoint m.safetensors --prompt 1,2,3 --tokens 4");
  ASSERT_EQ(f.rc, 0) << f.err;
  EXPECT_TRUE(contains(f.out, "tokens/s")) << f.out;
}

TEST_F(Cli, GenerateRefusesAModelThatIsNotCausal) {
  ASSERT_EQ(run("train --task copy --length 4 --dim 16 --heads 2 --layers 1 --steps 2 --save n.safetensors").rc, 0);
  const Result g = run("generate --checkpoint n.safetensors");
  EXPECT_NE(g.rc, 0);
  EXPECT_TRUE(contains(g.err, "not causal")) << g.err;
}

}  // namespace
}  // namespace attn_cli_test
