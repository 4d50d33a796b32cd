// The pre-LayerNorm transformer: the layers composed, and the backward that
// walks the same composition in reverse. Residual connections are the two
// additions in each block; their backward sends the incoming gradient both
// through the branch and straight on (d(a + f(a)) = da + df).
#include "attn/nn/model.hpp"

#include <cmath>
#include <map>
#include <sstream>
#include <type_traits>

#include "nn/common.hpp"
#include "validate.hpp"

namespace attn::nn {

namespace {
constexpr detail::NamedValue<Precision> kPrecisions[] = {{Precision::fp32, "fp32"}, {Precision::bf16, "bf16"}};
}  // namespace

const char* precision_name(Precision p) { return detail::name_of(kPrecisions, p); }

Precision parse_precision(const std::string& name) {
  return detail::Checker{"nn::parse_precision"}.parse(kPrecisions, name, "precision");
}

void ModelConfig::validate() const {
  const attn::detail::Checker c{"nn::ModelConfig"};
  if (vocab < 1) c.fail("vocab is " + std::to_string(vocab) + ", expected >= 1");
  if (max_len < 1) c.fail("max_len is " + std::to_string(max_len) + ", expected >= 1");
  if (dim < 1) c.fail("dim is " + std::to_string(dim) + ", expected >= 1");
  if (heads < 1 || dim % heads != 0)
    c.fail("heads is " + std::to_string(heads) + ", expected a divisor of dim = " + std::to_string(dim));
  if (layers < 0) c.fail("layers is " + std::to_string(layers) + ", expected >= 0");
  if (mlp_hidden < 0) c.fail("mlp_hidden is " + std::to_string(mlp_hidden) + ", expected >= 0 (0 = 4·dim)");
  if (positions == Positions::rope && (dim / heads) % 2 != 0)
    c.fail("positions 'rope' needs an even head dimension dim/heads, got " + std::to_string(dim / heads));
  if (attn_scale && !(std::isfinite(*attn_scale) && *attn_scale > 0))
    c.fail("attn_scale must be finite and > 0");
  if (window.left < -1 || window.right < -1)
    c.fail("window is (" + std::to_string(window.left) + ", " + std::to_string(window.right) +
           "), expected each side >= 0, or -1 for unbounded");
  if (chunk_size < 0) c.fail("chunk_size is " + std::to_string(chunk_size) + ", expected >= 0 (0 = off)");
  if (!(dropout >= 0 && dropout < 1)) {
    std::ostringstream os;
    os << "dropout is " << dropout << ", expected 0 <= dropout < 1";
    c.fail(os.str());
  }
  if (precision == Precision::bf16 && backend == Backend::reference)
    c.fail("precision is bf16, which the reference backend does not compute (it is exact); use backend automatic or fused");
}

ParameterShapes parameter_shapes(const ModelConfig& config) {
  config.validate();
  const int64_t D = config.dim, V = config.vocab, F = config.mlp_hidden == 0 ? 4 * D : config.mlp_hidden;
  ParameterShapes p = {{"embed.weight", {V, D}}};
  if (config.positions == Positions::learned) p.push_back({"pos.weight", {config.max_len, D}});
  auto norm = [&](const std::string& pre) {
    p.push_back({pre + "weight", {D}});
    p.push_back({pre + "bias", {D}});
  };
  auto linear = [&](const std::string& pre, int64_t in, int64_t out) {
    p.push_back({pre + "weight", {out, in}});
    p.push_back({pre + "bias", {out}});
  };
  for (int64_t l = 0; l < config.layers; ++l) {
    const std::string pre = "blocks." + std::to_string(l) + ".";
    norm(pre + "ln1.");
    p.push_back({pre + "attn.in_proj_weight", {3 * D, D}});
    p.push_back({pre + "attn.in_proj_bias", {3 * D}});
    linear(pre + "attn.out_proj.", D, D);
    if (config.sinks) p.push_back({pre + "attn.sinks", {config.heads}});
    norm(pre + "ln2.");
    linear(pre + "mlp.fc1.", D, F);
    linear(pre + "mlp.fc2.", F, D);
  }
  norm("ln_f.");
  linear("head.", D, V);
  return p;
}

template <class T>
Transformer<T>::Transformer(const ModelConfig& config, uint64_t seed) : cfg_(config) {
  cfg_.validate();
  if (std::is_same_v<T, double> && cfg_.precision == Precision::bf16)
    throw InvalidArgument("attn::nn::Transformer: precision bf16 needs a float model (Transformer<float>), not double");
  if (cfg_.mlp_hidden == 0) cfg_.mlp_hidden = 4 * cfg_.dim;
  embed_ = Embedding<T>(cfg_.vocab, cfg_.dim);
  if (cfg_.positions == Positions::learned) pos_ = LearnedPositions<T>(cfg_.max_len, cfg_.dim);
  MhaOptions ao;
  ao.sdpa.causal = cfg_.causal;
  ao.sdpa.window = cfg_.window;
  ao.sdpa.chunk_size = cfg_.chunk_size;
  ao.sdpa.scale = cfg_.attn_scale;
  ao.sdpa.backend = cfg_.backend;
  if (cfg_.precision == Precision::bf16) ao.sdpa.compute_dtype = Dtype::bfloat16;
  blocks_.reserve(size_t(cfg_.layers));
  for (int64_t l = 0; l < cfg_.layers; ++l)
    blocks_.push_back({LayerNorm<T>(cfg_.dim), LayerNorm<T>(cfg_.dim),
                       SelfAttention<T>(cfg_.dim, cfg_.heads, ao, cfg_.positions, cfg_.sinks),
                       Mlp<T>(cfg_.dim, cfg_.mlp_hidden), {}, {}, {}});
  ln_f_ = LayerNorm<T>(cfg_.dim);
  head_ = Linear<T>(cfg_.dim, cfg_.vocab);
  reset_parameters(seed);
}

template <class T>
void Transformer<T>::reset_parameters(uint64_t seed) {
  // One stream per component, so adding a layer does not reshuffle the others.
  Rng r0(derive_seed(seed, 0));
  embed_.reset_parameters(r0);
  if (cfg_.positions == Positions::learned) {
    Rng r(derive_seed(seed, 1));
    pos_.reset_parameters(r);
  }
  for (size_t l = 0; l < blocks_.size(); ++l) {
    Rng r(derive_seed(seed, 100 + l));
    blocks_[l].ln1.reset_parameters();
    blocks_[l].attn.reset_parameters(r);
    blocks_[l].ln2.reset_parameters();
    blocks_[l].mlp.reset_parameters(r);
  }
  ln_f_.reset_parameters();
  Rng rh(derive_seed(seed, 2));
  head_.reset_parameters(rh);
}

template <class T>
void Transformer<T>::forward(const int32_t* tokens, int64_t B, int64_t N, Tensor<T>& logits,
                             std::vector<Tensor<T>>* attention, std::optional<DropoutKey> dropout) {
  if (B < 1 || N < 1)
    throw InvalidArgument("attn::nn::Transformer::forward: B and N must be >= 1, got " + std::to_string(B) + " and " +
                std::to_string(N));
  if (N > cfg_.max_len)
    throw InvalidArgument("attn::nn::Transformer::forward: sequence length N = " + std::to_string(N) +
                " exceeds the model's max_len = " + std::to_string(cfg_.max_len));
  const int64_t M = B * N;
  tokens_.assign(tokens, tokens + M);
  B_ = B;
  N_ = N;
  hs_.resize(blocks_.size() + 1);
  // h_0 = Embed(tokens) + positions
  embed_.forward(tokens, M, hs_[0]);
  if (cfg_.positions == Positions::sinusoidal) add_sinusoidal_positions(hs_[0], B, N);
  if (cfg_.positions == Positions::learned) pos_.forward(hs_[0], B, N);
  if (attention) attention->resize(blocks_.size());
  Tensor<T> tmp;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    auto& blk = blocks_[l];
    const Tensor<T>& h = hs_[l];
    View4<T> w;
    if (attention) {
      (*attention)[l] = Tensor<T>({B, cfg_.heads, N, N});
      w = (*attention)[l].view4();
    }
    // a = h + Attn(LN1(h)), in a training step with block l's dropout mask
    AttentionDropout drop;
    if (dropout && cfg_.dropout > 0) drop = {cfg_.dropout, dropout->seed, dropout->offset + l};
    blk.ln1.forward(h, blk.x1);
    blk.attn.forward(blk.x1, B, N, tmp, w, drop);
    ensure_shape(blk.a, {M, cfg_.dim});
    for (size_t i = 0; i < blk.a.size(); ++i) blk.a[i] = h[i] + tmp[i];
    // h' = a + MLP(LN2(a))
    blk.ln2.forward(blk.a, blk.x2);
    blk.mlp.forward(blk.x2, tmp);
    ensure_shape(hs_[l + 1], {M, cfg_.dim});
    for (size_t i = 0; i < tmp.size(); ++i) hs_[l + 1][i] = blk.a[i] + tmp[i];
  }
  // logits = LN_f(h_L)·W_headᵀ + b
  ln_f_.forward(hs_.back(), hf_);
  head_.forward(hf_, logits);
}

template <class T>
void Transformer<T>::backward(const Tensor<T>& dlogits) {
  const int64_t M = B_ * N_;
  if (M == 0) throw InvalidArgument("attn::nn::Transformer::backward: called before forward");
  rows_of(dlogits, cfg_.vocab, "attn::nn::Transformer::backward", "dlogits");
  if (dlogits.dim(0) != M)
    throw InvalidArgument("attn::nn::Transformer::backward: dlogits has " + std::to_string(dlogits.dim(0)) +
                " rows, expected the forward's B·N = " + std::to_string(M));
  Tensor<T> dhf, dh, dbranch, dln, da;
  head_.backward(hf_, dlogits, &dhf);
  ln_f_.backward(hs_.back(), dhf, &dh);
  for (size_t l = blocks_.size(); l-- > 0;) {
    auto& blk = blocks_[l];
    // h' = a + MLP(LN2(a))  ->  da = dh' + LN2ᵀ(MLPᵀ(dh'))
    blk.mlp.backward(blk.x2, dh, &dbranch);
    blk.ln2.backward(blk.a, dbranch, &dln);
    da = dh;
    for (size_t i = 0; i < da.size(); ++i) da[i] += dln[i];
    // a = h + Attn(LN1(h))  ->  dh = da + LN1ᵀ(Attnᵀ(da))
    blk.attn.backward(blk.x1, da, &dbranch);
    blk.ln1.backward(hs_[l], dbranch, &dln);
    dh = da;
    for (size_t i = 0; i < dh.size(); ++i) dh[i] += dln[i];
  }
  // h_0 = Embed(tokens) + P: both receive dh_0 (sinusoids have no parameters)
  if (cfg_.positions == Positions::learned) pos_.backward(dh, B_, N_);
  embed_.backward(tokens_.data(), M, dh);
}

template <class T>
CrossEntropyResult Transformer<T>::loss(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t N,
                                        bool with_grad, std::optional<DropoutKey> dropout) {
  Tensor<T> logits, dlogits;
  forward(tokens, B, N, logits, nullptr, dropout);
  const CrossEntropyResult r = softmax_cross_entropy(logits, targets, with_grad ? &dlogits : nullptr);
  if (with_grad) backward(dlogits);
  return r;
}

template <class T>
DecodeState Transformer<T>::start_decoding(int64_t B, Dtype dtype, int64_t page_size) const
  requires std::same_as<T, float>
{
  const char* fn = "attn::nn::Transformer::start_decoding";
  if (!cfg_.causal) throw InvalidArgument(std::string(fn) + ": the model is not causal; every token would see later ones");
  if (B < 1) throw InvalidArgument(std::string(fn) + ": B is " + std::to_string(B) + ", expected >= 1");
  DecodeState st;
  st.B = B;
  KVCacheConfig kc;
  kc.batch = B;
  kc.kv_heads = cfg_.heads;
  kc.capacity = cfg_.max_len;
  kc.head_dim = cfg_.dim / cfg_.heads;
  kc.dtype = dtype;
  kc.page_size = page_size;
  for (size_t l = 0; l < blocks_.size(); ++l) st.caches.emplace_back(kc);
  return st;
}

// The same composition as forward(), for the n new positions only; the
// attention of each block (the multi-head layer's decode) reads the earlier
// positions' keys and values from its cache instead of recomputing them:
//   a = h + Attn.decode(LN1(h), cache);   h' = a + MLP(LN2(a))
template <class T>
void Transformer<T>::decode_step(DecodeState& st, const int32_t* tokens, int64_t n, Tensor<T>& logits)
  requires std::same_as<T, float>
{
  const char* fn = "attn::nn::Transformer::decode_step";
  if (!std::is_same_v<T, float>) throw InvalidArgument(std::string(fn) + ": incremental decoding is float32 only");
  if (st.caches.size() != blocks_.size() || st.B < 1)
    throw InvalidArgument(std::string(fn) + ": the state does not come from this model's start_decoding");
  if (n < 1 || st.length + n > cfg_.max_len)
    throw InvalidArgument(std::string(fn) + ": feeding " + std::to_string(n) + " tokens after " +
                          std::to_string(st.length) + " needs 1 <= n and length + n <= max_len = " +
                          std::to_string(cfg_.max_len));
  // Every block's cache must take the n tokens before the first one is
  // appended to (each block's decode checks only its own).
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const KVCache& c = st.caches[l];
    const std::string which = "the cache of block " + std::to_string(l);
    if (c.batch() != st.B || c.kv_heads() != cfg_.heads || c.head_dim() != cfg_.dim / cfg_.heads)
      throw InvalidArgument(std::string(fn) + ": " + which + " does not come from this model's start_decoding");
    for (int64_t b = 0; b < st.B; ++b)
      if (c.length(b) != st.length)
        throw InvalidArgument(std::string(fn) + ": " + which + " holds " + std::to_string(c.length(b)) +
                              " tokens of sequence " + std::to_string(b) + ", the state " +
                              std::to_string(st.length));
    if (std::string why = c.append_refusal(n); !why.empty())
      throw InvalidArgument(std::string(fn) + ": " + which + " cannot take " + std::to_string(n) + " more tokens: " +
                            why);
  }
  const int64_t B = st.B, M = B * n, pos = st.length;
  Tensor<T> h, x, y, a;
  embed_.forward(tokens, M, h);  // checks the ids
  if (cfg_.positions == Positions::sinusoidal) add_sinusoidal_positions(h, B, n, pos);
  if (cfg_.positions == Positions::learned) pos_.forward(h, B, n, pos);
  size_t appended = 0;  // blocks whose caches took the step's tokens
  try {
    for (size_t l = 0; l < blocks_.size(); ++l) {
      auto& blk = blocks_[l];
      blk.ln1.forward(h, x);
      // `if constexpr`: clang 14 (the WebAssembly build, web/) instantiates this body for double too.
      if constexpr (std::same_as<T, float>) blk.attn.decode(x, B, n, st.caches[l], y);
      appended = l + 1;
      ensure_shape(a, {M, cfg_.dim});
      for (size_t i = 0; i < a.size(); ++i) a[i] = h[i] + y[i];
      blk.ln2.forward(a, x);
      blk.mlp.forward(x, y);
      for (size_t i = 0; i < h.size(); ++i) h[i] = a[i] + y[i];
    }
  } catch (...) {  // e.g. check_finite in a later block: the earlier caches drop the step's tokens again
    for (size_t l = 0; l < appended; ++l)
      for (int64_t b = 0; b < B; ++b) st.caches[l].truncate(b, pos);
    throw;
  }
  st.length += n;
  ln_f_.forward(h, x);
  head_.forward(x, logits);
}

template <class T>
std::vector<ParamRef<T>> Transformer<T>::parameters() {
  std::vector<ParamRef<T>> p;
  embed_.collect("embed.", p);
  if (cfg_.positions == Positions::learned) pos_.collect("pos.", p);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const std::string pre = "blocks." + std::to_string(l) + ".";
    blocks_[l].ln1.collect(pre + "ln1.", p);
    blocks_[l].attn.collect(pre + "attn.", p);
    blocks_[l].ln2.collect(pre + "ln2.", p);
    blocks_[l].mlp.collect(pre + "mlp.", p);
  }
  ln_f_.collect("ln_f.", p);
  head_.collect("head.", p);
  return p;
}

template <class T>
void Transformer<T>::zero_grad() {
  for (auto& p : parameters()) p.grad->fill(T(0));
}

template <class T>
int64_t Transformer<T>::num_parameters() {
  int64_t n = 0;
  for (auto& p : parameters()) n += int64_t(p.value->size());
  return n;
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace attn::nn
