// attn — exact, fast, trainable self-attention. The umbrella header.
#pragma once

#include "attn/error.hpp"
#include "attn/kv_cache.hpp"
#include "attn/merge.hpp"
#include "attn/multihead.hpp"
#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"
#include "attn/varlen.hpp"
