// Trains a small transformer on a synthetic task with the training library
// (attn::nn::train) and prints the curve and the held-out accuracy: the
// library calls behind `attn train`, without its command line.
//   build/examples/train [copy|reverse|sort|recall] [steps]
// `attn train --help` lists every option of the configuration.
#include <cstdio>
#include <exception>
#include <string>

#include "attn/nn.hpp"

int main(int argc, char** argv) {
  namespace nn = attn::nn;
  try {
    const nn::TaskKind task = nn::parse_task(argc > 1 ? argv[1] : "reverse");
    nn::TrainConfig c = nn::default_config(task);  // 2 layers, D = 64, 4 heads, rope, AdamW
    if (argc > 2) c.steps = std::stoll(argv[2]);
    c.eval_every = 200;
    c.log_every = 100;
    c.validate();  // throws attn::Error naming the field
    const nn::TrainResult r = nn::train(c, [](const nn::TrainRecord& t) {
      std::printf("step %5lld  loss %.4f  token acc %.3f", static_cast<long long>(t.step + 1), t.loss, t.token_acc);
      if (t.eval_token_acc >= 0) std::printf("  held-out %.4f", t.eval_token_acc);
      std::printf("\n");
    });
    std::printf("%s: %lld parameters, %lld steps in %.1f s; held-out token accuracy %.4f, exact sequences %.4f\n",
                nn::task_name(task), static_cast<long long>(r.num_parameters), static_cast<long long>(r.steps_done),
                r.seconds, r.final_eval.token_acc, r.final_eval.seq_acc);
  } catch (const std::exception& e) {  // attn::Error, or a steps argument that is not a number
    std::fprintf(stderr, "train: %s\n", e.what());
    return 1;
  }
  return 0;
}
