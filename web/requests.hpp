// The browser explainer's one entry point: a JSON request in, a JSON answer
// out. The page (web/page/explainer.js) sends requests to this code compiled
// to WebAssembly (web/explainer.cpp); the browser tests send the same
// requests to the native build (web/native.cpp) and compare the answers.
//
// Requests ({"op": ..., ...}); matrices are arrays of rows:
//   example  {name: "cat" | "two-tokens"}             -> the worked example's Q, K, V, labels, positions
//   tokens   {words, dim, dk, seed}                    -> X, W_Q, W_K, W_V (lesson::token_example)
//   head     {Q, K, V | X, Wq, Wk, Wv; qpos?, variants?} -> every step (lesson::head_steps)
//            variants: {scale, causal, window: [left, right], chunk_size, softcap, slope, sink}
//   dk       {dk, seed, pairs, trials, batch}          -> the variance, saturation and Jacobian figures at d_k
//   permute  {X, Wq, Wk, Wv, perm, positions, causal}  -> lesson::permutation_check
//   model    {path, words}                             -> the trained model on the words: per-layer
//                                                         weights (H, N, N), labels, predictions
// Errors come back as {"error": message}.
#pragma once

#include <nlohmann/json.hpp>

namespace attn::web {

nlohmann::json handle(const nlohmann::json& request);

}  // namespace attn::web
